#pragma once
// OpenAI's echo with logprobs (vLLM's prompt_logprobs): the log-probability of every prompt token
// after the first under the tokens before it. The prompt runs through the forward pass in chunks
// that each return every position's logits, of which only the log-probabilities are kept, so a
// long prompt over a large vocabulary never holds [tokens][vocab] logits at once. Every path that
// reports them (`moeline run`, the prefill stage) goes through here.

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "model/forward.h"
#include "model/sampling.h"

namespace moeline::model {

// The most logits one chunk holds (bytes): a chunk is this over the vocabulary's row, at most
// kMaxPromptScoreChunk tokens and at least one.
inline constexpr int64_t kPromptScoreLogitBytes = int64_t{64} << 20;
inline constexpr int64_t kMaxPromptScoreChunk = 256;

struct PromptScore {
  std::vector<TokenLogprobs> logprobs;  // one per prompt token after the first, in order
  std::vector<float> last_logits;  // the last position's: what the first new token is drawn from
};

// Appends `tokens` to `sequence` (which must hold no tokens: a reused prefix would have no
// logits) and scores them, each entry with the `top` most likely tokens' log-probabilities. On
// error the sequence may hold part of the prompt; the caller releases it.
Status score_prompt(ForwardPass& forward, Sequence& sequence, std::span<const int32_t> tokens,
                    int64_t top, PromptScore& out);

}  // namespace moeline::model
