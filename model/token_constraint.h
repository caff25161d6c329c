#pragma once
// Structured output at the level of tokens: which tokens may come next so that the text stays a
// prefix of a document the request's grammar (model/json_grammar.h) accepts, and the end of the
// answer (an end-of-sequence or stop token) only where the document is complete.
//
// The vocabulary is walked as a trie of the tokens' bytes, so that tokens sharing a prefix are
// matched once and a prefix the grammar refuses drops every token under it. Inside a string,
// the tokens of plain text (no quote, backslash or control byte; whole characters) are taken
// without a walk. Special tokens never stand for text.

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "model/json_grammar.h"
#include "model/sampling.h"
#include "tokenizer/tokenizer.h"

namespace moeline::model {

class TokenVocabulary {
 public:
  // The tokens' texts as a trie: a node's children are contiguous, and so are the tokens whose
  // text ends at it (indices into `tokens`).
  struct Trie {
    struct Node {
      uint32_t first_child = 0, children = 0;
      uint32_t first_token = 0, tokens = 0;
      uint8_t byte = 0;
    };
    std::vector<Node> nodes;  // nodes[0] is the root (the empty text)
    std::vector<int32_t> tokens;
  };

  static std::shared_ptr<const TokenVocabulary> build(const tokenizer::Tokenizer& tokenizer,
                                                      int64_t vocab);
  // The model's, built once per process from its tokenizer.
  static Expected<std::shared_ptr<const TokenVocabulary>> for_model(
      const std::filesystem::path& model, int64_t vocab);

  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  // The text a token writes after other text; empty for special tokens.
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }

 private:
  friend class TokenConstraint;
  std::vector<std::string> bytes_;
  Trie all_;        // every token with text
  Trie not_plain_;  // those that are not plain string text
  // The plain ones in the order of their length in code points, and those lengths; as a mask.
  std::vector<int32_t> plain_;
  std::vector<uint32_t> plain_characters_;
  std::vector<uint8_t> plain_mask_;
  // Reasoning text (a thinking model's block before the document): the tokens without '<', which
  // cannot begin its closing "</think>", as a mask, and the trie of those with one.
  std::vector<uint8_t> without_angle_mask_;
  Trie with_angle_;
  // The tokens of all_ (contiguous in its order) whose text begins with each byte, and the node
  // of all_ for that byte (0: none).
  std::array<std::pair<uint32_t, uint32_t>, 256> first_byte_tokens_{};
  std::array<uint32_t, 256> first_byte_node_{};
};

class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const TokenVocabulary> vocabulary,
                  std::shared_ptr<const JsonGrammar> grammar, std::vector<int32_t> end_tokens,
                  ReasoningBlock reasoning = ReasoningBlock::kNone);

  // Sets the logit of every token that cannot come next to -infinity. Where nothing else can
  // come, the end tokens stay.
  void mask(float* logits, int64_t vocab);
  // The token chosen.
  void accept(int32_t token);
  bool complete() const { return matcher_.can_end(); }

 private:
  void walk(const TokenVocabulary::Trie& trie, uint32_t node, size_t depth);

  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::vector<int32_t> end_tokens_;
  JsonMatcher matcher_;
  bool ended_ = false;  // an end token was taken, or a token the grammar refuses
  std::vector<uint8_t> allowed_;
  std::vector<JsonMatcher> at_depth_;  // the walk's matchers, one per depth, reused
};

// The tags around a Hermes-style tool call (Qwen2.5, Qwen3).
inline constexpr std::string_view kHermesToolCallOpen = "<tool_call>";
inline constexpr std::string_view kHermesToolCallClose = "</tool_call>";

// Gives `sampler` what its parameters forbid: the end-of-sequence ids (`eos`) and stop tokens
// before min_tokens, and the grammar of structured output, with the model's vocabulary (the
// parameters' stop tokens end the document too).
Status constrain_sampler(Sampler& sampler, const SamplingParams& params,
                         const std::filesystem::path& model, int64_t vocab,
                         std::span<const int32_t> eos);

}  // namespace moeline::model
