#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace moeline::model {

Status SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0)
    return Error{"temperature must be a finite number >= 0 (0 means greedy), got " +
                 std::to_string(temperature)};
  if (top_k < 0)
    return Error{"top_k must be >= 0 (0 means no limit), got " + std::to_string(top_k)};
  if (!std::isfinite(top_p) || top_p <= 0.0 || top_p > 1.0)
    return Error{"top_p must be in (0, 1], got " + std::to_string(top_p)};
  if (max_tokens < 1) return Error{"max_tokens must be >= 1, got " + std::to_string(max_tokens)};
  return Status::ok_status();
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params), rng_(params.seed ? *params.seed : std::random_device{}()) {}

double Sampler::uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

// Each sample draws exactly one uniform when sampling, none when greedy.
void Sampler::skip(int64_t samples) {
  if (params_.temperature != 0.0) rng_.discard(static_cast<unsigned long long>(samples));
}

int32_t argmax(const float* logits, int64_t vocab) {
  return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0.0) return argmax(logits, vocab);

  // Candidates, best first (ties: lower id first, so the order is reproducible).
  order_.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) order_[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  auto better = [logits](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int64_t kept = vocab;
  if (params_.top_k > 0 && params_.top_k < vocab) {
    kept = params_.top_k;
    std::partial_sort(order_.begin(), order_.begin() + kept, order_.end(), better);
  } else {
    std::sort(order_.begin(), order_.end(), better);
  }

  probabilities_.resize(static_cast<size_t>(kept));
  const double max_logit = logits[order_[0]];
  double total = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    const double p =
        std::exp((logits[order_[static_cast<size_t>(i)]] - max_logit) / params_.temperature);
    probabilities_[static_cast<size_t>(i)] = p;
    total += p;
  }
  if (params_.top_p < 1.0) {
    // Smallest prefix of the sorted candidates whose mass reaches top_p (at least one token).
    double mass = 0.0;
    int64_t nucleus = 0;
    while (nucleus < kept) {
      mass += probabilities_[static_cast<size_t>(nucleus++)] / total;
      if (mass >= params_.top_p) break;
    }
    kept = nucleus;
    total = 0.0;
    for (int64_t i = 0; i < kept; ++i) total += probabilities_[static_cast<size_t>(i)];
  }
  const double target = uniform() * total;
  double cumulative = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    cumulative += probabilities_[static_cast<size_t>(i)];
    if (target < cumulative) return order_[static_cast<size_t>(i)];
  }
  return order_[static_cast<size_t>(kept - 1)];
}

}  // namespace moeline::model
