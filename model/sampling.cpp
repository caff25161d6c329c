#include "model/sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <span>
#include <string>
#include <utility>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"
#include "model/json_grammar.h"
#include "model/token_constraint.h"

namespace moeline::model {
namespace {

Status range_error(const char* name, const std::string& range, double value) {
  return Error{std::string(name) + " must be " + range + ", got " + std::to_string(value)};
}

// A logit's bits as an unsigned key that orders as the logits do, greatest first: a negative
// logit's bits as they are, a positive one's below 2^31 with the rest flipped. Without a branch
// (half the logits of a vocabulary are negative, in no order).
uint32_t descending_key(float logit) {
  const uint32_t bits = std::bit_cast<uint32_t>(logit);
  const uint32_t negative = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31);
  return bits ^ (0x7fffffffu & ~negative);
}

// Sorts keys whose upper 32 bits are descending_key(logit) and lower 32 bits the token id, given
// in id order: by logit, greatest first, ties in id order. Least significant digit first, four
// stable passes of a byte over the upper half (the ids stay in order within equal logits), for a
// vocabulary's worth of keys several times faster than a comparison sort; `scratch` holds as many
// keys, and the sorted keys end in `keys`.
void sort_by_logit(std::span<uint64_t> keys, uint64_t* scratch) {
  if (keys.size() < 4096) {
    std::sort(keys.begin(), keys.end());
    return;
  }
  uint64_t* from = keys.data();
  uint64_t* to = scratch;
  for (int shift = 32; shift < 64; shift += 8) {
    size_t starts[256] = {};
    for (size_t i = 0; i < keys.size(); ++i) ++starts[(from[i] >> shift) & 0xff];
    size_t next = 0;
    for (size_t& start : starts) next += std::exchange(start, next);
    for (size_t i = 0; i < keys.size(); ++i) to[starts[(from[i] >> shift) & 0xff]++] = from[i];
    std::swap(from, to);
  }
}

}  // namespace

Status SamplingParams::validate(int64_t vocab) const {
  if (!std::isfinite(temperature) || temperature < 0.0)
    return range_error("temperature", "a finite number >= 0 (0 means greedy)", temperature);
  if (top_k < 0)
    return Error{"top_k must be >= 0 (0 means no limit), got " + std::to_string(top_k)};
  if (!std::isfinite(top_p) || top_p <= 0.0 || top_p > 1.0)
    return range_error("top_p", "in (0, 1]", top_p);
  if (max_tokens < 1) return Error{"max_tokens must be >= 1, got " + std::to_string(max_tokens)};
  if (!std::isfinite(min_p) || min_p < 0.0 || min_p > 1.0)
    return range_error("min_p", "in [0, 1]", min_p);
  if (!std::isfinite(presence_penalty) || std::abs(presence_penalty) > 2.0)
    return range_error("presence_penalty", "in [-2, 2]", presence_penalty);
  if (!std::isfinite(frequency_penalty) || std::abs(frequency_penalty) > 2.0)
    return range_error("frequency_penalty", "in [-2, 2]", frequency_penalty);
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0.0)
    return range_error("repetition_penalty", "a finite number > 0 (1 means off)",
                       repetition_penalty);
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs)
    return Error{"top_logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "], got " +
                 std::to_string(top_logprobs)};
  if (top_logprobs > 0 && !logprobs && !prompt_logprobs)
    return Error{"top_logprobs needs logprobs or prompt_logprobs"};
  // Each generated token is looked up in the list: it is bounded like logit_bias.
  if (stop_token_ids.size() > kMaxStopTokenIds)
    return Error{"stop_token_ids may name at most " + std::to_string(kMaxStopTokenIds) +
                 " tokens, got " + std::to_string(stop_token_ids.size())};
  for (int32_t token : stop_token_ids)
    if (token < 0) return Error{"stop_token_ids holds a negative id: " + std::to_string(token)};
  if (min_tokens < 0 || min_tokens > max_tokens)
    return Error{"min_tokens must be in [0, max_tokens = " + std::to_string(max_tokens) +
                 "], got " + std::to_string(min_tokens)};
  // A grammar ends the answer where the document is complete, which holding the end back would
  // overrule (the answer would run on past its document).
  if (min_tokens > 0 && structured != StructuredOutput::kNone)
    return Error{
        "min_tokens cannot be combined with structured output: the grammar decides where "
        "the answer ends"};
  if (logit_bias.size() > kMaxLogitBias)
    return Error{"logit_bias may bias at most " + std::to_string(kMaxLogitBias) + " tokens, got " +
                 std::to_string(logit_bias.size())};
  std::vector<int32_t> tokens;
  for (const TokenBias& entry : logit_bias) {
    if (entry.token < 0 || (vocab > 0 && entry.token >= vocab))
      return Error{"logit_bias token id " + std::to_string(entry.token) +
                   (vocab > 0 ? " is outside the vocabulary [0, " + std::to_string(vocab) + ")"
                              : std::string(" is negative"))};
    if (!std::isfinite(entry.bias) || std::abs(entry.bias) > kMaxBias)
      return range_error("a logit_bias value", "in [-100, 100]", entry.bias);
    tokens.push_back(entry.token);
  }
  std::sort(tokens.begin(), tokens.end());
  if (const auto twice = std::adjacent_find(tokens.begin(), tokens.end()); twice != tokens.end())
    return Error{"logit_bias names token id " + std::to_string(*twice) + " twice"};
  switch (structured) {
    case StructuredOutput::kNone:
    case StructuredOutput::kJsonObject:
      if (!json_schema.empty())
        return Error{"json_schema is given without structured output json_schema"};
      break;
    case StructuredOutput::kJsonSchema:
    case StructuredOutput::kHermesToolCall:
      if (auto grammar = JsonGrammar::compile(json_schema); !grammar) return grammar.error();
      break;
    default:
      return Error{"structured output kind " + std::to_string(static_cast<int>(structured)) +
                   " is unknown"};
  }
  if (static_cast<uint8_t>(reasoning) > static_cast<uint8_t>(ReasoningBlock::kOpen))
    return Error{"reasoning block " + std::to_string(static_cast<int>(reasoning)) + " is unknown"};
  if (reasoning != ReasoningBlock::kNone && structured == StructuredOutput::kNone)
    return Error{"a reasoning block is given without structured output"};
  return Status::ok_status();
}

void apply_penalties(float* logits, int64_t vocab, std::span<const PenalizedToken> tokens,
                     const SamplingParams& params) {
  const double repetition = params.repetition_penalty;
  for (const PenalizedToken& entry : tokens) {
    if (entry.token < 0 || entry.token >= vocab) continue;
    double value = logits[entry.token];
    value = value > 0.0 ? value / repetition : value * repetition;
    value = value - params.frequency_penalty * entry.generated -
            params.presence_penalty * (entry.generated > 0 ? 1.0 : 0.0);
    logits[entry.token] = static_cast<float>(value);
  }
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params), rng_(params.seed ? *params.seed : std::random_device{}()) {}

double Sampler::uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

void Sampler::set_prompt(std::span<const int32_t> prompt) {
  // Only the repetition penalty looks at the prompt.
  if (params_.repetition_penalty == 1.0) return;
  for (int32_t token : prompt) generated_.emplace(token, 0);
}

void Sampler::hold_end_tokens(std::span<const int32_t> eos) {
  held_.clear();
  if (params_.min_tokens <= 0) return;
  if (!params_.ignore_eos) held_.assign(eos.begin(), eos.end());
  held_.insert(held_.end(), params_.stop_token_ids.begin(), params_.stop_token_ids.end());
}

void Sampler::record(int32_t token) {
  ++drawn_;
  if (params_.penalized()) ++generated_[token];
  if (constraint_) constraint_->accept(token);
}

// Each sample draws exactly one uniform when sampling, none when greedy.
void Sampler::resume(std::span<const int32_t> output) {
  if (params_.temperature != 0.0) rng_.discard(static_cast<unsigned long long>(output.size()));
  for (int32_t token : output) record(token);
}

int32_t argmax(const float* logits, int64_t vocab) {
  return static_cast<int32_t>(kernels::first_max_index(logits, vocab));
}

// A draw weighs each token by w = exp((logit - best) / temperature) and sums the weights best
// first from the best's 1, so a weight under 2^-53 changes no sum (it is under half a unit in
// the last place of a total of at least 1): such tokens are left out rather than sorted with the
// rest (weights under min_p too, which the min-p cut would drop), and the draw is the one over
// the whole vocabulary except in the 2^-53-rare case where rounding would have let the walk run
// past every token that weighs anything. With a flat distribution (random weights) nearly every
// token counts; a trained model's at temperature <= 1 leaves most of a large vocabulary out.
int64_t Sampler::order_candidates(const float* logits, int64_t vocab) {
  const double best = logits[argmax(logits, vocab)];
  // exp(-37.5) < 2^-53 (= exp(-36.74)), with a margin for the rounding of x.
  double cutoff = -37.5;
  if (params_.min_p > 0.0) cutoff = std::max(cutoff, std::log(params_.min_p) - 1e-6);
  // (logit - best) / T >= cutoff as a float floor on the logit, rounded down: a token just under
  // the cut may come in, which changes nothing (it is weighed as before), none above it stays out.
  const double floor = best + cutoff * params_.temperature;
  float floor_logit = static_cast<float>(floor);
  if (static_cast<double>(floor_logit) > floor)
    floor_logit = std::nextafter(floor_logit, -INFINITY);
  if (keys_.size() < static_cast<size_t>(vocab)) {
    keys_.resize(static_cast<size_t>(vocab));
    sorted_keys_.resize(static_cast<size_t>(vocab));
  }
  size_t count = 0;
  for (int64_t i = 0; i < vocab; ++i) {  // without a branch: a token in or out is a coin toss
    keys_[count] =
        static_cast<uint64_t>(descending_key(logits[i])) << 32 | static_cast<uint32_t>(i);
    count += logits[i] >= floor_logit;
  }
  sort_by_logit(std::span(keys_.data(), count), sorted_keys_.data());
  order_.resize(count);
  for (size_t i = 0; i < count; ++i) order_[i] = static_cast<int32_t>(keys_[i]);
  return static_cast<int64_t>(order_.size());
}

int32_t Sampler::sample(const float* raw_logits, int64_t vocab) {
  const float* logits = raw_logits;
  const bool penalize = params_.penalized() && !generated_.empty();
  const bool hold_end = drawn_ < params_.min_tokens && !held_.empty();
  if (!params_.logit_bias.empty() || penalize || constraint_ || hold_end) {
    adjusted_.assign(raw_logits, raw_logits + vocab);
    logits = adjusted_.data();
  }
  // The bias first, in float, then the penalties on the biased logits (vLLM's order).
  for (const TokenBias& entry : params_.logit_bias)
    if (entry.token >= 0 && entry.token < vocab) adjusted_[entry.token] += entry.bias;
  if (penalize) {
    // Each token's adjustment is independent of the others': the list is rebuilt in place, in
    // the map's order.
    penalized_.clear();
    for (const auto& [token, count] : generated_) penalized_.push_back({token, count});
    apply_penalties(adjusted_.data(), vocab, penalized_, params_);
  }
  if (constraint_) constraint_->mask(adjusted_.data(), vocab);
  if (hold_end)
    for (int32_t end : held_)
      if (end >= 0 && end < vocab) adjusted_[end] = -INFINITY;
  int32_t token = 0;
  if (params_.temperature == 0.0) {
    token = argmax(logits, vocab);
  } else {
    // Candidates, best first (ties: lower id first, so the order is reproducible).
    int64_t kept = vocab;
    if (params_.top_k > 0 && params_.top_k < vocab) {
      order_.resize(static_cast<size_t>(vocab));
      for (int64_t i = 0; i < vocab; ++i) order_[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      auto better = [logits](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      };
      kept = params_.top_k;
      std::partial_sort(order_.begin(), order_.begin() + kept, order_.end(), better);
    } else {
      kept = order_candidates(logits, vocab);
      if (kept == 0) {  // every logit -inf or NaN: nothing to weigh, but the draw is made
        uniform();
        token = argmax(logits, vocab);
        record(token);
        return token;
      }
    }

    // Probabilities relative to the best candidate's (which is 1).
    probabilities_.resize(static_cast<size_t>(kept));
    const double max_logit = logits[order_[0]];
    for (int64_t i = 0; i < kept; ++i)
      probabilities_[static_cast<size_t>(i)] =
          std::exp((logits[order_[static_cast<size_t>(i)]] - max_logit) / params_.temperature);
    if (params_.min_p > 0.0) {
      int64_t above = 1;
      while (above < kept && probabilities_[static_cast<size_t>(above)] >= params_.min_p) ++above;
      kept = above;
    }
    double total = 0.0;
    for (int64_t i = 0; i < kept; ++i) total += probabilities_[static_cast<size_t>(i)];
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
    token = order_[static_cast<size_t>(kept - 1)];
    for (int64_t i = 0; i < kept; ++i) {
      cumulative += probabilities_[static_cast<size_t>(i)];
      if (target < cumulative) {
        token = order_[static_cast<size_t>(i)];
        break;
      }
    }
  }
  record(token);
  return token;
}

void sample_rows(std::span<Sampler* const> samplers, const float* logits, int64_t vocab,
                 kernels::ThreadPool* pool, std::span<int32_t> tokens) {
  auto draw = [&](size_t i) {
    if (samplers[i] != nullptr)
      tokens[i] = samplers[i]->sample(logits + static_cast<int64_t>(i) * vocab, vocab);
  };
  const auto heavy = std::count_if(samplers.begin(), samplers.end(),
                                   [](const Sampler* s) { return s != nullptr && s->heavy(); });
  if (heavy < 2 || pool == nullptr || pool->size() < 2) {
    for (size_t i = 0; i < samplers.size(); ++i) draw(i);
    return;
  }
  pool->run([&](int thread, int threads) {
    for (size_t i = static_cast<size_t>(thread); i < samplers.size();
         i += static_cast<size_t>(threads))
      draw(i);
  });
}

TokenLogprobs token_logprobs(const float* logits, int64_t vocab, int32_t token, int64_t top) {
  TokenLogprobs out;
  if (vocab <= 0) return out;
  const float max_logit = logits[kernels::first_max_index(logits, vocab)];
  const double log_normalizer =
      static_cast<double>(max_logit) + std::log(kernels::sum_exp_shifted(logits, vocab, max_logit));
  if (token >= 0 && token < vocab)
    out.logprob = static_cast<float>(static_cast<double>(logits[token]) - log_normalizer);

  // The `top` best in (logit desc, id asc) order, kept sorted while scanning once.
  top = std::clamp<int64_t>(top, 0, vocab);
  std::vector<int32_t>& best = out.top_ids;
  best.reserve(static_cast<size_t>(top) + 1);
  auto better = [logits](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  // Once `top` are kept, a later token is better than the last kept only with a greater logit
  // (an equal one has the greater id), so blocks of 16 whose largest logit is no greater are
  // passed over at once (NaN is never better, and std::max keeps `cut` over it).
  constexpr int64_t kBlock = 16;
  float cut = 0.0f;
  for (int64_t i = 0; i < vocab && top > 0; ++i) {
    const bool full = static_cast<int64_t>(best.size()) == top;
    if (full && i % kBlock == 0 && i + kBlock <= vocab) {
      float largest = cut;
      for (int64_t k = 0; k < kBlock; ++k) largest = std::max(largest, logits[i + k]);
      if (!(largest > cut)) {
        i += kBlock - 1;
        continue;
      }
    }
    const auto id = static_cast<int32_t>(i);
    if (full && !better(id, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), id, better), id);
    if (static_cast<int64_t>(best.size()) > top) best.pop_back();
    if (static_cast<int64_t>(best.size()) == top) cut = logits[best.back()];
  }
  for (int32_t id : best)
    out.top_logprobs.push_back(
        static_cast<float>(static_cast<double>(logits[id]) - log_normalizer));
  return out;
}

}  // namespace moeline::model
