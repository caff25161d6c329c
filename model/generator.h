#pragma once
// Generation on top of the Engine, in one process: all requests are prefilled together, then
// decoded in one batch per step; a request leaves the batch when it stops (a stop or end-of-
// sequence token) or reaches max_tokens, and its KV blocks go back to the pool. This is the
// engine-level baseline that the decode stage's continuous batching must match.

#include <cstdint>
#include <string>
#include <vector>

#include "model/forward.h"
#include "model/sampling.h"

namespace moeline::model {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  std::string cache_namespace;
  bool keep_step_logits = false;  // GenerationResult::step_logits, for checks against a reference
};

enum class FinishReason { kStop, kLength };
const char* finish_reason_name(FinishReason reason);

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated tokens, the stop token included when one ended it
  FinishReason finish_reason = FinishReason::kLength;
  std::vector<float> prompt_logits;  // logits at the last prompt position
  // Where the request asked (SamplingParams::prompt_logprobs): one per prompt token after the
  // first.
  std::vector<TokenLogprobs> prompt_logprobs;
  // Where the request asked: each generated token's log-probabilities (SamplingParams::logprobs),
  // and the raw logits it was drawn from, [tokens][vocab] (keep_step_logits).
  std::vector<TokenLogprobs> logprobs;
  std::vector<float> step_logits;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
};

// The stopping rule every path shares (this generator, the prefill, probe and decode stages): after
// the `generated`-th token `token` of a `prompt_tokens`-token prompt, the request ends with "stop"
// (a stop token: the request's, or an end-of-sequence id unless ignored; only past min_tokens),
// "length" (max_tokens, or the next position would pass `max_position`, when > 0), or goes on
// ("").
const char* finish_after(int32_t token, int64_t generated, int64_t prompt_tokens,
                         const SamplingParams& sampling, const std::vector<int32_t>& eos,
                         int64_t max_position);

class Generator {
 public:
  explicit Generator(ForwardPass& engine) : engine_(engine) {}
  Expected<std::vector<GenerationResult>> generate(const std::vector<GenerationRequest>& requests);

 private:
  ForwardPass& engine_;
  uint64_t next_sequence_id_ = 1;
};

}  // namespace moeline::model
