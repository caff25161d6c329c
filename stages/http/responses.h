#pragma once
// OpenAI's Responses API (POST /v1/responses) over the chat completions the front already serves:
// a Responses request becomes a chat request (its input items as messages, its function tools as
// chat tools, text.format as response_format), and the chat answer becomes a response object, or,
// streamed, the chat chunks become the Responses events (response.created, output items, text and
// argument deltas, response.completed). Nothing is stored: previous_response_id is refused.

#include <cstdint>
#include <string>
#include <variant>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "stages/http/openai.h"
#include "stages/http/sse.h"

namespace moeline::stages::http {

// What the response object repeats of its request.
struct ResponsesRequest {
  std::string id;         // resp_ and 24 hex digits
  std::string chat_body;  // the chat completions request it is served as
  nlohmann::json echo;    // instructions, max_output_tokens, tools, tool_choice, text, ...
  bool stream = false;
};

// The chat request that serves a Responses request body, or why it cannot be served (OpenAI's
// error object, `param` naming the field).
std::variant<ResponsesRequest, ApiError> parse_responses_request(const std::string& body);

// The response object for the chat completion `chat` (a chat.completion body).
nlohmann::json response_from_chat(const ResponsesRequest& request, const nlohmann::json& chat);

// Turns the server-sent events of a streamed chat completion into those of a streamed response,
// written to the sink given with each call (the chunks may arrive split anywhere).
class ResponsesStream {
 public:
  explicit ResponsesStream(ResponsesRequest request) : request_(std::move(request)) {}
  // Consumes `size` bytes of the chat stream; false when a write to `sink` failed.
  bool feed(const char* data, size_t size, httplib::DataSink& sink);

 private:
  bool on_event(const std::string& event, httplib::DataSink& sink);
  bool on_chunk(const nlohmann::json& chunk, httplib::DataSink& sink);
  bool emit(const char* type, nlohmann::json event, httplib::DataSink& sink);
  // The output item open now (reasoning or message) closed, with its done events.
  bool close_item(httplib::DataSink& sink);
  enum class Open { kNone, kReasoning, kMessage };
  // An item of `kind` opened (the one open before closed), with its added events.
  bool open_item(Open kind, httplib::DataSink& sink);
  // `piece` added to the open item of `kind` (opened first where another is open), as its delta.
  bool add_text(Open kind, const std::string& piece, httplib::DataSink& sink);
  nlohmann::json response_object(const char* status) const;

  ResponsesRequest request_;
  SseEvents events_;
  bool started_ = false, ended_ = false;
  int64_t sequence_ = 0;
  std::string model_;
  int64_t created_ = 0;
  nlohmann::json output_ = nlohmann::json::array();  // the items done so far
  Open open_ = Open::kNone;
  std::string open_id_, open_text_;
  std::string finish_reason_;
  nlohmann::json usage_;
};

}  // namespace moeline::stages::http
