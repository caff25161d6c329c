#pragma once
// vLLM's /tokenize and /detokenize (SGLang's and llama.cpp's servers have their like): the served
// model's tokenizer, and for chat messages its chat template, over HTTP, so that a client counts
// a prompt's tokens, or sees how the server renders a conversation, exactly as the server will.
// Answered by the HTTP stage itself, from the model folder it reads; no request reaches the
// pipeline.

#include <variant>

#include <nlohmann/json.hpp>

#include "stages/http/backend.h"
#include "stages/http/openai.h"

namespace moeline::stages::http {

// {"count", "max_model_len", "tokens", "token_strs" (null unless asked for)}.
std::variant<nlohmann::json, ApiError> tokenize(const Backend& backend,
                                                const TokenizeRequest& request);
// {"prompt"}: the ids decoded, special tokens included (as vLLM's /detokenize).
std::variant<nlohmann::json, ApiError> detokenize(const Backend& backend,
                                                  const DetokenizeRequest& request);

}  // namespace moeline::stages::http
