#pragma once
// Choosing the next token from logits: greedy (temperature 0), or temperature with optional
// min-p, top-k and top-p (nucleus) filtering, drawn from a seeded generator so that the same seed
// and logits give the same tokens on every machine (the generator is std::mt19937_64, whose
// sequence the standard fixes, and uniform draws are made from its raw bits, not a library
// distribution). Repetition, frequency and presence penalties adjust the logits first, as vLLM
// and Hugging Face apply them; log-probabilities are reported from the raw logits.

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/status.h"

namespace moeline::kernels {
class ThreadPool;
}

namespace moeline::model {

// The most alternatives a request may ask log-probabilities for (OpenAI's limit).
inline constexpr int64_t kMaxTopLogprobs = 20;

// OpenAI's logit_bias: `bias` (in [-100, 100]) added to the logit of `token`.
struct TokenBias {
  int32_t token = 0;
  float bias = 0.0f;
  bool operator==(const TokenBias&) const = default;
};
// The most tokens one request may bias, and name as tokens that stop it.
inline constexpr size_t kMaxLogitBias = 1024;
inline constexpr size_t kMaxStopTokenIds = 1024;
inline constexpr double kMaxBias = 100.0;

// Structured output (OpenAI's response_format): the answer is constrained, token by token, to a
// JSON document (model/token_constraint.h).
enum class StructuredOutput : uint8_t {
  kNone = 0,
  kJsonObject = 1,  // any JSON object
  kJsonSchema = 2,  // a document that the JSON Schema in SamplingParams::json_schema accepts
  // That document inside Qwen's (Hermes-style) <tool_call> and </tool_call> tags: a forced tool
  // call (OpenAI's tool_choice "required" or a named function).
  kHermesToolCall = 3,
};

// A thinking model's reasoning before the document (structured output on a model that thinks
// in <think> blocks): the grammar holds once "</think>" has closed the block, as vLLM enforces
// structured output after its reasoning parsers' end marker.
enum class ReasoningBlock : uint8_t {
  kNone = 0,     // the document from the first byte
  kMayOpen = 1,  // "<think>", any text, "</think>", then the document; or the document at once
  kOpen = 2,     // the prompt opened the block: any text up to "</think>", then the document
};

class TokenConstraint;

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  double top_p = 1.0;        // 1: no nucleus cut
  std::optional<uint64_t> seed;
  int64_t max_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's end-of-sequence ids
  bool ignore_eos = false;
  // vLLM's min_tokens (0..max_tokens): the end-of-sequence ids (unless ignore_eos) and the stop
  // token ids are never drawn before this many tokens are out; the answer is at least this long
  // unless max_tokens or the context ends it.
  int64_t min_tokens = 0;
  // Keep only tokens at least min_p times as likely as the most likely one (after temperature).
  double min_p = 0.0;
  // OpenAI's penalties, in [-2, 2]: subtracted from the logit of every token already generated,
  // once (presence) and once per occurrence (frequency). The prompt does not count.
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  // Hugging Face's and vLLM's, > 0: the logit of every token in the prompt or the output so far
  // is divided by it when positive, multiplied when negative (1: off).
  double repetition_penalty = 1.0;
  // Report the chosen token's log-probability, and those of the top_logprobs most likely tokens.
  bool logprobs = false;
  int64_t top_logprobs = 0;
  // Report every prompt token's log-probability after the first, under the tokens before it,
  // with the top_logprobs most likely tokens' (OpenAI's echo with logprobs). The prompt is then
  // computed in full, reusing no cached work.
  bool prompt_logprobs = false;
  // Added to the logits before the penalties and the choice (vLLM's order; greedy included). The
  // log-probabilities stay those of the raw logits. Each token at most once.
  std::vector<TokenBias> logit_bias;
  // The answer's grammar: tokens that would leave it are never drawn, and the end of the answer
  // (an end-of-sequence or stop token) comes only where the document is complete. Applied after
  // the bias and the penalties; log-probabilities stay those of the raw logits.
  StructuredOutput structured = StructuredOutput::kNone;
  std::string json_schema;  // kJsonSchema: the schema's text
  // Where the grammar begins: after the model's reasoning block, or at once (kNone).
  ReasoningBlock reasoning = ReasoningBlock::kNone;

  bool deterministic() const { return temperature == 0.0 || seed.has_value(); }
  bool penalized() const {
    return presence_penalty != 0.0 || frequency_penalty != 0.0 || repetition_penalty != 1.0;
  }
  // Checks ranges; the message names the parameter and the accepted range. `vocab` > 0: the
  // biased tokens must lie inside it.
  Status validate(int64_t vocab = 0) const;
};

// A token the penalties apply to: in the prompt or the output so far, and how often it was
// generated (0: only in the prompt).
struct PenalizedToken {
  int32_t token;
  int32_t generated;
};

// logits[token] adjusted as the penalties say for each entry (repetition first, then frequency
// and presence, as vLLM orders them), in float arithmetic from a double adjustment.
void apply_penalties(float* logits, int64_t vocab, std::span<const PenalizedToken> tokens,
                     const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // The prompt's tokens, which the repetition penalty counts too.
  void set_prompt(std::span<const int32_t> prompt);
  // The next token; it joins the output that the penalties count.
  int32_t sample(const float* logits, int64_t vocab);
  // Continues after `output`, tokens another process drew with the same parameters (decode
  // after prefill): the generator advances as that many sample() calls would, and the penalties
  // and the constraint count them.
  void resume(std::span<const int32_t> output);
  // Whether a draw sorts or masks the vocabulary (temperature, or a grammar): hundreds of
  // microseconds or more on a large vocabulary, where greedy is a few.
  bool heavy() const { return params_.temperature != 0.0 || constraint_ != nullptr; }
  // Draws only what `constraint` allows from here on (model/token_constraint.h).
  void constrain(std::shared_ptr<TokenConstraint> constraint) {
    constraint_ = std::move(constraint);
  }
  // The tokens that end the answer (the model's end-of-sequence ids): with min_tokens, they and
  // the stop token ids are masked until min_tokens tokens are drawn.
  void hold_end_tokens(std::span<const int32_t> eos);

 private:
  double uniform();
  void record(int32_t token);
  // order_ := the tokens a draw at temperature can end on, best first (ties: lower id first);
  // returns how many.
  int64_t order_candidates(const float* logits, int64_t vocab);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;
  std::vector<uint64_t> keys_, sorted_keys_;  // order_candidates' sort, a vocabulary each
  std::vector<double> probabilities_;
  std::vector<float> adjusted_;  // the logits biased and penalized, when they are
  std::vector<PenalizedToken> penalized_;
  std::unordered_map<int32_t, int32_t> generated_;  // penalized runs only: token -> count
  int64_t drawn_ = 0;                               // tokens of the output so far
  std::vector<int32_t> held_;                       // masked while drawn_ < min_tokens
  std::shared_ptr<TokenConstraint> constraint_;
};

int32_t argmax(const float* logits, int64_t vocab);

// The chosen token's log-probability under the model's own distribution (the softmax of the raw
// logits, before penalties, temperature and truncation: what vLLM reports by default), and the
// `top` most likely tokens' (best first, ties to the lower id).
struct TokenLogprobs {
  float logprob = 0.0f;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};
TokenLogprobs token_logprobs(const float* logits, int64_t vocab, int32_t token, int64_t top);

// Each sampler's token from its row of `logits` (sampler i's at row i; a null sampler draws
// nothing and leaves its token as it is): one after another, or spread over `pool`'s threads when
// more than one draw sorts or masks the vocabulary (heavy(): 0.2-2.5 ms each on a 152k vocabulary
// at temperature), as decode's steps and prefill's batches draw. Each sampler is its own
// sequence's, so the tokens are the same either way.
void sample_rows(std::span<Sampler* const> samplers, const float* logits, int64_t vocab,
                 kernels::ThreadPool* pool, std::span<int32_t> tokens);

}  // namespace moeline::model
