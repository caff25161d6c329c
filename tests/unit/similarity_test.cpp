// Approximate reuse's building blocks: the FAISS HNSW index (recall against exact search,
// namespaces, tombstones, rebuilds) and activation signatures (pooling, normalisation, the seeded
// projection, the three metrics).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "reuse/signature.h"
#include "reuse/similarity_index.h"

namespace moeline::reuse {
namespace {

std::vector<float> random_unit(std::mt19937_64& rng, int dimension) {
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<size_t>(dimension));
  for (float& x : v) x = normal(rng);
  normalize(v);
  return v;
}

// `entry` moved by `amount` in a random direction, renormalised: a near-duplicate query.
std::vector<float> perturbed(std::vector<float> entry, std::mt19937_64& rng, float amount) {
  const std::vector<float> noise = random_unit(rng, static_cast<int>(entry.size()));
  for (size_t d = 0; d < entry.size(); ++d) entry[d] += amount * noise[d];
  normalize(entry);
  return entry;
}

// The exact answer, by brute force.
size_t nearest(const std::vector<std::vector<float>>& entries, const std::vector<float>& query) {
  size_t best = 0;
  float best_score = -2;
  for (size_t i = 0; i < entries.size(); ++i) {
    const float score = cosine(query, entries[i]);
    if (score > best_score) best_score = score, best = i;
  }
  return best;
}

TEST(SimilarityIndex, NearestNeighbourMatchesExactSearch) {
  constexpr int kDim = 64, kEntries = 2000, kQueries = 200;
  std::mt19937_64 rng(1);
  SimilarityIndex index({.dimension = kDim});
  std::vector<std::vector<float>> entries;
  for (int i = 0; i < kEntries; ++i) {
    entries.push_back(random_unit(rng, kDim));
    index.add("tenant:a", 1000 + static_cast<uint64_t>(i), entries.back());
  }
  int agree = 0;
  for (int q = 0; q < kQueries; ++q) {
    const std::vector<float> query =
        perturbed(entries[static_cast<size_t>(q * 7 % kEntries)], rng, 0.3f);
    const size_t best = nearest(entries, query);
    const auto hits = index.search("tenant:a", query, 1);
    ASSERT_EQ(hits.size(), 1u);
    agree += hits[0].id == 1000 + best;
    const auto& found = entries[hits[0].id - 1000];
    // The score is the inner product with the stored (half-precision) vector; that moves a cosine
    // of unit vectors by at most 2^-12 (|sum q_i (e_i - half(e_i))| <= 2^-12 sum |q_i e_i| <=
    // 2^-12).
    EXPECT_NEAR(hits[0].score, stored_inner_product(query, found), 1e-5);
    EXPECT_NEAR(hits[0].score, cosine(query, found), 2.5e-4);
  }
  // HNSW is approximate; at efSearch 64 on 2000 entries recall@1 is essentially exact.
  EXPECT_GE(agree, kQueries * 97 / 100) << agree << " of " << kQueries;
}

TEST(SimilarityIndex, NamespacesNeverSeeEachOther) {
  std::mt19937_64 rng(2);
  SimilarityIndex index({.dimension = 16});
  const std::vector<float> v = random_unit(rng, 16);
  index.add("tenant:a", 1, v);
  EXPECT_TRUE(index.search("tenant:b", v, 3).empty());
  EXPECT_EQ(index.search("tenant:a", v, 3).size(), 1u);
  EXPECT_EQ(index.size("tenant:a"), 1u);
  EXPECT_EQ(index.size("tenant:b"), 0u);
}

TEST(SimilarityIndex, ClearDropsEverythingAndAcceptsNewEntries) {
  std::mt19937_64 rng(4);
  SimilarityIndex index({.dimension = 16});
  const std::vector<float> v = random_unit(rng, 16);
  index.add("tenant:a", 1, v);
  index.clear();
  EXPECT_EQ(index.size("tenant:a"), 0u);
  EXPECT_TRUE(index.search("tenant:a", v, 3).empty());
  index.add("tenant:a", 2, v);
  ASSERT_EQ(index.search("tenant:a", v, 3).size(), 1u);
  EXPECT_EQ(index.search("tenant:a", v, 3)[0].id, 2u);
}

TEST(SimilarityIndex, RemovedEntriesAreNeverReturnedAndReplacementsAre) {
  std::mt19937_64 rng(3);
  SimilarityIndex index({.dimension = 16, .rebuild_tombstone_fraction = 0.9});
  const std::vector<float> a = random_unit(rng, 16), b = random_unit(rng, 16);
  index.add("n", 1, a);
  index.add("n", 2, b);
  index.remove("n", 1);
  EXPECT_EQ(index.tombstones("n"), 1u);
  for (const auto& hit : index.search("n", a, 5)) EXPECT_NE(hit.id, 1u);
  // Re-adding id 2 with a's vector: the old vector of 2 is a tombstone, the new one is found.
  index.add("n", 2, a);
  const auto hits = index.search("n", a, 5);
  ASSERT_EQ(hits.size(), 1u);
  EXPECT_EQ(hits[0].id, 2u);
  EXPECT_NEAR(hits[0].score, 1.0f, 2.5e-4);  // half-precision storage, as above
}

// The vectorised inner product (AVX-512, AVX2 or plain, whichever this CPU has) against a double
// precision sum over the same half-precision-rounded stored vector, at lengths that exercise the
// wide loop, the narrower loop and the scalar tail.
TEST(SimilarityIndex, StoredInnerProductMatchesADoubleSum) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  for (int d : {1, 7, 15, 16, 17, 31, 33, 37, 64, 100, 255, 256, 300}) {
    std::vector<float> q(static_cast<size_t>(d)), s(static_cast<size_t>(d));
    for (float& x : q) x = normal(rng);
    for (float& x : s) x = normal(rng);
    double want = 0, magnitude = 0;
    for (size_t i = 0; i < q.size(); ++i) {
      const double stored = static_cast<double>(static_cast<_Float16>(s[i]));
      want += static_cast<double>(q[i]) * stored;
      magnitude += std::abs(static_cast<double>(q[i]) * stored);
    }
    // float accumulation over d terms: a few ulps of the sum of magnitudes.
    EXPECT_NEAR(stored_inner_product(q, s), want, 1e-6 * magnitude) << "d=" << d;
  }
}

// Signatures of models with hundreds of experts are projected to 256 dimensions; the graph has
// several levels at 5000 entries. Recall@1 of near-duplicate queries against brute force.
TEST(SimilarityIndex, HighDimensionalNearDuplicatesAreFound) {
  constexpr int kDim = 256, kEntries = 5000, kQueries = 300;
  std::mt19937_64 rng(5);
  SimilarityIndex index({.dimension = kDim});
  std::vector<std::vector<float>> entries;
  for (int i = 0; i < kEntries; ++i) {
    entries.push_back(random_unit(rng, kDim));
    index.add("n", static_cast<uint64_t>(i), entries.back());
  }
  int agree = 0;
  for (int q = 0; q < kQueries; ++q) {
    const std::vector<float> query =
        perturbed(entries[static_cast<size_t>(q * 13 % kEntries)], rng, 0.5f);
    const size_t best = nearest(entries, query);
    const auto hits = index.search("n", query, 3);
    ASSERT_EQ(hits.size(), 3u);
    EXPECT_GE(hits[0].score, hits[1].score);
    EXPECT_GE(hits[1].score, hits[2].score);
    agree += hits[0].id == best;
  }
  EXPECT_GE(agree, kQueries * 97 / 100) << agree << " of " << kQueries;
}

TEST(SimilarityIndex, TombstonesPastTheThresholdRebuildThePartition) {
  std::mt19937_64 rng(4);
  SimilarityIndex index({.dimension = 32, .rebuild_tombstone_fraction = 0.25});
  std::vector<std::vector<float>> vectors;
  for (uint64_t i = 0; i < 100; ++i) {
    vectors.push_back(random_unit(rng, 32));
    index.add("n", i, vectors.back());
  }
  for (uint64_t i = 0; i < 30; ++i) index.remove("n", i);
  EXPECT_GE(index.rebuilds(), 1u);
  EXPECT_LT(index.tombstones("n"), 26u);
  EXPECT_EQ(index.size("n"), 70u);
  for (uint64_t i = 30; i < 100; ++i) {
    const auto hits = index.search("n", vectors[i], 1);
    ASSERT_EQ(hits.size(), 1u);
    EXPECT_EQ(hits[0].id, i) << "ids survive the rebuild";
  }
  for (uint64_t i = 0; i < 30; ++i)
    for (const auto& hit : index.search("n", vectors[i], 3)) EXPECT_GE(hit.id, 30u);
}

TEST(SimilarityIndex, WrongDimensionIsRefused) {
  SimilarityIndex index({.dimension = 8});
  const std::vector<float> v(7, 0.1f);
  EXPECT_THROW(index.add("n", 1, v), std::invalid_argument);
  EXPECT_TRUE(index.search("n", v, 1).empty());
}

TEST(Signature, Metrics) {
  const std::vector<float> a = {1, 0, 0}, b = {0, 1, 0}, c = {1, 1, 0};
  EXPECT_FLOAT_EQ(cosine(a, a), 1.0f);
  EXPECT_FLOAT_EQ(cosine(a, b), 0.0f);
  EXPECT_NEAR(cosine(a, c), 1 / std::sqrt(2.0f), 1e-6);
  EXPECT_NEAR(euclidean(a, b), std::sqrt(2.0f), 1e-6);
  const std::vector<std::set<int32_t>> x = {{1, 2}, {3}}, y = {{2, 4}, {3}};
  EXPECT_NEAR(jaccard(x, y), (1.0 / 3 + 1.0) / 2, 1e-6);
  EXPECT_FLOAT_EQ(jaccard(x, x), 1.0f);
  std::vector<float> zero(4, 0.0f);
  EXPECT_FALSE(normalize(zero));
}

TEST(Signature, ProjectionIsDeterministicAndKeepsCosines) {
  std::mt19937_64 rng(5);
  double worst = 0;
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> a = random_unit(rng, 512);
    std::vector<float> b = a;
    const std::vector<float> noise = random_unit(rng, 512);
    for (size_t i = 0; i < b.size(); ++i) b[i] += 0.5f * noise[i];
    normalize(b);
    const std::vector<float> pa = project(a, 256, 9), pb = project(b, 256, 9);
    EXPECT_EQ(pa, project(a, 256, 9)) << "same seed, same projection";
    EXPECT_NEAR(cosine(pa, pa), 1.0f, 1e-5);
    worst = std::max(worst, std::fabs(static_cast<double>(cosine(pa, pb) - cosine(a, b))));
  }
  // Johnson-Lindenstrauss at 256 dimensions: cosines move by a few hundredths.
  EXPECT_LT(worst, 0.12);
}

// Router events as the forward pass reports them.
struct Events {
  std::vector<model::RoutedToken> tokens;
  std::vector<float> scores;
  std::vector<int32_t> chosen;
  std::vector<float> weights;
  model::RouterEvent event(int64_t layer, int64_t experts, int64_t top_k) const {
    return {layer, experts, top_k, tokens, scores.data(), chosen.data(), weights.data()};
  }
};

TEST(Signature, PoolsTheWatchedTokensOfTheFirstLayers) {
  // MoE layers 1 and 3 (layer 0 dense); k = 2: layers 1 and 3 count, 5 does not.
  SignatureAccumulator acc({1, 3, 5}, 2, {.layers = 2, .dimension = 256});
  acc.watch(7, 1);  // position 0 is covered by a prefix hit
  Events e;
  e.tokens = {{7, 0}, {7, 1}, {7, 2}, {8, 0}};
  e.scores = {9, 9, 0.2f, 0.8f, 0.6f, 0.4f, 5, 5};  // [token][expert]
  e.chosen = {0, 1, 0, 1};
  e.weights = {1, 1, 1, 1};
  acc.on_router(e.event(1, 2, 1));
  acc.on_router(e.event(3, 2, 1));
  acc.on_router(e.event(5, 2, 1));                     // beyond k: ignored
  std::vector<float> want = {0.4f, 0.6f, 0.4f, 0.6f};  // means over positions 1 and 2
  normalize(want);
  const std::vector<float> got = acc.signature(7);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6);
  EXPECT_EQ(acc.expert_sets(7), (std::vector<std::set<int32_t>>{{0, 1}, {0, 1}}));
  EXPECT_TRUE(acc.signature(8).empty()) << "an unwatched sequence has no signature";
  acc.forget(7);
  EXPECT_TRUE(acc.signature(7).empty());
}

TEST(Signature, LargeConcatenationsAreProjected) {
  constexpr int64_t kExperts = 256;
  SignatureAccumulator acc({0, 1}, kExperts, {.layers = 2, .dimension = 64});
  acc.watch(1, 0);
  Events e;
  e.tokens = {{1, 0}};
  e.scores.resize(kExperts);
  for (int64_t i = 0; i < kExperts; ++i)
    e.scores[static_cast<size_t>(i)] = static_cast<float>(i % 7);
  e.chosen = {6};
  e.weights = {1};
  acc.on_router(e.event(0, kExperts, 1));
  acc.on_router(e.event(1, kExperts, 1));
  const std::vector<float> signature = acc.signature(1);
  ASSERT_EQ(signature.size(), 64u);
  double norm = 0;
  for (float x : signature) norm += x * x;
  EXPECT_NEAR(norm, 1.0, 1e-5);
}

}  // namespace
}  // namespace moeline::reuse
