#include "stages/http/logprobs.h"

#include <algorithm>

namespace moeline::stages::http {

using nlohmann::json;

namespace {

json empty_completions_object() {
  return {{"tokens", json::array()},
          {"token_logprobs", json::array()},
          {"top_logprobs", json::array()},
          {"text_offset", json::array()}};
}

}  // namespace

std::string LogprobsWriter::text_of(int32_t id) const {
  auto text = tokenizer_->decode({id});
  return text ? std::move(*text) : std::string();
}

std::string LogprobsWriter::label_of(int32_t id, const std::string& text) const {
  return tokens_as_ids_ ? "token_id:" + std::to_string(id) : text;
}

std::string LogprobsWriter::bytes_of(int32_t id, const std::string& text) const {
  // Only a replaced text can hide part of a character: the rest need no second look.
  if (text.find("\xEF\xBF\xBD") == std::string::npos) return text;
  auto partial = tokenizer_->partial_character_bytes(id);
  return partial ? std::move(*partial) : text;
}

json LogprobsWriter::chat_entry(int32_t id, float logprob) const {
  const std::string text = text_of(id);
  const std::string label = label_of(id, text);
  json bytes = json::array();
  for (unsigned char byte : tokens_as_ids_ ? label : bytes_of(id, text)) bytes.push_back(byte);
  return {{"token", label}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
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
  json object = empty_completions_object();
  for (size_t i = 0; i < count; ++i) add_entry(object, ids[i], &logprobs[i], offset);
  return object;
}

void LogprobsWriter::add_entry(json& object, int32_t id, const sdk::TokenLogprob* logprob,
                               size_t& offset) const {
  const std::string text = text_of(id);
  const std::string label = label_of(id, text);
  object["tokens"].push_back(label);
  if (logprob == nullptr) {
    object["token_logprobs"].push_back(nullptr);
    object["top_logprobs"].push_back(nullptr);
  } else {
    object["token_logprobs"].push_back(logprob->logprob);
    // The alternatives, and the chosen token among them (as vLLM and OpenAI list it).
    json top = json::object();
    for (const auto& [alternative, value] : logprob->top)
      top.emplace(label_of(alternative, text_of(alternative)), value);
    top.emplace(label, logprob->logprob);
    object["top_logprobs"].push_back(std::move(top));
  }
  object["text_offset"].push_back(offset);
  // In characters of the text, as OpenAI counts them: a token holding part of a character counts
  // it where the character starts (a UTF-8 continuation byte starts none).
  const std::string bytes = bytes_of(id, text);
  offset += static_cast<size_t>(std::count_if(bytes.begin(), bytes.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

json LogprobsWriter::prompt_object(std::span<const int32_t> ids,
                                   std::span<const sdk::TokenLogprob> logprobs,
                                   size_t& offset) const {
  json object = empty_completions_object();
  for (size_t i = 0; i < ids.size(); ++i)
    add_entry(object, ids[i], i > 0 && i - 1 < logprobs.size() ? &logprobs[i - 1] : nullptr,
              offset);
  return object;
}

void LogprobsWriter::append(json& object, const json& more) {
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (const json& entry : more[key]) object[key].push_back(entry);
}

}  // namespace moeline::stages::http
