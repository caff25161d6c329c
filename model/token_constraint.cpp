#include "model/token_constraint.h"

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>

#include "model/model_text.h"

namespace moeline::model {

namespace {

// Plain string text: bytes a JSON string takes as they are, in whole UTF-8 characters; the
// number of characters, or nullopt.
std::optional<uint32_t> plain_characters(const std::string& text) {
  uint32_t characters = 0;
  for (size_t i = 0; i < text.size();) {
    const auto byte = static_cast<uint8_t>(text[i]);
    size_t length = 0;
    if (byte < 0x20 || byte == '"' || byte == '\\') return std::nullopt;
    if (byte < 0x80)
      length = 1;
    else if (byte >= 0xC2 && byte <= 0xDF)
      length = 2;
    else if (byte >= 0xE0 && byte <= 0xEF)
      length = 3;
    else if (byte >= 0xF0 && byte <= 0xF4)
      length = 4;
    else
      return std::nullopt;
    if (i + length > text.size()) return std::nullopt;
    for (size_t k = 1; k < length; ++k)
      if ((static_cast<uint8_t>(text[i + k]) & 0xC0) != 0x80) return std::nullopt;
    // Overlong forms and surrogates, which the grammar refuses too.
    if (length == 3) {
      const auto next = static_cast<uint8_t>(text[i + 1]);
      if ((byte == 0xE0 && next < 0xA0) || (byte == 0xED && next > 0x9F)) return std::nullopt;
    } else if (length == 4) {
      const auto next = static_cast<uint8_t>(text[i + 1]);
      if ((byte == 0xF0 && next < 0x90) || (byte == 0xF4 && next > 0x8F)) return std::nullopt;
    }
    i += length;
    ++characters;
  }
  return characters;
}

}  // namespace

std::shared_ptr<const TokenVocabulary> TokenVocabulary::build(const tokenizer::Tokenizer& tokenizer,
                                                              int64_t vocab) {
  auto out = std::make_shared<TokenVocabulary>();
  out->bytes_.resize(static_cast<size_t>(vocab));
  // A token's text after other text: decoders that drop a leading space at the start of the
  // text (SentencePiece's) would drop a word's space from a token decoded alone.
  const std::optional<int32_t> anchor = tokenizer.token_to_id("a");
  std::string anchor_text;
  if (anchor) {
    auto text = tokenizer.decode({*anchor});
    if (text) anchor_text = *text;
  }
  const auto known = static_cast<int64_t>(tokenizer.vocab_size());
  for (int64_t id = 0; id < std::min(vocab, known); ++id) {
    const auto token = static_cast<int32_t>(id);
    if (tokenizer.is_special(token)) continue;
    std::string& bytes = out->bytes_[static_cast<size_t>(id)];
    if (auto partial = tokenizer.partial_character_bytes(token)) {
      bytes = *partial;
      continue;
    }
    if (anchor && !anchor_text.empty()) {
      auto text = tokenizer.decode({*anchor, token});
      if (text && text->starts_with(anchor_text)) {
        bytes = text->substr(anchor_text.size());
        continue;
      }
    }
    auto text = tokenizer.decode({token});
    if (text) bytes = *text;
  }
  for (int64_t id = 0; id < vocab; ++id)
    if (!out->bytes_[static_cast<size_t>(id)].empty())
      out->by_bytes_.push_back(static_cast<int32_t>(id));
  std::sort(out->by_bytes_.begin(), out->by_bytes_.end(), [&](int32_t a, int32_t b) {
    return out->bytes_[static_cast<size_t>(a)] < out->bytes_[static_cast<size_t>(b)];
  });
  for (int32_t id : out->by_bytes_) {
    if (auto characters = plain_characters(out->bytes_[static_cast<size_t>(id)])) {
      out->plain_.push_back(id);
      out->plain_characters_.push_back(*characters);
    } else {
      out->not_plain_.push_back(id);
    }
  }
  return out;
}

Expected<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::for_model(
    const std::filesystem::path& model, int64_t vocab) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int64_t>, std::shared_ptr<const TokenVocabulary>> built;
  std::lock_guard lock(mutex);
  const auto key = std::make_pair(model.string(), vocab);
  if (auto found = built.find(key); found != built.end()) return found->second;
  auto tokenizer = load_model_tokenizer(model);
  if (!tokenizer) return tokenizer.error();
  return built[key] = build(*tokenizer, vocab);
}

TokenConstraint::TokenConstraint(std::shared_ptr<const TokenVocabulary> vocabulary,
                                 std::shared_ptr<const JsonGrammar> grammar,
                                 std::vector<int32_t> end_tokens)
    : vocabulary_(std::move(vocabulary)),
      end_tokens_(std::move(end_tokens)),
      matcher_(std::move(grammar)) {}

void TokenConstraint::walk(const std::vector<int32_t>& sorted, size_t lo, size_t hi, size_t depth,
                           const JsonMatcher& matcher) {
  // [lo, hi) share their first `depth` bytes, which the matcher has taken; the tokens that end
  // there come first.
  auto text = [&](size_t i) -> const std::string& { return vocabulary_->bytes(sorted[i]); };
  while (lo < hi && text(lo).size() == depth) allowed_[static_cast<size_t>(sorted[lo++])] = 1;
  while (lo < hi) {
    const char byte = text(lo)[depth];
    size_t end = lo + 1;
    while (end < hi && text(end)[depth] == byte) ++end;
    JsonMatcher next = matcher;
    if (next.advance(std::string_view(&byte, 1))) walk(sorted, lo, end, depth + 1, next);
    lo = end;
  }
}

void TokenConstraint::mask(float* logits, int64_t vocab) {
  allowed_.assign(static_cast<size_t>(vocab), 0);
  if (!ended_) {
    const std::vector<int32_t>* walked = &vocabulary_->by_bytes_;
    if (std::optional<uint64_t> room = matcher_.plain_string_room()) {
      const std::vector<int32_t>& plain = vocabulary_->plain_;
      for (size_t i = 0; i < plain.size(); ++i)
        if (vocabulary_->plain_characters_[i] <= *room && plain[i] < vocab)
          allowed_[static_cast<size_t>(plain[i])] = 1;
      walked = &vocabulary_->not_plain_;
    }
    walk(*walked, 0, walked->size(), 0, matcher_);
  }
  const bool nothing_else = std::find(allowed_.begin(), allowed_.end(), 1) == allowed_.end();
  if (ended_ || nothing_else || matcher_.can_end())
    for (int32_t token : end_tokens_)
      if (token >= 0 && token < vocab) allowed_[static_cast<size_t>(token)] = 1;
  for (int64_t i = 0; i < vocab; ++i)
    if (!allowed_[static_cast<size_t>(i)]) logits[i] = -std::numeric_limits<float>::infinity();
}

void TokenConstraint::accept(int32_t token) {
  if (ended_) return;
  const bool end = std::find(end_tokens_.begin(), end_tokens_.end(), token) != end_tokens_.end();
  if (end && matcher_.can_end()) {
    ended_ = true;
    return;
  }
  if (token < 0 || token >= vocabulary_->size() || vocabulary_->bytes(token).empty() ||
      !matcher_.advance(vocabulary_->bytes(token)))
    ended_ = true;
}

Status constrain_sampler(Sampler& sampler, const SamplingParams& params,
                         const std::filesystem::path& model, int64_t vocab,
                         std::span<const int32_t> eos) {
  if (params.structured == StructuredOutput::kNone) return {};
  std::shared_ptr<const JsonGrammar> grammar;
  if (params.structured == StructuredOutput::kJsonObject) {
    grammar = JsonGrammar::any_object();
  } else {
    auto compiled = JsonGrammar::compile(params.json_schema);
    if (!compiled) return compiled.error();
    grammar = *compiled;
  }
  auto vocabulary = TokenVocabulary::for_model(model, vocab);
  if (!vocabulary) return vocabulary.error();
  std::vector<int32_t> end_tokens(eos.begin(), eos.end());
  end_tokens.insert(end_tokens.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
  sampler.constrain(
      std::make_shared<TokenConstraint>(*vocabulary, std::move(grammar), std::move(end_tokens)));
  return {};
}

}  // namespace moeline::model
