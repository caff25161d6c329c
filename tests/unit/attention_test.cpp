// The paged attention kernel against a plain double-precision attention, for grouped-query caches
// and for MLA's latent cache (values read from a prefix of each key row); and the properties the
// engine's determinism rests on: results do not depend on the thread count, on how heads are
// grouped into work items, or on which other queries share the call.
#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernel_test_inputs.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/rope.h"

namespace moeline::kernels {
namespace {

TEST(Ops, DotRowsIsDotBitForBit) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int64_t n : {1, 5, 16, 37, 288}) {
    std::vector<float> a(static_cast<size_t>(7 * n)), b(static_cast<size_t>(n));
    for (float& x : a) x = normal(rng);
    for (float& x : b) x = normal(rng);
    for (int64_t count = 1; count <= 7; ++count) {
      std::vector<float> out(static_cast<size_t>(count));
      dot_rows(a.data(), n, count, b.data(), n, out.data());
      for (int64_t j = 0; j < count; ++j)
        ASSERT_EQ(out[static_cast<size_t>(j)], dot(a.data() + j * n, b.data(), n))
            << "n " << n << " row " << j << " of " << count;
    }
  }
}

// first_max_index (greedy decoding's argmax) is std::max_element's answer on every path and input:
// the first maximum, wherever it lies (in a block of 16 or the tail), ties and signed zeros to the
// first, NaN skipped unless it comes first, infinities, and vocabularies shorter than a block.
TEST(Ops, FirstMaxIndexIsMaxElementsAnswerOnEveryPath) {
  const float nan = std::nanf(""), inf = INFINITY;
  std::vector<std::vector<float>> cases = {
      {7.0f},
      {nan, 1.0f, 2.0f},
      {1.0f, nan, 5.0f, nan},
      {-inf, -inf, -inf},
      {-inf, nan, -inf},
      {0.0f, -0.0f, 0.0f},
      {-0.0f, 0.0f},
      {1.0f, inf, 2.0f, inf},
  };
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> small(-3, 3);
  for (int64_t size : {15, 16, 17, 31, 32, 33, 100, 32000}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> logits(static_cast<size_t>(size));
      for (float& v : logits) v = static_cast<float>(small(rng));  // many ties
      if (trial % 4 == 1) logits[static_cast<size_t>(rng() % size)] = nan;
      if (trial % 4 == 2) logits.back() = 9.0f;  // the maximum in the tail
      cases.push_back(std::move(logits));
    }
  }
  const Isa saved = active_isa();
  for (Isa isa : test::supported_isas()) {
    ASSERT_TRUE(set_active_isa(isa));
    for (const std::vector<float>& logits : cases) {
      const auto expected = std::max_element(logits.begin(), logits.end()) - logits.begin();
      ASSERT_EQ(first_max_index(logits.data(), static_cast<int64_t>(logits.size())), expected)
          << isa_name(isa) << " size " << logits.size();
    }
  }
  ASSERT_TRUE(set_active_isa(saved));
}

// The softmax normalizer against its definition in double, over vocabularies in and past the
// blocks of 1024 and the lanes of 16, a normal spread of logits (a random-weight model's) and the
// extremes (-inf, logits far below the shift, NaN-free). The bound: each e^x within 2 ulp
// (1.2e-7), and a float lane adds 64 terms per block, each add within half an ulp of the lane's
// sum, so at most 64 * 6e-8 = 3.8e-6 of it; the blocks add in double.
TEST(Ops, SumExpShiftedIsTheNormalizerWithinItsBound) {
  std::mt19937 rng(3);
  std::normal_distribution<float> logit(0.0f, 3.0f);
  for (int64_t size : {1, 15, 16, 1023, 1024, 1025, 32000, 151669}) {
    std::vector<float> logits(static_cast<size_t>(size));
    for (float& v : logits) v = logit(rng);
    if (size > 4) {
      logits[1] = -INFINITY;
      logits[2] = -1e30f;
      logits[3] = logits[0] - 87.5f;
    }
    const float shift = *std::max_element(logits.begin(), logits.end());
    double want = 0.0;
    for (float v : logits) want += std::exp(static_cast<double>(v) - shift);
    const double got = sum_exp_shifted(logits.data(), size, shift);
    EXPECT_LE(std::abs(got - want), 3.8e-6 * want) << size << ": " << got << " want " << want;
  }
  // One logit: e^0, exactly.
  const float one = 4.5f;
  EXPECT_EQ(sum_exp_shifted(&one, 1, one), 1.0);
}

// silu(g) * u against its definition in double on every path, over the range activations take
// and past both ends of exp's range (each path's exp: the C library's, or exp_avx512.h's formula on
// 16 lanes or 8, within 2 ulp); ragged lengths take the vector tails.
TEST(Ops, SiluMulMatchesItsDefinitionOnEveryPath) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-30.0f, 30.0f);
  std::vector<float> gate(1000), up(1000);
  for (float& x : gate) x = uniform(rng);
  for (float& x : up) x = uniform(rng);
  const float extremes[] = {-200.0f, -88.0f, -87.5f, -20.0f, -1e-30f,
                            0.0f,    1e-30f, 0.5f,   88.0f,  200.0f};
  std::copy(std::begin(extremes), std::end(extremes), gate.begin());
  const Isa saved = active_isa();
  for (Isa isa : test::supported_isas()) {
    ASSERT_TRUE(set_active_isa(isa));
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{1000}}) {
      std::vector<float> out(gate.begin(), gate.begin() + n);
      silu_mul(out.data(), up.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double g = gate[static_cast<size_t>(i)], u = up[static_cast<size_t>(i)];
        const double want = g / (1.0 + std::exp(-g)) * u;
        ASSERT_NEAR(out[static_cast<size_t>(i)], want, 4e-7 * std::abs(want) + 1e-37)
            << isa_name(isa) << " n=" << n << " gate=" << g;
      }
    }
  }
  set_active_isa(saved);
}

struct Cache {
  int64_t block_size = 16, kv_heads, key_dim, value_dim;
  bool latent;  // MLA: values are the first value_dim floats of each key row
  std::vector<float> keys, values;
  std::vector<int32_t> table;

  Cache(int64_t positions, int64_t kv_heads_, int64_t key_dim_, int64_t value_dim_, bool latent_,
        std::mt19937& rng)
      : kv_heads(kv_heads_), key_dim(key_dim_), value_dim(value_dim_), latent(latent_) {
    const int64_t blocks = (positions + block_size - 1) / block_size;
    // A scrambled block table, as a real pool hands out.
    for (int64_t b = 0; b < blocks; ++b)
      table.push_back(static_cast<int32_t>((b * 5 + 3) % blocks));
    std::normal_distribution<float> normal;
    keys.resize(static_cast<size_t>(blocks * block_size * kv_heads * key_dim));
    for (float& x : keys) x = normal(rng);
    if (!latent) {
      values.resize(static_cast<size_t>(blocks * block_size * kv_heads * value_dim));
      for (float& x : values) x = normal(rng);
    }
  }
  PagedKvLayer layer() {
    return latent ? PagedKvLayer{keys.data(), keys.data(), block_size, kv_heads,
                                 key_dim,     value_dim,   key_dim}
                  : PagedKvLayer{keys.data(), values.data(), block_size, kv_heads,
                                 key_dim,     value_dim,     value_dim};
  }
};

// softmax(q·k * scale) · v over positions first..position, in double.
std::vector<double> reference(PagedKvLayer kv, const float* q, int64_t heads, const int32_t* table,
                              int64_t position, float scale, int64_t first = 0) {
  const int64_t group = heads / kv.kv_heads;
  std::vector<double> out(static_cast<size_t>(heads * kv.value_dim), 0.0);
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<double> score(static_cast<size_t>(position + 1), -INFINITY);
    double max_score = -INFINITY, sum = 0;
    for (int64_t p = first; p <= position; ++p) {
      const float* k = kv.key(table[p / kv.block_size], h / group, p % kv.block_size);
      double s = 0;
      for (int64_t d = 0; d < kv.key_dim; ++d) s += double(q[h * kv.key_dim + d]) * k[d];
      score[static_cast<size_t>(p)] = s * scale;
      max_score = std::max(max_score, s * scale);
    }
    for (double& s : score) sum += (s = std::exp(s - max_score));
    for (int64_t p = first; p <= position; ++p) {
      const float* v = kv.value(table[p / kv.block_size], h / group, p % kv.block_size);
      for (int64_t d = 0; d < kv.value_dim; ++d)
        out[static_cast<size_t>(h * kv.value_dim + d)] +=
            score[static_cast<size_t>(p)] / sum * v[d];
    }
  }
  return out;
}

struct Shape {
  const char* name;
  int64_t heads, kv_heads, key_dim, value_dim;
  bool latent;
};

class PagedAttention : public ::testing::TestWithParam<Shape> {};

void check_paged_attention(const Shape& shape, float query_scale, double tolerance);

// check_paged_attention on each kernel path this CPU runs (the AVX-512 paths reduce 16 dot
// products at once and have bits of their own).
void check_on_every_path(const Shape& shape, float query_scale, double tolerance) {
  const Isa saved = active_isa();
  for (Isa isa : test::supported_isas()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    ASSERT_TRUE(set_active_isa(isa));
    check_paged_attention(shape, query_scale, tolerance);
  }
  set_active_isa(saved);
}

TEST_P(PagedAttention, MatchesPlainAttentionWhateverTheThreadsAndCompany) {
  check_on_every_path(GetParam(), 0.3f, 1e-5);
}

// Scores far past where exp overflows in f32 (about 88): a softmax that does not take each row's
// largest score off first gives inf and NaN. Tolerance: a score of magnitude S from n products
// carries about S * 2^-24 * sqrt(n) of rounding, which exp makes a relative error of each weight:
// under 1e-4 for S ~ 150 and n <= 96.
TEST_P(PagedAttention, ScoresPastTheRangeOfExpStayExact) {
  check_on_every_path(GetParam(), 40.0f, 1e-3);
}

void check_paged_attention(const Shape& shape, float query_scale, double tolerance) {
  std::mt19937 rng(11);
  const int64_t positions = 300;
  Cache cache(positions, shape.kv_heads, shape.key_dim, shape.value_dim, shape.latent, rng);
  const PagedKvLayer kv = cache.layer();
  // Queries at a few positions: a decode step deep in the cache, and prompt tokens.
  const std::vector<int64_t> at = {299, 0, 17, 150, 151};
  std::normal_distribution<float> normal;
  std::vector<float> q(at.size() * static_cast<size_t>(shape.heads * shape.key_dim));
  for (float& x : q) x = normal(rng) * query_scale;
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.key_dim));
  auto run = [&](ThreadPool& pool, const std::vector<size_t>& which, int64_t window = 0) {
    std::vector<float> out(at.size() * static_cast<size_t>(shape.heads * shape.value_dim), -1.0f);
    std::vector<AttentionQuery> queries;
    for (size_t i : which)
      queries.push_back({q.data() + i * static_cast<size_t>(shape.heads * shape.key_dim),
                         out.data() + i * static_cast<size_t>(shape.heads * shape.value_dim),
                         cache.table.data(), at[i]});
    paged_attention(pool, kv, queries, shape.heads, scale, window);
    return out;
  };
  ThreadPool one(1), four(4);
  std::vector<size_t> all(at.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  const std::vector<float> together = run(four, all);
  const size_t width = static_cast<size_t>(shape.heads * shape.value_dim);
  for (size_t i = 0; i < at.size(); ++i) {
    // Alone on one thread (whole groups per item) and alone on four (heads split into chunks):
    // the same bits as in company.
    for (ThreadPool* pool : {&one, &four}) {
      const std::vector<float> alone = run(*pool, {i});
      for (size_t d = 0; d < width; ++d)
        ASSERT_EQ(alone[i * width + d], together[i * width + d]) << "query " << i << " dim " << d;
    }
    // Against double precision: f32 dot products of <= 600 terms and a softmax, ~1e-6 relative.
    const std::vector<double> want =
        reference(kv, q.data() + i * static_cast<size_t>(shape.heads * shape.key_dim), shape.heads,
                  cache.table.data(), at[i], scale);
    double diff = 0, norm = 0;
    for (size_t d = 0; d < width; ++d) {
      diff += std::pow(together[i * width + d] - want[d], 2);
      norm += want[d] * want[d];
    }
    EXPECT_LE(std::sqrt(diff / norm), tolerance) << "query at " << at[i];
  }
  // A sliding window of 37 starts inside a block (and, deep in the cache, in a later block than
  // the first): only the last 37 keys count.
  constexpr int64_t kWindow = 37;
  const std::vector<float> windowed = run(four, all, kWindow);
  for (size_t i = 0; i < at.size(); ++i) {
    const std::vector<double> want =
        reference(kv, q.data() + i * static_cast<size_t>(shape.heads * shape.key_dim), shape.heads,
                  cache.table.data(), at[i], scale, std::max<int64_t>(0, at[i] - kWindow + 1));
    double diff = 0, norm = 0;
    for (size_t d = 0; d < width; ++d) {
      diff += std::pow(windowed[i * width + d] - want[d], 2);
      norm += want[d] * want[d];
    }
    EXPECT_LE(std::sqrt(diff / norm), tolerance) << "windowed query at " << at[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Caches, PagedAttention,
                         ::testing::Values(Shape{"gqa", 8, 2, 32, 32, false},
                                           Shape{"mha", 4, 4, 16, 16, false},
                                           Shape{"mla", 16, 1, 72, 64, true},
                                           Shape{"mla_wide", 20, 1, 96, 80, true},
                                           // Widths no vector divides: the paths' ragged ends.
                                           Shape{"ragged", 6, 2, 20, 13, false}),
                         [](const auto& test) { return std::string(test.param.name); });

// Interleaved pairs (2i, 2i+1) and rotate-half pairs (i, i + d/2) are the same rotation on
// differently ordered dimensions; rotating by a then b equals rotating by a + b.
TEST(Rope, LayoutsAreOneRotationAndAnglesCompose) {
  const Rope half(8, 10000.0);
  const Rope interleaved(std::vector<double>{1.0, 0.1, 0.01, 0.001}, 1.0, true);
  const Rope plain(std::vector<double>{1.0, 0.1, 0.01, 0.001}, 1.0, false);
  EXPECT_EQ(half.dim(), 8);
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  // The same vector in both orders: interleaved (a0 b0 a1 b1 ...) and halves (a0 a1 .. b0 b1 ..).
  float inter[8], halves[8];
  for (int i = 0; i < 4; ++i) {
    inter[2 * i] = halves[i] = x[2 * i];
    inter[2 * i + 1] = halves[4 + i] = x[2 * i + 1];
  }
  float angles[8];
  plain.angles(37, angles);
  interleaved.rotate(inter, 1, 8, angles);
  plain.rotate(halves, 1, 8, angles);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(inter[2 * i], halves[i]);
    EXPECT_EQ(inter[2 * i + 1], halves[4 + i]);
  }
  float step[8], twice[8], once[8];
  std::copy(x, x + 8, twice);
  std::copy(x, x + 8, once);
  plain.angles(20, step);
  plain.rotate(twice, 1, 8, step);
  plain.angles(17, step);
  plain.rotate(twice, 1, 8, step);
  plain.rotate(once, 1, 8, angles);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(twice[i], once[i], 1e-5);
  // The attention factor scales cos and sin, except for a pure rotation.
  const Rope scaled(std::vector<double>{1.0, 0.1}, 1.5, true);
  float a[4], pure[4];
  scaled.angles(3, a);
  scaled.angles(3, pure, /*unscaled=*/true);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(a[i], 1.5f * pure[i]);
}

// Against the rotation written out: pair i of a head turns by position * theta^(-2i/dim), the first
// of the pair getting a cos - b sin and the second b cos + a sin (a sign slip, a wrong pairing or
// a wrong frequency each miss it by far more than float rounding).
TEST(Rope, MatchesTheClosedFormRotation) {
  constexpr int64_t kDim = 16;
  constexpr double kTheta = 10000.0;
  for (bool interleaved : {false, true}) {
    std::vector<double> inv_freq(kDim / 2);
    for (int64_t i = 0; i < kDim / 2; ++i)
      inv_freq[static_cast<size_t>(i)] = std::pow(kTheta, -2.0 * static_cast<double>(i) / kDim);
    const Rope rope = interleaved ? Rope(inv_freq, 1.0, true) : Rope(kDim, kTheta);
    for (int64_t position : {0, 1, 7, 300}) {
      float x[kDim], cos_sin[kDim];
      for (int64_t d = 0; d < kDim; ++d) x[d] = 0.25f * static_cast<float>(d + 1);
      float rotated[kDim];
      std::copy(x, x + kDim, rotated);
      rope.angles(position, cos_sin);
      rope.rotate(rotated, 1, kDim, cos_sin);
      for (int64_t i = 0; i < kDim / 2; ++i) {
        const int64_t first = interleaved ? 2 * i : i;
        const int64_t second = interleaved ? 2 * i + 1 : i + kDim / 2;
        const double angle = static_cast<double>(position) * std::pow(kTheta, -2.0 * i / kDim);
        const double a = x[first], b = x[second];
        EXPECT_NEAR(rotated[first], a * std::cos(angle) - b * std::sin(angle), 1e-5)
            << (interleaved ? "interleaved" : "rotate-half") << " p=" << position << " i=" << i;
        EXPECT_NEAR(rotated[second], b * std::cos(angle) + a * std::sin(angle), 1e-5)
            << (interleaved ? "interleaved" : "rotate-half") << " p=" << position << " i=" << i;
      }
    }
  }
}

}  // namespace
}  // namespace moeline::kernels
