#pragma once
// OpenAI's logprobs objects from the gateway's per-token log-probabilities: the chat shape
// ({"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
// "refusal": null}) and the completions shape ({"tokens", "token_logprobs", "top_logprobs":
// [{token: logprob}], "text_offset"}). A token's text is its own bytes as the tokenizer decodes
// it alone ("bytes" has them exactly; "token" is that text with any incomplete UTF-8 character
// replaced, as the response is JSON). With vLLM's return_tokens_as_token_ids, "token" (and the
// keys of the completions shape) is "token_id:N", and "bytes" that string's, as vLLM gives them;
// text_offset still counts the text.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "sdk/client.h"
#include "stages/http/openai.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages::http {

class LogprobsWriter {
 public:
  LogprobsWriter(Endpoint endpoint, const tokenizer::Tokenizer& tokenizer,
                 bool tokens_as_ids = false)
      : endpoint_(endpoint), tokenizer_(&tokenizer), tokens_as_ids_(tokens_as_ids) {}
  // The logprobs object of these tokens (one log-probability each); the completions shape's
  // text_offset counts characters from `offset`, which moves past their text.
  nlohmann::json object(std::span<const int32_t> ids, std::span<const sdk::TokenLogprob> logprobs,
                        size_t& offset) const;
  // Echo (completions shape only): the prompt's tokens, the first with a null log-probability and
  // null alternatives (nothing precedes it), each later one with `logprobs[i - 1]`; then, joined
  // onto it, the completion's object.
  nlohmann::json prompt_object(std::span<const int32_t> ids,
                               std::span<const sdk::TokenLogprob> logprobs, size_t& offset) const;
  static void append(nlohmann::json& object, const nlohmann::json& more);

 private:
  std::string text_of(int32_t id) const;
  // What names the token: its text, or "token_id:N".
  std::string label_of(int32_t id, const std::string& text) const;
  // The token's own bytes: its text (text_of), or the part of a character it stands for where
  // that text is U+FFFD in its place.
  std::string bytes_of(int32_t id, const std::string& text) const;
  // One completions-shape entry: the token's text and offset, its log-probability and
  // alternatives (both null without `logprob`).
  void add_entry(nlohmann::json& object, int32_t id, const sdk::TokenLogprob* logprob,
                 size_t& offset) const;
  nlohmann::json chat_entry(int32_t id, float logprob) const;

  Endpoint endpoint_;
  const tokenizer::Tokenizer* tokenizer_;
  bool tokens_as_ids_ = false;
};

}  // namespace moeline::stages::http
