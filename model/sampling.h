#pragma once
// Choosing the next token from logits: greedy (temperature 0), or temperature with optional top-k
// and top-p (nucleus) filtering, drawn from a seeded generator so that the same seed and logits
// give the same tokens on every machine (the generator is std::mt19937_64, whose sequence the
// standard fixes, and uniform draws are made from its raw bits, not a library distribution).

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "model/status.h"

namespace moeline::model {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  double top_p = 1.0;        // 1: no nucleus cut
  std::optional<uint64_t> seed;
  int64_t max_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's end-of-sequence ids
  bool ignore_eos = false;

  bool deterministic() const { return temperature == 0.0 || seed.has_value(); }
  // Checks ranges; the message names the parameter and the accepted range.
  Status validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(const float* logits, int64_t vocab);
  // Advances the generator as `samples` calls to sample() would: a stage that continues a
  // sequence another process started (decode after prefill) draws exactly the same numbers.
  void skip(int64_t samples);

 private:
  double uniform();

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;
  std::vector<double> probabilities_;
};

int32_t argmax(const float* logits, int64_t vocab);

}  // namespace moeline::model
