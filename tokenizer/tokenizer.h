#pragma once
// Hugging Face tokenizer.json, in C++: the same ids and the same decoded text as the `tokenizers`
// library for the BPE tokenizers of the model families moeline serves (byte-level BPE with regex
// pre-splitting as in Qwen, DeepSeek and Llama 3; byte-fallback BPE with Metaspace-style
// normalisation as in Llama 2 and Mistral). See tokenizer/README.md for what is covered.
//
// A Tokenizer is immutable after loading and safe to use from several threads at once.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace moeline::tokenizer {

class TokenizerImpl;

struct EncodeOptions {
  // Apply the post-processor (BOS/EOS and the like). Special-token strings in the text are matched
  // either way, as in the reference library.
  bool add_special_tokens = true;
};

struct DecodeOptions {
  bool skip_special_tokens = false;
};

class Tokenizer {
 public:
  // Loads a tokenizer.json. Errors name the file and the offending key or component.
  static Expected<Tokenizer> load(const std::string& path);
  static Expected<Tokenizer> from_json(std::string_view json, const std::string& origin);

  // Text must be valid UTF-8; invalid input is an Error naming the byte offset.
  Expected<std::vector<std::int32_t>> encode(std::string_view text,
                                             const EncodeOptions& options = {}) const;
  // Ids outside the vocabulary are an Error.
  Expected<std::string> decode(const std::vector<std::int32_t>& ids,
                               const DecodeOptions& options = {}) const;

  // Vocabulary size including added tokens (one more than the largest id).
  std::size_t vocab_size() const;
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(std::int32_t id) const;
  bool is_special(std::int32_t id) const;
  // A byte-fallback token (<0xXX>): its text depends on the bytes around it.
  bool is_fallback_byte(std::int32_t id) const;
  // The bytes of a token that stands for part of a character (a byte-level piece of a multi-byte
  // character, or a byte-fallback <0xXX>), which decode() of the token alone cannot give: it
  // replaces an incomplete character with U+FFFD. nullopt for every other token, whose decode()
  // is its bytes.
  std::optional<std::string> partial_character_bytes(std::int32_t id) const;

  const TokenizerImpl& impl() const { return *impl_; }

 private:
  explicit Tokenizer(std::shared_ptr<const TokenizerImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const TokenizerImpl> impl_;
};

// Incremental detokenisation for streaming. Each call returns the text that became final with the
// new token: never a partial UTF-8 character, and the concatenation of every piece (finish()
// included) equals Tokenizer::decode of all the ids. Like the reference library's DecodeStream it
// decodes a short window of recent ids, but the window reaches back past tokens that decode to
// nothing on their own, which keeps the pieces exact for decoders that strip leading text.
class DecodeStream {
 public:
  DecodeStream(const Tokenizer& tokenizer, DecodeOptions options = {});
  Expected<std::string> step(std::int32_t id);
  // Text still held back (for example an incomplete byte sequence at the end of the stream).
  Expected<std::string> finish();

 private:
  const Tokenizer* tokenizer_;
  DecodeOptions options_;
  static constexpr std::size_t kMaxWindow = 64;
  Expected<std::string> decode_range(std::size_t begin, std::size_t end) const;

  std::vector<std::int32_t> ids_;  // the window's ids, then those not yet emitted
  std::size_t window_ = 0;
  std::string prefix_;  // decode of the window's already-emitted ids
};

}  // namespace moeline::tokenizer
