#pragma once
// The OpenAI API's shapes: requests parsed and checked field by field (a wrong type is a 400 with
// OpenAI's error object, unknown fields are ignored as OpenAI does), and the responses and
// stream chunks built exactly as OpenAI's clients expect them.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "sdk/client.h"
#include "stages/http/tool_calls.h"
#include "tokenizer/chat_template.h"

namespace moeline::stages::http {

enum class Endpoint { kChat, kCompletions, kGenerate };

// The most choices (OpenAI's `n`) one request may ask for: each is a request in the pipeline, in
// flight beside the others and counted against the tenant's limits.
constexpr int64_t kMaxChoices = 16;

// {"error": {"message", "type", "param", "code"}} with its HTTP status.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
  nlohmann::json body() const;
};

// A 400 naming the field `param` (empty: the body as a whole).
ApiError invalid_field(const std::string& param, const std::string& message);
// A 400 for what this server does not do (`what`, as a noun), code unsupported_parameter.
ApiError unsupported_field(const std::string& param, const std::string& what);
// Stop strings as a request gives them, a string or a list of strings, appended to `out`: at most
// kMaxStopStrings, each at most kMaxStopStringBytes (stop_matcher.h); an error names `param`.
std::optional<ApiError> read_stop_strings(const nlohmann::json& value, const std::string& param,
                                          std::vector<std::string>& out);

struct CompletionRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;
  std::vector<tokenizer::ChatMessage> messages;  // chat
  std::string prompt;                            // completions, generate
  std::vector<int32_t> prompt_tokens;            // completions: a prompt given as token ids
  // Completions: several prompts in one request (a list of strings, or of token-id lists, up to
  // kMaxChoices), each answered with n choices: choice index = prompt index * n + sample.
  std::vector<std::string> batch_prompts;
  std::vector<std::vector<int32_t>> batch_prompt_tokens;
  std::optional<int64_t> max_tokens;  // absent: up to the context
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  // vLLM's stop_token_ids (their text kept unless special, as vLLM), and
  // include_stop_str_in_output (the stop string that ended the text kept in it).
  std::vector<int32_t> stop_token_ids;
  bool include_stop_str_in_output = false;
  bool ignore_eos = false;  // vLLM's extension: generate max_tokens whatever the model says
  // vLLM's extension: no end-of-sequence or stop token before this many tokens, and no stop
  // string that ends within them.
  int64_t min_tokens = 0;
  // vLLM's extension: false keeps the special tokens the model writes in the text (the one that
  // stops it aside).
  bool skip_special_tokens = true;
  double min_p = 0.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0;
  // OpenAI's logit_bias: (token id, bias in [-100, 100]).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // OpenAI's response_format: json_object, or json_schema with the schema's text (its key order
  // kept, which is the order the answer gives the properties).
  sdk::StructuredOutput structured = sdk::StructuredOutput::kNone;
  std::string json_schema;
  // Chat: logprobs true and top_logprobs 0..20; completions: logprobs N (0..20) alternatives.
  bool logprobs = false;
  int64_t top_logprobs = 0;
  // vLLM's: the log-probabilities name each token "token_id:N" (a token whose bytes are not
  // text, or a client that wants the ids) instead of by its text.
  bool return_tokens_as_token_ids = false;
  // Completions: the prompt's text before the completion's, and with logprobs the prompt tokens'
  // log-probabilities before the completion's (the first token's null), as OpenAI's echo.
  bool echo = false;
  bool stream = false;
  // Echo with max_tokens 0 (OpenAI's legacy scoring request): the prompt and its log-probabilities
  // only. The pipeline still draws one token, which the response leaves out.
  bool score_only() const { return echo && max_tokens == 0; }
  bool include_usage = false;
  // vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
  bool continuous_usage = false;
  std::string user;
  // Choices to generate (`n`) per prompt: choice i samples with seed + i when a seed is given
  // (as vLLM).
  int64_t n = 1;
  int64_t prompt_count() const {
    return std::max<int64_t>(
        1, static_cast<int64_t>(std::max(batch_prompts.size(), batch_prompt_tokens.size())));
  }
  // Chat: tool_choice. A forced call ("required", or a named function) is decoded under a grammar
  // of the tools' calls (README "Structured output").
  enum class ToolChoice { kAuto, kNone, kRequired, kFunction };
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_function;  // kFunction: the function's name
  // false: at most one call in the answer (the first the model wrote).
  bool parallel_tool_calls = true;
  // Chat template switches (chat_template_kwargs, as vLLM and SGLang take them).
  tokenizer::ChatOptions chat;
};

std::variant<CompletionRequest, ApiError> parse_request(Endpoint endpoint, const std::string& body);

// vLLM's /tokenize body: a text `prompt` (encoded with add_special_tokens, default true) or chat
// `messages` (rendered with the chat template and its options, add_generation_prompt default
// true, then encoded with add_special_tokens default false, as vLLM), and return_token_strs.
struct TokenizeRequest {
  CompletionRequest text;  // model, and the prompt or the messages with their chat options
  bool chat = false;
  bool add_special_tokens = true;
  bool return_token_strs = false;
};
std::variant<TokenizeRequest, ApiError> parse_tokenize(const std::string& body);
// vLLM's /detokenize body: {"model"?, "tokens": [ids]}.
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
std::variant<DetokenizeRequest, ApiError> parse_detokenize(const std::string& body);

// What the gateway's error code means over HTTP (status, OpenAI error type).
ApiError gateway_error(int code, const std::string& name, const std::string& message);

// One finished or streamed choice of a completion as the response builders need it; the choices
// of one response share its id, creation time and model.
struct Completion {
  std::string id;     // chatcmpl-... or cmpl-...
  int64_t index = 0;  // the choice's index (n > 1)
  int64_t created = 0;
  std::string model;
  std::string text;
  std::string finish_reason;  // stop, length
  // What ended the text, as vLLM's `stop_reason`: the stop string, or the id of the stop token
  // (stop_token_ids); null where the model's end of sequence or max_tokens did.
  nlohmann::json stop_reason;
  sdk::Usage usage;
  sdk::Timings timings;
  bool fallback = false;    // served by the fallback model (the primary was overloaded or slow)
  nlohmann::json logprobs;  // the choice's logprobs object (null unless asked for)
  std::vector<ToolCallOut> tool_calls;  // chat: the calls read from the text (then not in it)
  std::string reasoning;  // chat: the reasoning read out of the text (reasoning.h; then not in it)
};

nlohmann::json usage_json(const sdk::Usage& usage);
// moeline's own fields (reuse level, approximate outcome, timings, whether the fallback model
// served it) in one extension object.
nlohmann::json extension_json(const Completion& completion);
// The response's usage: each prompt counted once (the first of its n choices: choice i answers
// prompt i / n), the completion tokens of every choice.
sdk::Usage combined_usage(std::span<const Completion> choices, int64_t n);
// The whole response: one choice per Completion, in their order, the envelope and moeline's
// extension from the first.
nlohmann::json completion_response(Endpoint endpoint, std::span<const Completion> choices,
                                   int64_t n = 1);
// Which field of a chat chunk's delta carries its text: the answer's content, or its reasoning
// (`reasoning_content`, as DeepSeek's API, vLLM, SGLang and llama.cpp stream it).
enum class DeltaField { kContent, kReasoning };
// A stream chunk: `delta` text (chat: with the role on the first chunk), or the final chunk with
// the finish reason.
nlohmann::json stream_chunk(Endpoint endpoint, const Completion& completion,
                            const std::string& text, bool first, const std::string& finish_reason,
                            const nlohmann::json& logprobs = nullptr,
                            DeltaField field = DeltaField::kContent);
// The server-sent event of one token's text after the first: stream_chunk's bytes, built from a
// prefix and suffix made once per stream (a JSON document per token would cost more than the
// rest of the path).
class TokenEvents {
 public:
  TokenEvents(Endpoint endpoint, const Completion& completion,
              DeltaField field = DeltaField::kContent);
  // With `usage` (continuous usage): the chunk's `usage` too, as usage_json writes it.
  std::string event(const std::string& text, const sdk::Usage* usage = nullptr) const;

 private:
  std::string prefix_, suffix_;
};

// A stream chunk with the choice's tool calls, each whole (the clients gather them by index).
nlohmann::json tool_calls_chunk(const Completion& completion);

// The usage chunk of stream_options.include_usage: no choices; `completion` carries the
// combined usage.
nlohmann::json usage_chunk(Endpoint endpoint, const Completion& completion);

// `prefix` and `length` random characters of `alphabet` (24 hex digits by default): the ids of
// completions (chatcmpl-, cmpl-), responses and their items, and tool calls.
std::string random_id(const std::string& prefix, size_t length = 24,
                      std::string_view alphabet = "0123456789abcdef");
std::string new_completion_id(Endpoint endpoint);

// JSON text for the wire; invalid UTF-8 (which nothing should produce) becomes U+FFFD instead of
// an exception.
std::string to_text(const nlohmann::json& value);

}  // namespace moeline::stages::http
