#include "model/sampling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

namespace moeline::model {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, 2.5f, -1.0f, 0.0f, 2.9f};

TEST(Sampling, GreedyIsArgmax) {
  Sampler sampler(SamplingParams{});
  EXPECT_EQ(sampler.sample(kLogits.data(), 6), 1);
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
}

}  // namespace
}  // namespace moeline::model
