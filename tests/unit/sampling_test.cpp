#include "model/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/cpu/thread_pool.h"

namespace moeline::model {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, 2.5f, -1.0f, 0.0f, 2.9f};

TEST(Sampling, GreedyIsArgmax) {
  Sampler sampler(SamplingParams{});
  EXPECT_EQ(sampler.sample(kLogits.data(), 6), 1);
  // Ties go to the lowest id (as the CUDA argmax does), so every backend picks the same token.
  const std::vector<float> tied = {0.5f, 2.0f, -1.0f, 2.0f, 2.0f};
  EXPECT_EQ(argmax(tied.data(), 5), 1);
  EXPECT_EQ(sampler.sample(tied.data(), 5), 1);
}

TEST(Sampling, SameSeedSameTokensDifferentSeedDifferentTokens) {
  SamplingParams params{.temperature = 1.5, .seed = 42};
  auto draw = [&](uint64_t seed) {
    params.seed = seed;
    Sampler sampler(params);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 64; ++i) tokens.push_back(sampler.sample(kLogits.data(), 6));
    return tokens;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
}

TEST(Sampling, FrequenciesFollowTheTemperedSoftmax) {
  const double temperature = 0.8;
  Sampler sampler(SamplingParams{.temperature = temperature, .seed = 1});
  std::vector<int> counts(6, 0);
  const int draws = 200000;
  for (int i = 0; i < draws; ++i) ++counts[static_cast<size_t>(sampler.sample(kLogits.data(), 6))];
  double total = 0.0;
  std::vector<double> expected(6);
  for (int i = 0; i < 6; ++i) total += expected[i] = std::exp(kLogits[i] / temperature);
  for (int i = 0; i < 6; ++i) {
    const double p = expected[i] / total;
    // 5 standard deviations of a binomial proportion: fails only if the sampler is wrong.
    EXPECT_NEAR(counts[i] / static_cast<double>(draws), p,
                5 * std::sqrt(p * (1 - p) / draws) + 1e-4)
        << "token " << i;
  }
}

TEST(Sampling, TopKAndTopPRestrictTheCandidates) {
  Sampler top2(SamplingParams{.temperature = 1.0, .top_k = 2, .seed = 3});
  Sampler nucleus(SamplingParams{.temperature = 1.0, .top_p = 0.5, .seed = 3});
  std::map<int32_t, int> seen_top2, seen_nucleus;
  for (int i = 0; i < 2000; ++i) {
    ++seen_top2[top2.sample(kLogits.data(), 6)];
    ++seen_nucleus[nucleus.sample(kLogits.data(), 6)];
  }
  // Top-2 by logit: ids 1 (3.0) and 5 (2.9).
  EXPECT_EQ(seen_top2.size(), 2u);
  EXPECT_TRUE(seen_top2.count(1) && seen_top2.count(5));
  // softmax: p(1) ≈ 0.34, p(5) ≈ 0.31 → the 0.5 nucleus is {1, 5}.
  EXPECT_EQ(seen_nucleus.size(), 2u);
  EXPECT_TRUE(seen_nucleus.count(1) && seen_nucleus.count(5));
  Sampler tiny_p(SamplingParams{.temperature = 1.0, .top_p = 1e-6, .seed = 3});
  EXPECT_EQ(tiny_p.sample(kLogits.data(), 6), 1);
}

// What `params` should draw from kLogits, written from the definitions rather than from the
// sampler: the top_k best logits (ties to the lower id), of those the ones whose probability is at
// least min_p times the best one's, of those the smallest best-first prefix whose share of their
// mass reaches top_p; the survivors' softmax at `temperature`, renormalised over them alone.
std::vector<double> truncated_softmax(const SamplingParams& params) {
  const int n = static_cast<int>(kLogits.size());
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(),
                   [](int a, int b) { return kLogits[a] > kLogits[b]; });
  int kept = params.top_k > 0 ? static_cast<int>(std::min<int64_t>(params.top_k, n)) : n;
  std::vector<double> weight(static_cast<size_t>(n), 0.0);
  for (int i = 0; i < kept; ++i)
    weight[static_cast<size_t>(i)] =
        std::exp((kLogits[order[static_cast<size_t>(i)]] - kLogits[order[0]]) / params.temperature);
  int above = 1;
  while (above < kept && weight[static_cast<size_t>(above)] >= params.min_p) ++above;
  kept = above;
  double mass = 0.0;
  for (int i = 0; i < kept; ++i) mass += weight[static_cast<size_t>(i)];
  if (params.top_p < 1.0) {
    double share = 0.0;
    int nucleus = 0;
    while (nucleus < kept && share < params.top_p)
      share += weight[static_cast<size_t>(nucleus++)] / mass;
    kept = nucleus;
  }
  double total = 0.0;
  for (int i = 0; i < kept; ++i) total += weight[static_cast<size_t>(i)];
  std::vector<double> p(static_cast<size_t>(n), 0.0);
  for (int i = 0; i < kept; ++i)
    p[static_cast<size_t>(order[static_cast<size_t>(i)])] = weight[static_cast<size_t>(i)] / total;
  return p;
}

TEST(Sampling, TruncatedFrequenciesFollowTheRenormalisedSoftmax) {
  // Each truncation, and all of them together, at temperatures other than 1: a sampler that cuts
  // the right candidates but draws from the wrong mass (or cuts one too many or too few) fails.
  const std::vector<SamplingParams> cases = {
      {.temperature = 0.8, .top_k = 3, .seed = 11},
      {.temperature = 1.0, .top_p = 0.7, .seed = 12},
      {.temperature = 1.3, .top_p = 0.9, .seed = 13},
      {.temperature = 1.0, .seed = 14, .min_p = 0.2},
      {.temperature = 1.2, .top_k = 5, .top_p = 0.85, .seed = 15, .min_p = 0.05},
  };
  const int draws = 100000;
  for (const SamplingParams& params : cases) {
    Sampler sampler(params);
    std::vector<int> counts(kLogits.size(), 0);
    for (int i = 0; i < draws; ++i)
      ++counts[static_cast<size_t>(sampler.sample(kLogits.data(), 6))];
    const std::vector<double> expected = truncated_softmax(params);
    for (size_t i = 0; i < kLogits.size(); ++i) {
      const double p = expected[i];
      // 5 standard deviations of a binomial proportion, as above; a cut token is never drawn.
      EXPECT_NEAR(counts[i] / static_cast<double>(draws), p,
                  5 * std::sqrt(p * (1 - p) / draws) + 1e-4)
          << "token " << i << " with T " << params.temperature << " top_k " << params.top_k
          << " top_p " << params.top_p << " min_p " << params.min_p;
      if (p == 0.0) {
        EXPECT_EQ(counts[i], 0) << "token " << i << " was cut";
      }
    }
  }
}

TEST(Sampling, InvalidParametersAreRejectedWithTheirName) {
  auto message = [](SamplingParams params) {
    Status status = params.validate();
    return status.ok() ? std::string() : status.error().message;
  };
  EXPECT_NE(message({.temperature = -1}).find("temperature"), std::string::npos);
  EXPECT_NE(message({.temperature = NAN}).find("temperature"), std::string::npos);
  EXPECT_NE(message({.top_k = -2}).find("top_k"), std::string::npos);
  EXPECT_NE(message({.top_p = 0.0}).find("top_p"), std::string::npos);
  EXPECT_NE(message({.top_p = 1.5}).find("top_p"), std::string::npos);
  EXPECT_NE(message({.max_tokens = 0}).find("max_tokens"), std::string::npos);
  EXPECT_EQ(message({.temperature = 0.7, .top_k = 40, .top_p = 0.9}), "");
  EXPECT_NE(message({.min_p = 1.5}).find("min_p"), std::string::npos);
  EXPECT_NE(message({.presence_penalty = 2.5}).find("presence_penalty"), std::string::npos);
  EXPECT_NE(message({.frequency_penalty = -3}).find("frequency_penalty"), std::string::npos);
  EXPECT_NE(message({.repetition_penalty = 0}).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(message({.logprobs = true, .top_logprobs = 21}).find("top_logprobs"),
            std::string::npos);
  EXPECT_NE(message({.top_logprobs = 3}).find("logprobs"), std::string::npos);
  auto bias_message = [](std::vector<TokenBias> bias, int64_t vocab) {
    SamplingParams params;
    params.logit_bias = std::move(bias);
    Status status = params.validate(vocab);
    return status.ok() ? std::string() : status.error().message;
  };
  EXPECT_EQ(bias_message({{0, -100.0f}, {5, 100.0f}}, 6), "");
  EXPECT_NE(bias_message({{6, 1.0f}}, 6).find("outside the vocabulary"), std::string::npos);
  EXPECT_NE(bias_message({{-1, 1.0f}}, 0).find("logit_bias"), std::string::npos);
  EXPECT_NE(bias_message({{1, 100.5f}}, 6).find("logit_bias"), std::string::npos);
  EXPECT_NE(bias_message({{1, NAN}}, 6).find("logit_bias"), std::string::npos);
  EXPECT_NE(bias_message({{2, 1.0f}, {4, 0.0f}, {2, -1.0f}}, 6).find("twice"), std::string::npos);
  EXPECT_NE(bias_message(std::vector<TokenBias>(kMaxLogitBias + 1), 0).find("at most"),
            std::string::npos);
  // Every generated token is looked up in stop_token_ids: bounded like logit_bias.
  auto stops_message = [](std::vector<int32_t> stops) {
    SamplingParams params;
    params.stop_token_ids = std::move(stops);
    Status status = params.validate(6);
    return status.ok() ? std::string() : status.error().message;
  };
  EXPECT_EQ(stops_message({0, 5, 5}), "");
  EXPECT_NE(stops_message({-1}).find("stop_token_ids"), std::string::npos);
  EXPECT_NE(stops_message(std::vector<int32_t>(kMaxStopTokenIds + 1, 2)).find("at most"),
            std::string::npos);
  EXPECT_NE(message({.max_tokens = 4, .min_tokens = 5}).find("min_tokens"), std::string::npos);
  EXPECT_NE(message({.min_tokens = -1}).find("min_tokens"), std::string::npos);
  EXPECT_EQ(message({.max_tokens = 4, .min_tokens = 4}), "");
  SamplingParams grammar{.max_tokens = 4, .min_tokens = 1};
  grammar.structured = StructuredOutput::kJsonObject;
  EXPECT_NE(message(grammar).find("min_tokens"), std::string::npos);
  EXPECT_EQ(message({.min_p = 0.1,
                     .presence_penalty = -2,
                     .frequency_penalty = 2,
                     .repetition_penalty = 1.2,
                     .logprobs = true,
                     .top_logprobs = 20}),
            "");
}

TEST(Sampling, PenaltiesFollowTheirDefinitions) {
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f};
  // Token 0 generated twice, token 1 once, token 2 only in the prompt.
  const std::vector<PenalizedToken> seen = {{0, 2}, {1, 1}, {2, 0}};
  apply_penalties(logits.data(), 4, seen,
                  {.presence_penalty = 0.25, .frequency_penalty = 0.5, .repetition_penalty = 2.0});
  EXPECT_FLOAT_EQ(logits[0], 2.0f / 2 - 0.5f * 2 - 0.25f);
  EXPECT_FLOAT_EQ(logits[1], -1.0f * 2 - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(logits[2], 0.5f / 2);
  EXPECT_FLOAT_EQ(logits[3], 3.0f);  // never seen
}

// The bias is added first and the penalties act on the biased logit (vLLM's order); greedy
// follows it; the raw logits are left as they were (log-probabilities come from them).
TEST(Sampling, LogitBiasComesBeforeThePenaltiesAndSteersGreedy) {
  std::vector<float> logits = kLogits;
  SamplingParams params{.repetition_penalty = 2.0};
  params.logit_bias = {{0, 2.5f}, {1, -100.0f}};
  Sampler sampler(params);
  const std::vector<int32_t> prompt = {0};
  sampler.set_prompt(prompt);
  // Token 0: (kLogits[0] + 2.5) / 2 against the unbiased rest; token 1 is out.
  const float zero = (kLogits[0] + 2.5f) / 2.0f;
  int32_t best = 0;
  float best_value = zero;
  for (int32_t t = 2; t < 6; ++t)
    if (kLogits[static_cast<size_t>(t)] > best_value) {
      best = t;
      best_value = kLogits[static_cast<size_t>(t)];
    }
  EXPECT_EQ(sampler.sample(logits.data(), 6), best);
  EXPECT_EQ(logits, kLogits);
  SamplingParams push{};
  push.logit_bias = {{4, 100.0f}};
  Sampler pushed(push);
  EXPECT_EQ(pushed.sample(kLogits.data(), 6), 4);
  EXPECT_EQ(pushed.sample(kLogits.data(), 6), 4);
}

TEST(Sampling, GreedyWithARepetitionPenaltyAvoidsThePrompt) {
  Sampler sampler(SamplingParams{.repetition_penalty = 10.0});
  const std::vector<int32_t> prompt = {1};
  sampler.set_prompt(prompt);
  EXPECT_EQ(sampler.sample(kLogits.data(), 6), 5);  // 3.0 / 10 falls below 2.9
  EXPECT_EQ(sampler.sample(kLogits.data(), 6), 2);  // then 5 is penalised too
}

TEST(Sampling, ResumingDrawsWhatOneSamplerWouldHave) {
  const SamplingParams params{.temperature = 1.0, .seed = 9, .frequency_penalty = 1.5};
  Sampler whole(params);
  const int32_t first = whole.sample(kLogits.data(), 6);
  Sampler resumed(params);
  resumed.resume(std::span(&first, 1));
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(whole.sample(kLogits.data(), 6), resumed.sample(kLogits.data(), 6)) << i;
}

// vLLM's min_tokens: the end tokens (the model's end-of-sequence ids unless ignored, and the stop
// token ids) are never drawn before min_tokens tokens are out, and are drawn as before after.
TEST(Sampling, MinTokensHoldsTheEndTokensBack) {
  // Token 1 (3.0) is the best, 5 (2.9) the next, then 2 (2.5): 1 is the end of sequence, 5 a stop.
  const std::vector<int32_t> eos = {1};
  auto greedy = [&](SamplingParams params, std::span<const int32_t> resumed, int draws) {
    Sampler sampler(params);
    sampler.hold_end_tokens(eos);
    sampler.resume(resumed);
    std::vector<int32_t> out;
    for (int i = 0; i < draws; ++i) out.push_back(sampler.sample(kLogits.data(), 6));
    return out;
  };
  const SamplingParams held{.max_tokens = 8, .stop_token_ids = {5}, .min_tokens = 3};
  EXPECT_EQ(greedy(held, {}, 4), (std::vector<int32_t>{2, 2, 2, 1}));
  // Resumed after two tokens another process drew: one more is held.
  const std::vector<int32_t> two = {2, 2};
  EXPECT_EQ(greedy(held, two, 2), (std::vector<int32_t>{2, 1}));
  // ignore_eos: the end of sequence is no end, so only the stop token is held.
  SamplingParams ignored = held;
  ignored.ignore_eos = true;
  EXPECT_EQ(greedy(ignored, {}, 2), (std::vector<int32_t>{1, 1}));
  // No min_tokens: nothing held.
  EXPECT_EQ(greedy({.stop_token_ids = {5}}, {}, 1), (std::vector<int32_t>{1}));

  // At a temperature: no end token among the held draws, both among the free ones.
  SamplingParams hot = held;
  hot.temperature = 1.0;
  hot.seed = 3;
  hot.max_tokens = hot.min_tokens = 2000;
  Sampler sampler(hot);
  sampler.hold_end_tokens(eos);
  std::map<int32_t, int> counts;
  for (int i = 0; i < 2000; ++i) ++counts[sampler.sample(kLogits.data(), 6)];
  EXPECT_EQ(counts[1] + counts[5], 0);
  EXPECT_GT(counts[2], 0);
  counts.clear();
  for (int i = 0; i < 200; ++i) ++counts[sampler.sample(kLogits.data(), 6)];
  EXPECT_GT(counts[1], 0);
  EXPECT_GT(counts[5], 0);
}

TEST(Sampling, MinPDropsUnlikelyTokens) {
  // At temperature 1, token 3 (-1.0) is e^-4 ≈ 0.018 times as likely as token 1 (3.0).
  Sampler sampler(SamplingParams{.temperature = 1.0, .seed = 4, .min_p = 0.5});
  std::map<int32_t, int> seen;
  for (int i = 0; i < 4000; ++i) ++seen[sampler.sample(kLogits.data(), 6)];
  // p/p_max >= 0.5: ids 1 (1.0), 5 (e^-0.1), 2 (e^-0.5 ≈ 0.61); not 0 (e^-2) nor 4, 3.
  EXPECT_EQ(seen.size(), 3u);
  EXPECT_TRUE(seen.count(1) && seen.count(5) && seen.count(2));
  // min_p 0.2 keeps the same three and not id 0 (e^-2 ≈ 0.135), with top-k too: its candidates
  // come from a partial sort of the top k, not from the min-p floor the draw without top-k
  // applies before sorting, so the cut itself is what keeps id 0 out.
  for (const int64_t top_k : {int64_t{0}, int64_t{5}}) {
    Sampler cut(SamplingParams{.temperature = 1.0, .top_k = top_k, .seed = 4, .min_p = 0.2});
    std::map<int32_t, int> drawn;
    for (int i = 0; i < 4000; ++i) ++drawn[cut.sample(kLogits.data(), 6)];
    EXPECT_EQ(drawn.size(), 3u) << "top_k " << top_k;
    EXPECT_TRUE(drawn.count(1) && drawn.count(5) && drawn.count(2)) << "top_k " << top_k;
  }
}

// The draw as the definition states it (and tests/reference/sampling_reference.py computes it):
// every token sorted best first, ties by id, weighed, cut by min-p and top-p, walked.
int32_t draw_over_every_token(const std::vector<float>& logits, const SamplingParams& params,
                              double u) {
  const auto vocab = static_cast<int64_t>(logits.size());
  std::vector<int32_t> order(logits.size());
  for (int32_t i = 0; i < static_cast<int32_t>(vocab); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const double best = logits[order[0]];
  std::vector<double> weights(order.size());
  for (size_t i = 0; i < order.size(); ++i)
    weights[i] = std::exp((logits[order[i]] - best) / params.temperature);
  int64_t kept = vocab;
  if (params.min_p > 0.0) {
    int64_t above = 1;
    while (above < kept && weights[above] >= params.min_p) ++above;
    kept = above;
  }
  double total = 0.0;
  for (int64_t i = 0; i < kept; ++i) total += weights[i];
  if (params.top_p < 1.0) {
    double mass = 0.0;
    int64_t nucleus = 0;
    while (nucleus < kept) {
      mass += weights[nucleus++] / total;
      if (mass >= params.top_p) break;
    }
    kept = nucleus;
    total = 0.0;
    for (int64_t i = 0; i < kept; ++i) total += weights[i];
  }
  const double target = u * total;
  double cumulative = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    cumulative += weights[i];
    if (target < cumulative) return order[i];
  }
  return order[kept - 1];
}

// The sampler leaves out the tokens too unlikely to change a draw (under 2^-53 of the best's
// weight, or under min-p) and sorts the rest by their bits: every draw must still be the one over
// the whole vocabulary. Large vocabularies (the radix sort), logits spread far beyond the cut,
// ties, masked (-inf) tokens, and each cut.
TEST(Sampling, TokensLeftOutOfTheSortChangeNoDraw) {
  std::mt19937 random(5);
  for (const int64_t vocab : {int64_t{300}, int64_t{5000}, int64_t{70000}}) {
    std::vector<float> logits(static_cast<size_t>(vocab));
    std::normal_distribution<float> spread(0.0f, 12.0f);
    for (float& logit : logits) logit = spread(random);
    for (size_t i = 5; i < logits.size(); i += 5) logits[i] = logits[i - 3];  // ties
    for (int64_t i = 0; i < vocab; i += 7) logits[static_cast<size_t>(i)] = -INFINITY;
    logits[static_cast<size_t>(vocab / 3)] = 60.0f;  // a clear best, far above most
    for (const auto& [temperature, top_p, min_p] :
         std::vector<std::tuple<double, double, double>>{{1.0, 1.0, 0.0},
                                                         {0.7, 0.9, 0.0},
                                                         {2.0, 1.0, 0.0},
                                                         {1.5, 0.95, 1e-9},
                                                         {8.0, 0.5, 0.0}}) {
      SamplingParams params;
      params.temperature = temperature;
      params.top_p = top_p;
      params.min_p = min_p;
      params.seed = 11;
      Sampler sampler(params);
      std::mt19937_64 same_draws(11);  // the sampler's generator and its raw-bits uniform
      for (int draw = 0; draw < 40; ++draw) {
        const double u = static_cast<double>(same_draws() >> 11) * 0x1.0p-53;
        ASSERT_EQ(sampler.sample(logits.data(), vocab), draw_over_every_token(logits, params, u))
            << "vocab " << vocab << " temperature " << temperature << " top_p " << top_p
            << " min_p " << min_p << " draw " << draw;
      }
    }
  }
}

TEST(Sampling, LogprobsAreTheRawLogSoftmax) {
  const TokenLogprobs lp = token_logprobs(kLogits.data(), 6, 2, 3);
  double total = 0;
  for (float logit : kLogits) total += std::exp(logit);
  EXPECT_NEAR(lp.logprob, 2.5 - std::log(total), 1e-6);
  EXPECT_EQ(lp.top_ids, (std::vector<int32_t>{1, 5, 2}));
  ASSERT_EQ(lp.top_logprobs.size(), 3u);
  EXPECT_NEAR(lp.top_logprobs[0], 3.0 - std::log(total), 1e-6);
}

// Rows drawn on a pool are the draws one after another: seeded samplers at temperature (heavy,
// so the pool is used), a greedy one among them, and a null one whose token stays as it was.
TEST(Sampling, RowsDrawnOnThePoolAreTheSerialDraws) {
  constexpr int64_t kVocab = 5000;
  constexpr size_t kRows = 9;
  std::mt19937 rng(23);
  std::normal_distribution<float> spread(0.0f, 3.0f);
  std::vector<float> logits(kRows * kVocab);
  for (float& v : logits) v = spread(rng);
  auto params_of = [](size_t row) {
    SamplingParams params;
    params.temperature = row == 4 ? 0.0 : 0.8;
    params.seed = 100 + row;
    return params;
  };
  kernels::ThreadPool pool(2);
  for (int step = 0; step < 3; ++step) {
    std::vector<std::unique_ptr<Sampler>> serial, spread_out;
    std::vector<Sampler*> rows;
    for (size_t i = 0; i < kRows; ++i) {
      serial.push_back(std::make_unique<Sampler>(params_of(i)));
      spread_out.push_back(std::make_unique<Sampler>(params_of(i)));
      rows.push_back(i == 7 ? nullptr : spread_out.back().get());
    }
    std::vector<int32_t> tokens(kRows, -7);
    sample_rows(rows, logits.data(), kVocab, &pool, tokens);
    for (size_t i = 0; i < kRows; ++i) {
      const int32_t want = i == 7 ? -7 : serial[i]->sample(logits.data() + i * kVocab, kVocab);
      EXPECT_EQ(tokens[i], want) << "row " << i << " step " << step;
    }
    std::shuffle(logits.begin(), logits.end(), rng);
  }
}

// The `top` best as the definition scans for them: every token in id order, kept where it is
// better (a greater logit, or an equal one and a lower id) than the last kept.
std::vector<int32_t> best_by_scan(const std::vector<float>& logits, int64_t top) {
  auto better = [&logits](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::vector<int32_t> best;
  for (int32_t id = 0; id < static_cast<int32_t>(logits.size()) && top > 0; ++id) {
    if (static_cast<int64_t>(best.size()) == top && !better(id, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), id, better), id);
    if (static_cast<int64_t>(best.size()) > top) best.pop_back();
  }
  return best;
}

// The top alternatives and the normalizer over whole vocabularies: the same tokens as the
// definition's scan, which token_logprobs passes over 16 at a time once its `top` are kept (many
// ties, NaN, infinities, the best in a block's middle and in the tail); each log-probability
// within 1e-5 of the log-softmax in double (the normalizer's bound, 3.8e-6 relative, is under
// 4e-6 of a log, and a float's rounding of a log-probability near -20 is 1e-6).
TEST(Sampling, TopLogprobsAreTheDefinitionsOverWholeVocabularies) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> small(-4, 4);
  std::normal_distribution<float> spread(0.0f, 3.0f);
  for (int64_t vocab : {5, 16, 17, 33, 100, 1000, 32000}) {
    for (int trial = 0; trial < 8; ++trial) {
      std::vector<float> logits(static_cast<size_t>(vocab));
      for (float& v : logits)
        v = trial % 2 == 0 ? static_cast<float>(small(rng)) : spread(rng);  // ties, or none
      if (trial == 2) logits[static_cast<size_t>(rng() % vocab)] = std::nanf("");
      if (trial == 3) logits.back() = 40.0f;  // the best in the tail
      if (trial == 4) logits[static_cast<size_t>(rng() % vocab)] = -INFINITY;
      if (trial == 5 && vocab > 20) logits[19] = logits[20] = 30.0f;  // mid-block, tied
      for (int64_t top : {0, 1, 5, 20}) {
        const TokenLogprobs lp = token_logprobs(logits.data(), vocab, 3, top);
        ASSERT_EQ(lp.top_ids, best_by_scan(logits, std::min(top, vocab)))
            << "vocab " << vocab << " trial " << trial << " top " << top;
        if (trial == 2) continue;  // a NaN logit has no distribution
        const double shift = *std::max_element(logits.begin(), logits.end());
        double total = 0.0;
        for (float v : logits) total += std::exp(static_cast<double>(v) - shift);
        const double log_normalizer = shift + std::log(total);
        const auto expect_logprob = [&](float got, float logit) {
          const double want = logit - log_normalizer;
          if (std::isinf(want))
            EXPECT_EQ(got, want);  // a -inf logit's
          else
            EXPECT_NEAR(got, want, 1e-5);
        };
        expect_logprob(lp.logprob, logits[3]);
        for (size_t i = 0; i < lp.top_ids.size(); ++i)
          expect_logprob(lp.top_logprobs[i], logits[lp.top_ids[i]]);
      }
    }
  }
}

}  // namespace
}  // namespace moeline::model
