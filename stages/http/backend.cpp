#include "stages/http/backend.h"

#include <fstream>
#include <iterator>

#include "model/config.h"
#include "model/json_grammar.h"
#include "model/model_text.h"
#include "stages/http/events.h"
#include "stages/http/tool_calls.h"

namespace moeline::stages::http {

std::unique_ptr<Backend> make_backend(const std::filesystem::path& model_dir, std::string name,
                                      const std::string& endpoint, const std::string& server_key,
                                      runtime::Logger& log,
                                      const std::filesystem::path& chat_template) {
  auto backend = std::make_unique<Backend>();
  const model::ModelConfig model_config = model::ModelConfig::load(model_dir);
  backend->context =
      model_config.max_position_embeddings > 0 ? model_config.max_position_embeddings : 32768;
  backend->name = std::move(name);
  // A checkpoint folder's name, or a GGUF file's without its extension.
  if (backend->name.empty())
    backend->name =
        (model::is_gguf_model(model_dir) ? model_dir.stem() : model_dir.filename()).string();
  if (backend->name.empty()) backend->name = model_dir.parent_path().filename().string();
  auto chat = model::load_model_chat_template(model_dir);
  if (!chat_template.empty()) {
    std::ifstream in(chat_template);
    if (!in)
      throw runtime::ConfigError("--chat-template " + chat_template.string() + ": cannot read");
    const std::string source((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
    auto replaced =
        chat ? chat->with_source(source) : tokenizer::ChatTemplate::from_template(source, "", "");
    if (!replaced)
      throw runtime::ConfigError("--chat-template " + chat_template.string() + ": " +
                                 replaced.error().message);
    chat = std::move(replaced);
    log.info("chat_template",
             {{"model", backend->name},
              {"file", chat_template.string()},
              {"tool_calls", tokenizer::tool_call_format_name(chat->tool_call_format())}});
  }
  if (chat) {
    backend->chat = std::make_unique<tokenizer::ChatTemplate>(std::move(*chat));
  } else {
    log.warn("no_chat_template", {{"model", backend->name}, {"reason", chat.error().message}});
    backend->chat_error = chat.error().message;
  }
  auto tokenizer = model::load_model_tokenizer(model_dir);
  if (tokenizer) {
    backend->tokenizer = std::make_unique<tokenizer::Tokenizer>(std::move(*tokenizer));
  } else {
    log.warn("no_tokenizer", {{"model", backend->name}, {"reason", tokenizer.error().message}});
    backend->tokenizer_error = tokenizer.error().message;
  }
  backend->bridge = std::make_unique<http::GatewayBridge>(
      endpoint, sdk::Credentials{.api_key = "", .server_key = server_key}, log);
  return backend;
}

bool forces_bare_json_call(const CompletionRequest& request, const Backend& backend) {
  const bool forced = request.tool_choice == CompletionRequest::ToolChoice::kRequired ||
                      request.tool_choice == CompletionRequest::ToolChoice::kFunction;
  return forced && backend.chat &&
         backend.chat->tool_call_format() != tokenizer::ToolCallFormat::kHermes;
}

std::string echo_text(const CompletionRequest& request, const Backend& backend) {
  if (request.prompt_tokens.empty() || !backend.tokenizer) return request.prompt;
  auto text = backend.tokenizer->decode(request.prompt_tokens);
  return text ? std::move(*text) : std::string();
}

std::variant<sdk::GenerateOptions, ApiError> to_options(const CompletionRequest& request,
                                                        const std::string& api_key,
                                                        const Backend& backend) {
  sdk::GenerateOptions options;
  options.api_key = api_key;
  if (request.endpoint == Endpoint::kChat) {
    if (!backend.chat) {
      ApiError error;
      error.message =
          "the model '" + backend.name + "' has no chat template: " + backend.chat_error;
      return error;
    }
    if (!request.chat.tools_json.empty() &&
        backend.chat->tool_call_format() == tokenizer::ToolCallFormat::kNone) {
      ApiError error;
      error.param = "tools";
      error.code = "unsupported_parameter";
      error.message = "the model '" + backend.name +
                      "' has no chat template that writes tool calls in a format this server "
                      "reads back (Qwen's <tool_call> JSON blocks, GLM-4.5's <arg_key> blocks, "
                      "DeepSeek's <｜tool▁calls▁begin｜>, Mistral's [TOOL_CALLS])";
      return error;
    }
    if (request.tool_choice == CompletionRequest::ToolChoice::kRequired ||
        request.tool_choice == CompletionRequest::ToolChoice::kFunction) {
      ApiError error;
      error.param = "tool_choice";
      if (request.structured != sdk::StructuredOutput::kNone) {
        error.message = "'response_format' and a forced 'tool_choice' cannot be combined";
        return error;
      }
      // Hermes-style templates get the call in their own <tool_call> tags; any other format the
      // bare document, as vLLM decodes forced calls whatever the model's format.
      options.structured = forces_bare_json_call(request, backend)
                               ? sdk::StructuredOutput::kJsonSchema
                               : sdk::StructuredOutput::kHermesToolCall;
      options.json_schema =
          forced_call_schema(request.chat.tools_json, request.tool_choice_function);
      if (auto grammar = model::JsonGrammar::compile(options.json_schema); !grammar) {
        error.param = "tools";
        error.message =
            "the tools' parameters cannot be decoded as a forced call: " + grammar.error().message;
        return error;
      }
    }
    auto rendered = backend.chat->render(request.messages, request.chat);
    if (!rendered) {
      ApiError error;
      error.param = "messages";
      error.message = rendered.error().message;
      return error;
    }
    options.prompt = std::move(*rendered);
    // A rendered chat carries its special tokens (as transformers' apply_chat_template).
    options.add_special_tokens = false;
  } else if (!request.prompt_tokens.empty()) {
    options.tokens = request.prompt_tokens;
  } else {
    options.prompt = request.prompt;
  }
  if (options.prompt.empty() && options.tokens.empty()) {
    ApiError error;
    error.param = request.endpoint == Endpoint::kChat ? "messages" : "prompt";
    error.message = "the prompt is empty";
    return error;
  }
  // No max_tokens: up to the context (the gateway caps it at what the prompt leaves).
  options.max_tokens = request.score_only() ? 1 : request.max_tokens.value_or(backend.context);
  options.temperature = request.temperature;
  options.top_p = request.top_p;
  options.top_k = request.top_k;
  options.seed = request.seed;
  options.ignore_eos = request.ignore_eos;
  options.min_tokens = request.score_only() ? 0 : request.min_tokens;
  options.stop_token_ids = request.stop_token_ids;
  options.skip_special_tokens = request.skip_special_tokens;
  // A tool-call marker that the vocabulary marks special would be dropped from the text before
  // the front reads the calls out of it: such a model's answers keep their special tokens (as
  // vLLM's Mistral parser, and since 2025 its Hermes parser, ask for them).
  if (request.endpoint == Endpoint::kChat && !request.chat.tools_json.empty() && backend.chat &&
      backend.tokenizer) {
    const auto marker = backend.tokenizer->token_to_id(
        std::string(tool_call_marker(backend.chat->tool_call_format())));
    if (marker && backend.tokenizer->is_special(*marker)) options.skip_special_tokens = false;
  }
  options.min_p = request.min_p;
  options.presence_penalty = request.presence_penalty;
  options.frequency_penalty = request.frequency_penalty;
  options.repetition_penalty = request.repetition_penalty;
  options.logit_bias = request.logit_bias;
  options.deadline_ms = backend.request_deadline_ms;
  if (options.structured == sdk::StructuredOutput::kNone) {
    options.structured = request.structured;
    options.json_schema = request.json_schema;
  }
  if (request.logprobs && !backend.tokenizer) {
    ApiError error;
    error.param = "logprobs";
    error.message = "the model '" + backend.name +
                    "' has no tokenizer here to name the tokens of log-probabilities: " +
                    backend.tokenizer_error;
    return error;
  }
  if (request.echo && !request.prompt_tokens.empty() && !backend.tokenizer) {
    ApiError error;
    error.param = "echo";
    error.message =
        "the model '" + backend.name +
        "' has no tokenizer here to echo a prompt of token ids: " + backend.tokenizer_error;
    return error;
  }
  options.logprobs = request.logprobs;
  options.top_logprobs = static_cast<int32_t>(request.top_logprobs);
  // Echo with logprobs: the prompt's too (computed in full, without reuse).
  options.prompt_logprobs = request.echo && request.logprobs;
  return options;
}

ReasoningStart reasoning_start(const CompletionRequest& request, const Backend& backend,
                               const sdk::GenerateOptions& options) {
  if (request.endpoint != Endpoint::kChat || !backend.reads_reasoning || !backend.chat)
    return ReasoningStart::kOff;
  // A continued message goes on where it stopped: inside a block it opened and did not close,
  // or in its answer.
  if (request.chat.continue_final_message) {
    const size_t open = options.prompt.rfind(kThinkOpen);
    const size_t close = options.prompt.rfind(kThinkClose);
    return open != std::string::npos && (close == std::string::npos || open > close)
               ? ReasoningStart::kOpen
               : ReasoningStart::kOff;
  }
  if (prompt_opens_reasoning(options.prompt)) return ReasoningStart::kOpen;
  if (prompt_closes_reasoning(options.prompt)) return ReasoningStart::kOff;
  return backend.chat->writes_reasoning() ? ReasoningStart::kAtStart : ReasoningStart::kOff;
}

Backends::Backends(const runtime::Config& config, runtime::StageService& service)
    : service_(service) {
  const std::string parser = config.text("reasoning-parser");
  if (parser != "auto" && parser != "none")
    throw runtime::ConfigError("--reasoning-parser: \"" + parser + "\" is neither auto nor none");
  // A Curve key directory (as every stage takes) gives the gateway's public key.
  std::string server_key = config.text("server-key");
  if (server_key.empty() && !config.text("curve-dir").empty())
    server_key = (std::filesystem::path(config.text("curve-dir")) / "gateway.pub").string();
  primary_ =
      make_backend(config.text("model"), config.text("served-model-name"), config.text("gateway"),
                   server_key, service.log, config.text("chat-template"));
  primary_->reads_reasoning = parser == "auto";
  const int64_t max_request_s = config.integer("max-request-s");
  if (max_request_s < 1 || max_request_s > 86400)
    throw runtime::ConfigError("--max-request-s must be 1 to 86400");
  primary_->request_deadline_ms = static_cast<uint32_t>(max_request_s * 1000);
  if (config.text("fallback-endpoint").empty()) return;
  if (config.text("fallback-model").empty())
    throw runtime::ConfigError(
        "--fallback-endpoint needs --fallback-model (its checkpoint folder: the chat template and "
        "context of the fallback)");
  std::string fallback_key = config.text("fallback-server-key");
  if (fallback_key.empty()) fallback_key = server_key;
  fallback_ = make_backend(config.text("fallback-model"), config.text("fallback-model-name"),
                           config.text("fallback-endpoint"), fallback_key, service.log);
  if (fallback_->name == primary_->name) fallback_->name += "-fallback";
  fallback_->request_deadline_ms = primary_->request_deadline_ms;
  fallback_->reads_reasoning = parser == "auto";
  fallback_ttft_ = std::chrono::milliseconds(config.integer("fallback-ttft-ms"));
}

Backend* Backends::find(const std::string& model) {
  if (model.empty() || model == primary_->name) return primary_.get();
  if (fallback_ && model == fallback_->name) return fallback_.get();
  return nullptr;
}

Attempt Backends::submit(const CompletionRequest& request, const std::string& api_key,
                         Backend& backend) {
  Attempt attempt;
  attempt.backend = &backend;
  auto built = to_options(request, api_key, backend);
  if (auto* error = std::get_if<ApiError>(&built)) {
    attempt.refused = *error;
    return attempt;
  }
  auto& options = std::get<sdk::GenerateOptions>(built);
  attempt.reasoning = reasoning_start(request, backend, options);
  // Structured output on a model that thinks: the grammar holds after the reasoning block.
  if (options.structured != sdk::StructuredOutput::kNone)
    options.reasoning = attempt.reasoning == ReasoningStart::kOpen ? sdk::ReasoningBlock::kOpen
                        : attempt.reasoning == ReasoningStart::kAtStart
                            ? sdk::ReasoningBlock::kMayOpen
                            : sdk::ReasoningBlock::kNone;
  attempt.channel = backend.bridge->start(std::move(options));
  return attempt;
}

Attempt Backends::begin(const CompletionRequest& request, const std::string& api_key,
                        Backend& backend, Clock::time_point wait_until, ClientLink& client) {
  Attempt attempt = submit(request, api_key, backend);
  if (!attempt.refused)
    attempt.first = next_event(*attempt.channel, wait_until, attempt.prompt_tokens, &client);
  return attempt;
}

Attempt Backends::start(const CompletionRequest& request, const std::string& api_key,
                        Backend& backend, Clock::time_point received, Clock::time_point deadline,
                        ClientLink& client, Clock::time_point answer_by) {
  const bool may_fall_back = fallback_ && &backend == primary_.get();
  const bool slow_falls_back = may_fall_back && fallback_ttft_.count() > 0;
  const auto first_by = slow_falls_back ? std::min(deadline, received + fallback_ttft_) : deadline;
  // The fallback's decision comes first: a request is not answered before it is taken.
  if (slow_falls_back) answer_by = std::max(answer_by, first_by);
  Attempt attempt = begin(request, api_key, backend, std::min(first_by, answer_by), client);
  if (attempt.refused || (!attempt.first && client.gone())) return attempt;
  if (!attempt.first && Clock::now() < first_by) {
    attempt.pending = true;
    return attempt;
  }
  if (!may_fall_back) return attempt;
  const char* reason = nullptr;
  if (!attempt.first) {
    reason = "slow_first_token";
    attempt.backend->bridge->cancel(attempt.channel);
  } else if (attempt.first->kind == sdk::EventKind::kError && attempt.first->error_code == 10) {
    reason = "overloaded";
  }
  if (reason == nullptr) return attempt;
  service_.metrics
      .counter("moeline_http_fallbacks_total", "Requests served by the fallback model, by why",
               {{"reason", reason}})
      .inc();
  return begin(request, api_key, *fallback_, deadline, client);
}

}  // namespace moeline::stages::http
