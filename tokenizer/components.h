#pragma once
// The pipeline stages of a tokenizer.json, each a small class with the reference library's
// semantics: normalizers rewrite text, pre-tokenizers cut it into pieces, the BPE model turns a
// piece into ids, post-processors add special tokens, decoders turn tokens back into text.

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/flat_map.h"
#include "tokenizer/regex.h"

namespace moeline::tokenizer::tok {

// A stretch of text on its way through the pipeline. `at_start` says whether it begins at the
// start of the original input (Metaspace's prepend_scheme "first" looks at that).
struct Piece {
  std::string text;
  bool at_start = false;
};

// A literal string or a regular expression, as `{"String": ...}` / `{"Regex": ...}` in the file.
class Pattern {
 public:
  static Pattern literal(std::string text) { return Pattern(std::move(text), std::nullopt); }
  static Pattern regex(std::string_view pattern) {
    return Pattern(std::string(pattern), text::Regex(pattern));
  }
  void find_all(std::string_view text, std::vector<text::MatchSpan>& out) const;
  std::string replace_all(std::string_view text, std::string_view content) const;

 private:
  Pattern(std::string text, std::optional<text::Regex> regex)
      : text_(std::move(text)), regex_(std::move(regex)) {}
  std::string text_;
  std::optional<text::Regex> regex_;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Cuts `piece` at `matches` (sorted, non-overlapping) the way NormalizedString::split does and
// appends the non-empty parts to `out`.
void split_piece(Piece&& piece, const std::vector<text::MatchSpan>& matches, SplitBehavior behavior,
                 bool invert, std::vector<Piece>& out);

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void process(std::vector<std::int32_t>& ids) const = 0;
};

// Byte-pair encoding with the reference library's merge order (lowest rank first, leftmost among
// equal ranks), byte fallback, unknown-token fusing, subword prefix/suffix and ignore_merges.
class Bpe {
 public:
  struct Options {
    std::optional<std::string> unk_token;
    std::string continuing_subword_prefix;
    std::string end_of_word_suffix;
    bool fuse_unk = false;
    bool byte_fallback = false;
    bool ignore_merges = false;
  };

  // `tokens[id]` is the token text of id (empty and absent for holes in the id range).
  Bpe(std::vector<std::string_view> tokens, std::vector<bool> present,
      const std::vector<std::pair<std::string_view, std::string_view>>& merges, Options options,
      std::unique_ptr<const std::string> arena);

  void tokenize(std::string_view piece, std::vector<std::int32_t>& out) const;
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string_view> id_to_token(std::int32_t id) const;
  std::size_t id_count() const { return tokens_.size(); }
  std::size_t vocab_entries() const { return vocab_.size(); }
  // Whether `id` is one of the <0xXX> tokens byte fallback produces.
  bool is_fallback_byte(std::int32_t id) const { return fallback_byte(id).has_value(); }
  // The byte such a token stands for; nullopt for any other token.
  std::optional<unsigned char> fallback_byte(std::int32_t id) const;

 private:
  void merge_word(std::string_view piece, std::vector<std::int32_t>& out) const;

  // Owns the token text the views below point into; held by pointer so that moving the model
  // never moves the characters (a short std::string keeps them inline).
  std::unique_ptr<const std::string> arena_;
  std::vector<std::string_view> tokens_;
  std::vector<bool> present_;
  FlatStringMap vocab_;
  FlatU64Map merges_;  // (left << 32 | right) -> (rank << 32 | merged id)
  Options options_;
  std::optional<std::int32_t> unk_id_;
  std::array<std::int32_t, 256> byte_ids_{};  // <0xXX> tokens for byte fallback, -1 when absent
  std::uint64_t cache_id_;
};

}  // namespace moeline::tokenizer::tok
