#pragma once
// A gateway the HTTP front sends requests to, and what a request becomes for it: the prompt
// rendered with that backend's chat template, max_tokens defaulting to its context.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "sdk/client.h"
#include "stages/http/bridge.h"
#include "stages/http/client_link.h"
#include "stages/http/openai.h"
#include "stages/http/reasoning.h"
#include "stages/runtime/config.h"
#include "stages/runtime/log.h"
#include "stages/runtime/service.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages::http {

// One gateway and the model it serves: its name, context and chat template (the prompt is
// rendered for the model that will run it).
struct Backend {
  std::string name;
  int64_t context = 0;
  std::unique_ptr<tokenizer::ChatTemplate> chat;
  std::string chat_error;
  // The tokens' text, for log-probabilities (without it, requests for them are refused).
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
  std::string tokenizer_error;
  std::unique_ptr<http::GatewayBridge> bridge;
  // Chat answers' <think> blocks read out as reasoning_content (--reasoning-parser auto).
  bool reads_reasoning = true;
  // The longest a request may run in all, at the gateway (--max-request-s; 0: its default).
  uint32_t request_deadline_ms = 0;
};

// Reads the backend's model folder (config.json for the context, tokenizer_config.json for the
// chat template, tokenizer.json for the tokens' text; a missing template or tokenizer is logged
// and the requests that need it are refused) and connects. `chat_template`: a Jinja file used
// instead of the checkpoint's template (with its BOS and EOS), as vLLM's --chat-template; an
// unreadable or unparsable file is a ConfigError.
std::unique_ptr<Backend> make_backend(const std::filesystem::path& model_dir, std::string name,
                                      const std::string& endpoint, const std::string& server_key,
                                      runtime::Logger& log,
                                      const std::filesystem::path& chat_template = {});

// A forced call (tool_choice required or a named function) on a template whose calls are not
// Hermes-style <tool_call> blocks: decoded under the call's grammar alone, as the bare JSON
// document {"name", "arguments"}, and read back as that (parse_forced_call).
bool forces_bare_json_call(const CompletionRequest& request, const Backend& backend);

// The prompt text a completion echoes (OpenAI's echo): the prompt as given, or a prompt of token
// ids decoded (to_options refuses echo of ids without a tokenizer).
std::string echo_text(const CompletionRequest& request, const Backend& backend);

// The SDK request for one backend, or why the request cannot go to it.
std::variant<sdk::GenerateOptions, ApiError> to_options(const CompletionRequest& request,
                                                        const std::string& api_key,
                                                        const Backend& backend);

// Where a chat answer's reasoning can be, for the request built as `options`: nowhere for other
// endpoints, a backend that does not read reasoning out, or a prompt that closed the block itself
// (thinking off); inside a block the rendered prompt left open; at the start of the answer where
// the model's template thinks in <think> blocks.
// Structured output's grammar then holds after that block (Backends::submit).
ReasoningStart reasoning_start(const CompletionRequest& request, const Backend& backend,
                               const sdk::GenerateOptions& options);

// A request on its way: the backend serving it and its first event.
struct Attempt {
  Backend* backend = nullptr;
  std::shared_ptr<RequestChannel> channel;
  std::optional<sdk::Event> first;  // nullopt: none by the time asked for
  uint32_t prompt_tokens = 0;
  std::optional<ApiError> refused;  // the request could not be built for this backend
  ReasoningStart reasoning = ReasoningStart::kOff;
  // No first event by start()'s `answer_by`, the request still running: the caller answers
  // without it (a stream's head, then its tokens as they come).
  bool pending = false;
};

// The gateways one HTTP replica sends requests to: the primary model's (--gateway, --model), and
// the fallback's (--fallback-endpoint, --fallback-model), which takes a request the primary
// answers Overloaded or gives no first token within --fallback-ttft-ms.
class Backends {
 public:
  using Clock = std::chrono::steady_clock;
  Backends(const runtime::Config& config, runtime::StageService& service);

  Backend& primary() { return *primary_; }
  Backend* fallback() { return fallback_.get(); }
  // The backend a request names: the primary (or no model named), or the fallback by its name;
  // nullptr for any other name.
  Backend* find(const std::string& model);
  // Sends the request to `backend` and waits for its first event; a request to the primary that
  // it refuses as Overloaded, or leaves without a first token past --fallback-ttft-ms (then
  // cancelled), goes to the fallback instead (counted by why). No first event and `client` gone:
  // the caller cancels. No first event by `answer_by` (after any fallback decision) and the
  // request still within `deadline`: returned pending.
  Attempt start(const CompletionRequest& request, const std::string& api_key, Backend& backend,
                Clock::time_point received, Clock::time_point deadline, ClientLink& client,
                Clock::time_point answer_by = Clock::time_point::max());
  // Sends the request to `backend` without waiting for its first event (first stays empty): a
  // further choice of a request whose first choice start() placed there.
  Attempt submit(const CompletionRequest& request, const std::string& api_key, Backend& backend);

 private:
  Attempt begin(const CompletionRequest& request, const std::string& api_key, Backend& backend,
                Clock::time_point wait_until, ClientLink& client);

  runtime::StageService& service_;
  std::unique_ptr<Backend> primary_, fallback_;
  std::chrono::milliseconds fallback_ttft_{0};
};

}  // namespace moeline::stages::http
