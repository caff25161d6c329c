#include "stages/http/logprobs.h"

#include <algorithm>

namespace moeline::stages::http {

using nlohmann::json;

std::string LogprobsWriter::text_of(int32_t id) const {
  auto text = tokenizer_->decode({id});
  return text ? std::move(*text) : std::string();
}

json LogprobsWriter::chat_entry(int32_t id, float logprob) const {
  const std::string text = text_of(id);
  json bytes = json::array();
  for (unsigned char byte : text) bytes.push_back(byte);
  return {{"token", text}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
}

json LogprobsWriter::object(std::span<const int32_t> ids,
                            std::span<const sdk::TokenLogprob> logprobs, size_t& offset) const {
  const size_t count = std::min(ids.size(), logprobs.size());
  if (endpoint_ == Endpoint::kChat) {
    json content = json::array();
    for (size_t i = 0; i < count; ++i) {
      json entry = chat_entry(ids[i], logprobs[i].logprob);
      json top = json::array();
      for (const auto& [id, logprob] : logprobs[i].top) top.push_back(chat_entry(id, logprob));
      entry["top_logprobs"] = std::move(top);
      content.push_back(std::move(entry));
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       text_offset = json::array();
  for (size_t i = 0; i < count; ++i) {
    const std::string text = text_of(ids[i]);
    tokens.push_back(text);
    token_logprobs.push_back(logprobs[i].logprob);
    // The alternatives, and the chosen token among them (as vLLM and OpenAI list it).
    json top = json::object();
    for (const auto& [id, logprob] : logprobs[i].top) top.emplace(text_of(id), logprob);
    top.emplace(text, logprobs[i].logprob);
    top_logprobs.push_back(std::move(top));
    text_offset.push_back(offset);
    // In characters, as OpenAI counts them (a UTF-8 continuation byte starts none).
    offset += static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char c) {
      return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    }));
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(text_offset)}};
}

}  // namespace moeline::stages::http
