#pragma once
// A gateway the HTTP front sends requests to, and what a request becomes for it: the prompt
// rendered with that backend's chat template, max_tokens defaulting to its context.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <variant>

#include "model/tokenizer/chat_template.h"
#include "model/tokenizer/tokenizer.h"
#include "sdk/client.h"
#include "stages/http/bridge.h"
#include "stages/http/openai.h"
#include "stages/runtime/log.h"

namespace moeline::stages::http {

// One gateway and the model it serves: its name, context and chat template (the prompt is
// rendered for the model that will run it).
struct Backend {
  std::string name;
  int64_t context = 0;
  std::unique_ptr<model::ChatTemplate> chat;
  std::string chat_error;
  // The tokens' text, for log-probabilities (without it, requests for them are refused).
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::string tokenizer_error;
  std::unique_ptr<http::GatewayBridge> bridge;
};

// Reads the backend's model folder (config.json for the context, tokenizer_config.json for the
// chat template, tokenizer.json for the tokens' text; a missing template or tokenizer is logged
// and the requests that need it are refused) and connects.
std::unique_ptr<Backend> make_backend(const std::filesystem::path& model_dir, std::string name,
                                      const std::string& endpoint, const std::string& server_key,
                                      runtime::Logger& log);

// The SDK request for one backend, or why the request cannot go to it.
std::variant<sdk::GenerateOptions, ApiError> to_options(const CompletionRequest& request,
                                                        const std::string& api_key,
                                                        const Backend& backend);

}  // namespace moeline::stages::http
