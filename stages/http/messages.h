#pragma once
// Anthropic's Messages API (POST /v1/messages, and /v1/messages/count_tokens) over the chat
// completions the front already serves, so that Anthropic's SDKs and the tools built on them
// (Claude Code, agents written against the SDK) run on a moeline model: a Messages request
// becomes a chat request (system, messages and their content blocks, tools with their
// input_schema, tool_choice, stop_sequences, thinking), and the chat answer a message object, or,
// streamed, the chat chunks become Anthropic's events (message_start, content blocks and their
// deltas, message_delta, message_stop). Errors take Anthropic's shape
// ({"type": "error", "error": {"type", "message"}}).

#include <cstdint>
#include <string>
#include <variant>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "stages/http/openai.h"
#include "stages/http/sse.h"

namespace moeline::stages::http {

struct MessagesRequest {
  std::string id;         // msg_ and 24 hex digits
  std::string chat_body;  // the chat completions request it is served as
  bool stream = false;
};

// What a Messages request needs: all of it, or, to count its tokens, neither max_tokens nor the
// sampling settings.
enum class MessagesUse { kGenerate, kCountTokens };

// The chat request that serves a Messages request body, or why it cannot be served (`param`
// names the field, though Anthropic's error shape has no place for it).
std::variant<MessagesRequest, ApiError> parse_messages_request(const std::string& body,
                                                               MessagesUse use);

// The message object for the chat completion `chat` (a chat.completion body).
nlohmann::json message_from_chat(const MessagesRequest& request, const nlohmann::json& chat);

// Anthropic's error object for an error of this server (`status`: its HTTP status).
nlohmann::json anthropic_error(int status, const std::string& message);
// The same for an OpenAI error object (the body the chat front answers with): its message kept,
// its type Anthropic's for `status`.
nlohmann::json anthropic_error_from(int status, const nlohmann::json& openai_error);

// Turns the server-sent events of a streamed chat completion (with continuous usage) into those
// of a streamed message, written to the sink given with each call.
class MessagesStream {
 public:
  explicit MessagesStream(MessagesRequest request) : request_(std::move(request)) {}
  // Consumes `size` bytes of the chat stream; false when a write to `sink` failed.
  bool feed(const char* data, size_t size, httplib::DataSink& sink);

 private:
  bool on_event(const std::string& event, httplib::DataSink& sink);
  bool on_chunk(const nlohmann::json& chunk, httplib::DataSink& sink);
  bool emit(const char* type, nlohmann::json event, httplib::DataSink& sink);
  enum class Block { kNone, kThinking, kText };
  // The content block open now closed (content_block_stop).
  bool close_block(httplib::DataSink& sink);
  // `piece` added to a block of `kind` (opened first, closing another open one).
  bool add_text(Block kind, const std::string& piece, httplib::DataSink& sink);
  nlohmann::json usage_object() const;

  MessagesRequest request_;
  SseEvents events_;
  bool started_ = false, ended_ = false;
  int64_t blocks_ = 0;  // content blocks started so far (the next one's index)
  Block open_ = Block::kNone;
  std::string finish_reason_, stop_reason_;
  nlohmann::json usage_;  // the chat's usage, as its chunks carry it
};

}  // namespace moeline::stages::http
