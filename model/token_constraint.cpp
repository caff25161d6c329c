#include "model/token_constraint.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>

#include "model/model_text.h"

namespace moeline::model {

namespace {

// The trie of `sorted` (ids in the order of their texts), each node's range split by the next
// byte into its children.
TokenVocabulary::Trie make_trie(const std::vector<std::string>& bytes,
                                const std::vector<int32_t>& sorted) {
  TokenVocabulary::Trie trie;
  trie.tokens = sorted;
  trie.nodes.emplace_back();
  struct Pending {
    uint32_t node;
    size_t lo, hi, depth;
  };
  std::vector<Pending> stack = {{0, 0, sorted.size(), 0}};
  auto text = [&](size_t i) -> const std::string& { return bytes[static_cast<size_t>(sorted[i])]; };
  while (!stack.empty()) {
    const Pending p = stack.back();
    stack.pop_back();
    size_t lo = p.lo;
    while (lo < p.hi && text(lo).size() == p.depth) ++lo;
    trie.nodes[p.node].first_token = static_cast<uint32_t>(p.lo);
    trie.nodes[p.node].tokens = static_cast<uint32_t>(lo - p.lo);
    trie.nodes[p.node].first_child = static_cast<uint32_t>(trie.nodes.size());
    uint32_t children = 0;
    while (lo < p.hi) {
      const char byte = text(lo)[p.depth];
      size_t end = lo + 1;
      while (end < p.hi && text(end)[p.depth] == byte) ++end;
      stack.push_back({static_cast<uint32_t>(trie.nodes.size()), lo, end, p.depth + 1});
      trie.nodes.push_back({.byte = static_cast<uint8_t>(byte)});
      ++children;
      lo = end;
    }
    trie.nodes[p.node].children = children;
  }
  return trie;
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
  std::vector<int32_t> sorted, not_plain;
  for (int64_t id = 0; id < vocab; ++id)
    if (!out->bytes_[static_cast<size_t>(id)].empty()) sorted.push_back(static_cast<int32_t>(id));
  std::sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) {
    return out->bytes_[static_cast<size_t>(a)] < out->bytes_[static_cast<size_t>(b)];
  });
  std::vector<std::pair<uint32_t, int32_t>> plain;
  std::vector<int32_t> with_angle;
  out->plain_mask_.assign(static_cast<size_t>(vocab), 0);
  out->without_angle_mask_.assign(static_cast<size_t>(vocab), 0);
  for (int32_t id : sorted) {
    if (out->bytes_[static_cast<size_t>(id)].find('<') == std::string::npos)
      out->without_angle_mask_[static_cast<size_t>(id)] = 1;
    else
      with_angle.push_back(id);
  }
  for (int32_t id : sorted) {
    if (auto characters =
            JsonMatcher::plain_string_characters(out->bytes_[static_cast<size_t>(id)])) {
      plain.emplace_back(static_cast<uint32_t>(*characters), id);
      out->plain_mask_[static_cast<size_t>(id)] = 1;
    } else {
      not_plain.push_back(id);
    }
  }
  std::sort(plain.begin(), plain.end());
  for (const auto& [characters, id] : plain) {
    out->plain_.push_back(id);
    out->plain_characters_.push_back(characters);
  }
  out->all_ = make_trie(out->bytes_, sorted);
  out->not_plain_ = make_trie(out->bytes_, not_plain);
  out->with_angle_ = make_trie(out->bytes_, with_angle);
  const TokenVocabulary::Trie::Node& root = out->all_.nodes[0];
  for (uint32_t c = 0; c < root.children; ++c)
    out->first_byte_node_[out->all_.nodes[root.first_child + c].byte] = root.first_child + c;
  for (size_t i = 0; i < sorted.size();) {
    const auto byte = static_cast<uint8_t>(out->bytes_[static_cast<size_t>(sorted[i])][0]);
    size_t end = i;
    while (end < sorted.size() &&
           static_cast<uint8_t>(out->bytes_[static_cast<size_t>(sorted[end])][0]) == byte)
      ++end;
    out->first_byte_tokens_[byte] = {static_cast<uint32_t>(i), static_cast<uint32_t>(end)};
    i = end;
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
                                 std::vector<int32_t> end_tokens, ReasoningBlock reasoning)
    : vocabulary_(std::move(vocabulary)),
      end_tokens_(std::move(end_tokens)),
      matcher_(std::move(grammar), reasoning) {}

// at_depth_[depth] has taken the text of `node`: the tokens that end there are allowed, and the
// children whose byte it takes next are walked.
void TokenConstraint::walk(const TokenVocabulary::Trie& trie, uint32_t node, size_t depth) {
  const TokenVocabulary::Trie::Node& here = trie.nodes[node];
  for (uint32_t i = 0; i < here.tokens; ++i)
    allowed_[static_cast<size_t>(trie.tokens[here.first_token + i])] = 1;
  if (here.children == 0) return;
  if (at_depth_.size() <= depth + 1) at_depth_.push_back(at_depth_[depth]);
  for (uint32_t c = 0; c < here.children; ++c) {
    const uint32_t child = here.first_child + c;
    at_depth_[depth + 1] = at_depth_[depth];
    const auto byte = static_cast<char>(trie.nodes[child].byte);
    if (at_depth_[depth + 1].advance(std::string_view(&byte, 1))) walk(trie, child, depth + 1);
  }
}

void TokenConstraint::mask(float* logits, int64_t vocab) {
  const TokenVocabulary& words = *vocabulary_;
  // Rows past the tokenizer's vocabulary (padding) are never drawn.
  const int64_t known = std::min(vocab, words.size());
  allowed_.assign(static_cast<size_t>(known), 0);
  if (!ended_) {
    const TokenVocabulary::Trie* walked = &words.all_;
    if (std::optional<uint64_t> room = matcher_.plain_string_room()) {
      // Plain text, in the order of its length in characters: those that fit are a prefix.
      const auto fit = static_cast<size_t>(std::upper_bound(words.plain_characters_.begin(),
                                                            words.plain_characters_.end(),
                                                            std::min<uint64_t>(*room, UINT32_MAX)) -
                                           words.plain_characters_.begin());
      if (fit == words.plain_.size()) {
        std::copy(words.plain_mask_.begin(), words.plain_mask_.begin() + known, allowed_.begin());
      } else {
        for (size_t i = 0; i < fit; ++i) allowed_[static_cast<size_t>(words.plain_[i])] = 1;
      }
      walked = &words.not_plain_;
    } else if (std::optional<char> marker = matcher_.reasoning_text()) {
      // Text without '<' stays reasoning: only the tokens with one need the walk, and, where the
      // text so far began "</think>", those that begin with its next byte.
      std::copy(words.without_angle_mask_.begin(), words.without_angle_mask_.begin() + known,
                allowed_.begin());
      walked = &words.with_angle_;
      if (*marker != '\0') {
        const auto byte = static_cast<uint8_t>(*marker);
        const auto [begin, end] = words.first_byte_tokens_[byte];
        for (uint32_t i = begin; i < end; ++i) {
          const auto id = static_cast<size_t>(words.all_.tokens[i]);
          if (id < allowed_.size()) allowed_[id] = 0;
        }
        if (const uint32_t node = words.first_byte_node_[byte]; node != 0) {
          if (at_depth_.size() < 2) at_depth_.resize(2, matcher_);
          at_depth_[1] = matcher_;
          if (at_depth_[1].advance(std::string_view(&*marker, 1))) walk(words.all_, node, 1);
        }
      }
    }
    if (at_depth_.empty()) at_depth_.push_back(matcher_);
    at_depth_[0] = matcher_;
    walk(*walked, 0, 0);
  }
  // An end token that is also text (a stop token the request named) would end the answer here,
  // whatever the grammar took it for: only where the document is complete.
  const bool complete = matcher_.can_end();
  if (!complete)
    for (int32_t token : end_tokens_)
      if (token >= 0 && token < known) allowed_[static_cast<size_t>(token)] = 0;
  // Where nothing can come (a dead end the grammar did not foresee), the answer ends.
  const bool any = std::memchr(allowed_.data(), 1, allowed_.size()) != nullptr;
  if (ended_ || !any || complete)
    for (int32_t token : end_tokens_)
      if (token >= 0 && token < known) allowed_[static_cast<size_t>(token)] = 1;
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  const uint8_t* allowed = allowed_.data();
  for (int64_t i = 0; i < known; ++i) logits[i] = allowed[i] ? logits[i] : kNever;
  for (int64_t i = known; i < vocab; ++i) logits[i] = kNever;
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
  sampler.hold_end_tokens(eos);
  if (params.structured == StructuredOutput::kNone) return {};
  std::shared_ptr<const JsonGrammar> grammar;
  if (params.structured == StructuredOutput::kJsonObject) {
    grammar = JsonGrammar::any_object();
  } else {
    const bool tool_call = params.structured == StructuredOutput::kHermesToolCall;
    auto compiled = JsonGrammar::compile(params.json_schema,
                                         tool_call ? kHermesToolCallOpen : std::string_view(),
                                         tool_call ? kHermesToolCallClose : std::string_view());
    if (!compiled) return compiled.error();
    grammar = *compiled;
  }
  auto vocabulary = TokenVocabulary::for_model(model, vocab);
  if (!vocabulary) return vocabulary.error();
  std::vector<int32_t> end_tokens(eos.begin(), eos.end());
  end_tokens.insert(end_tokens.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
  sampler.constrain(std::make_shared<TokenConstraint>(*vocabulary, std::move(grammar),
                                                      std::move(end_tokens), params.reasoning));
  return {};
}

}  // namespace moeline::model
