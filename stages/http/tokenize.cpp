#include "stages/http/tokenize.h"

#include <string>
#include <vector>

namespace moeline::stages::http {

using nlohmann::json;

namespace {

std::optional<ApiError> needs_tokenizer(const Backend& backend, const char* param) {
  if (backend.tokenizer) return std::nullopt;
  ApiError error;
  error.param = param;
  error.message =
      "the model '" + backend.name + "' has no tokenizer here: " + backend.tokenizer_error;
  return error;
}

ApiError bad_input(const char* param, const std::string& message) {
  ApiError error;
  error.param = param;
  error.message = message;
  return error;
}

}  // namespace

std::variant<json, ApiError> tokenize(const Backend& backend, const TokenizeRequest& request) {
  if (auto error = needs_tokenizer(backend, request.chat ? "messages" : "prompt")) return *error;
  std::string text = request.text.prompt;
  if (request.chat) {
    if (!backend.chat)
      return bad_input("messages", "the model '" + backend.name +
                                       "' has no chat template here: " + backend.chat_error);
    auto rendered = backend.chat->render(request.text.messages, request.text.chat);
    if (!rendered) return bad_input("messages", rendered.error().message);
    text = std::move(*rendered);
  }
  auto ids = backend.tokenizer->encode(text, {.add_special_tokens = request.add_special_tokens});
  if (!ids) return bad_input(request.chat ? "messages" : "prompt", ids.error().message);
  json strings = nullptr;
  if (request.return_token_strs) {
    strings = json::array();
    for (int32_t id : *ids) strings.push_back(backend.tokenizer->id_to_token(id).value_or(""));
  }
  return json{{"count", ids->size()},
              {"max_model_len", backend.context},
              {"tokens", *ids},
              {"token_strs", std::move(strings)}};
}

std::variant<json, ApiError> detokenize(const Backend& backend, const DetokenizeRequest& request) {
  if (auto error = needs_tokenizer(backend, "tokens")) return *error;
  auto text = backend.tokenizer->decode(request.tokens);
  if (!text) return bad_input("tokens", text.error().message);
  return json{{"prompt", std::move(*text)}};
}

}  // namespace moeline::stages::http
