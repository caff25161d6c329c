#include "stages/http/backend.h"

#include "model/config.h"

namespace moeline::stages::http {

std::unique_ptr<Backend> make_backend(const std::filesystem::path& model_dir, std::string name,
                                      const std::string& endpoint, const std::string& server_key,
                                      runtime::Logger& log) {
  auto backend = std::make_unique<Backend>();
  const model::ModelConfig model_config = model::ModelConfig::load(model_dir);
  backend->context =
      model_config.max_position_embeddings > 0 ? model_config.max_position_embeddings : 32768;
  backend->name = std::move(name);
  if (backend->name.empty()) backend->name = model_dir.filename().string();
  if (backend->name.empty()) backend->name = model_dir.parent_path().filename().string();
  auto chat = model::ChatTemplate::load((model_dir / "tokenizer_config.json").string());
  if (chat) {
    backend->chat = std::make_unique<model::ChatTemplate>(std::move(*chat));
  } else {
    log.warn("no_chat_template", {{"model", backend->name}, {"reason", chat.error().message}});
    backend->chat_error = chat.error().message;
  }
  auto tokenizer = model::Tokenizer::load((model_dir / "tokenizer.json").string());
  if (tokenizer) {
    backend->tokenizer = std::make_unique<model::Tokenizer>(std::move(*tokenizer));
  } else {
    log.warn("no_tokenizer", {{"model", backend->name}, {"reason", tokenizer.error().message}});
    backend->tokenizer_error = tokenizer.error().message;
  }
  backend->bridge = std::make_unique<http::GatewayBridge>(
      endpoint, sdk::Credentials{.api_key = "", .server_key = server_key}, log);
  return backend;
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
  options.max_tokens = request.max_tokens.value_or(backend.context);
  options.temperature = request.temperature;
  options.top_p = request.top_p;
  options.top_k = request.top_k;
  options.seed = request.seed;
  options.ignore_eos = request.ignore_eos;
  options.min_p = request.min_p;
  options.presence_penalty = request.presence_penalty;
  options.frequency_penalty = request.frequency_penalty;
  options.repetition_penalty = request.repetition_penalty;
  if (request.logprobs && !backend.tokenizer) {
    ApiError error;
    error.param = "logprobs";
    error.message = "the model '" + backend.name +
                    "' has no tokenizer here to name the tokens of log-probabilities: " +
                    backend.tokenizer_error;
    return error;
  }
  options.logprobs = request.logprobs;
  options.top_logprobs = static_cast<int32_t>(request.top_logprobs);
  return options;
}

}  // namespace moeline::stages::http
