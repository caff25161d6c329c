// The BF16 fast mode (bf16_matmul.h) against a double-precision reference of its definition
// (activations rounded to BF16, written here from the format: the top 16 bits of an F32, rounded to
// nearest, ties to even), its determinism (a row's bits whatever the batch, tile or threads), and
// its fallback: where the instruction is missing or a lower path is forced, the exact kernels run.
#include "kernels/cpu/bf16_matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "kernel_test_inputs.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/kernel_report.h"
#include "kernels/cpu/matmul.h"

namespace moeline::kernels {
namespace {

using test::gaussian_input;

class ModeGuard {
 public:
  ModeGuard(Isa isa, Bf16Math math) : isa_(active_isa()), math_(bf16_math()) {
    EXPECT_TRUE(set_active_isa(isa));
    set_bf16_math(math);
  }
  ~ModeGuard() {
    set_active_isa(isa_);
    set_bf16_math(math_);
  }

 private:
  Isa isa_;
  Bf16Math math_;
};

double round_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t kept = bits >> 16, rest = bits & 0xffffu;
  const uint32_t rounded = (rest > 0x8000u || (rest == 0x8000u && (kept & 1u))) ? kept + 1 : kept;
  const uint32_t out = rounded << 16;
  float result;
  std::memcpy(&result, &out, 4);
  return result;
}

// Random BF16 weights (normal values only: the instruction treats subnormal inputs as zero).
std::vector<uint16_t> bf16_weights(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
  std::vector<uint16_t> w(static_cast<size_t>(rows * cols));
  for (uint16_t& value : w) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    value = static_cast<uint16_t>(bits >> 16);  // truncated: any BF16 value will do
  }
  return w;
}

double weight(const std::vector<uint16_t>& w, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(w[static_cast<size_t>(i)]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

bool fast_mode_runs_here() {
  return cpu_has_bf16_dot_product() && best_supported_isa() >= Isa::kAvx512;
}

TEST(Bf16FastMath, MatchesTheReferenceOfBf16RoundedActivations) {
  if (!fast_mode_runs_here()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  ModeGuard guard(Isa::kAvx512, Bf16Math::kFast);
  ASSERT_TRUE(bf16_fast_in_use());
  ThreadPool pool(2);
  // Ragged rows and K (not a multiple of 32 or of a tile), one token (decode), a few, and more
  // than a token block (the row tiles).
  for (auto [rows, cols, n] : {std::tuple{7, 37, 1},
                               {33, 64, 5},
                               {19, 100, 13},
                               {64, 259, 70},
                               {9, 1024, 2},
                               {40, 31, 16}}) {
    const std::vector<uint16_t> w = bf16_weights(rows, cols, 7);
    const std::vector<float> x = gaussian_input(n, cols, 9);
    std::vector<float> y(static_cast<size_t>(n * rows));
    matmul(pool,
           MatmulTask{
               .x = x.data(), .n = n, .w = {w.data(), DType::kBF16, rows, cols}, .y = y.data()});
    double worst_rounding_share = 0.0;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t r = 0; r < rows; ++r) {
        double expected = 0.0, magnitude = 0.0, exact = 0.0;
        for (int64_t k = 0; k < cols; ++k) {
          const double term = weight(w, r * cols + k) * round_to_bf16(x[t * cols + k]);
          expected += term;
          magnitude += std::abs(term);
          exact += weight(w, r * cols + k) * x[t * cols + k];
        }
        // Each product is exact in F32 (8-bit by 8-bit mantissas); each lane adds cols / 16 of
        // them in F32 and 16 lanes are summed: at most (cols / 16 + 5) roundings of 2^-24 of
        // the running magnitude. Twice that bound.
        const double tolerance =
            2.0 * (static_cast<double>(cols) / 16.0 + 5.0) * 0x1p-24 * magnitude + 1e-30;
        ASSERT_NEAR(y[t * rows + r], expected, tolerance)
            << "rows=" << rows << " cols=" << cols << " n=" << n << " t=" << t << " r=" << r;
        // Against the exact product, the activations' rounding (2^-9 of each value) is the error.
        ASSERT_LE(std::abs(y[t * rows + r] - exact), 0x1p-9 * magnitude + tolerance);
        worst_rounding_share =
            std::max(worst_rounding_share, std::abs(y[t * rows + r] - exact) / magnitude);
      }
    }
    // The mode did round: a kernel that kept F32 activations would be exact to ~1e-7.
    EXPECT_GT(worst_rounding_share, 1e-5) << "rows=" << rows << " cols=" << cols;
  }
}

TEST(Bf16FastMath, RowResultDoesNotDependOnBatchTileOrThreads) {
  if (!fast_mode_runs_here()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  ModeGuard guard(Isa::kAvx512, Bf16Math::kFast);
  // Row tiles, a second token block, ragged ends; rows long enough (4.7 KiB) that the prefill
  // tiles take fewer tokens to stay in L1.
  for (int64_t cols : {131, 2400}) {
    const int64_t rows = 45, n = 70;
    const std::vector<uint16_t> w = bf16_weights(rows, cols, 3);
    const MatrixView view{w.data(), DType::kBF16, rows, cols};
    const std::vector<float> x = gaussian_input(n, cols, 4);
    ThreadPool two(2), one(1);
    std::vector<float> batched(static_cast<size_t>(n * rows));
    matmul(two, MatmulTask{.x = x.data(), .n = n, .w = view, .y = batched.data()});
    for (int64_t t = 0; t < n; ++t) {
      std::vector<float> alone(static_cast<size_t>(rows));
      matmul(one, MatmulTask{.x = x.data() + t * cols, .n = 1, .w = view, .y = alone.data()});
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(batched[t * rows + r], alone[r]) << "cols=" << cols << " t=" << t << " r=" << r;
    }
    // A few tokens (the row-at-a-time route) give the same bits as the row tiles.
    std::vector<float> three(static_cast<size_t>(3 * rows));
    matmul(two, MatmulTask{.x = x.data() + 10 * cols, .n = 3, .w = view, .y = three.data()});
    for (int64_t i = 0; i < 3 * rows; ++i) ASSERT_EQ(three[i], batched[10 * rows + i]);
  }
}

TEST(Bf16FastMath, StreamTuningDoesNotChangeResults) {
  if (!fast_mode_runs_here()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  ModeGuard guard(Isa::kAvx512, Bf16Math::kFast);
  const StreamTuning saved = stream_tuning();
  for (auto [rows, cols, n, threads] :
       {std::tuple{45, 131, 1, 1}, {200, 64, 2, 2}, {301, 100, 6, 2}, {70, 1024, 1, 2}}) {
    const std::vector<uint16_t> w = bf16_weights(rows, cols, 13);
    const MatrixView view{w.data(), DType::kBF16, rows, cols};
    const std::vector<float> x = gaussian_input(n, cols, 14);
    ThreadPool pool(threads);
    std::vector<float> reference;
    for (const StreamTuning tuning : {StreamTuning{.decode_streams = 1, .prefetch_bytes = 1024},
                                      StreamTuning{.decode_streams = 2, .prefetch_bytes = 0}}) {
      set_stream_tuning(tuning);
      std::vector<float> y(static_cast<size_t>(n * rows));
      matmul(pool, MatmulTask{.x = x.data(), .n = n, .w = view, .y = y.data()});
      if (reference.empty())
        reference = y;
      else
        ASSERT_EQ(y, reference) << "rows=" << rows << " n=" << n;
    }
  }
  set_stream_tuning(saved);
}

// Rows that do not start on a cache line are read with aligned loads and a permute (decode
// without software prefetch): the same values, so the same bits as rows that do, at any offset.
TEST(Bf16FastMath, RowsAtAnyOffsetFromACacheLineGiveTheSameBits) {
  if (!fast_mode_runs_here()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  ModeGuard guard(Isa::kAvx512, Bf16Math::kFast);
  const StreamTuning saved = stream_tuning();
  set_stream_tuning({.decode_streams = 2, .prefetch_bytes = 0});
  ThreadPool pool(1);
  for (int64_t cols : {96, 100, 1024}) {
    const int64_t rows = 40;
    const std::vector<uint16_t> w = bf16_weights(rows, cols, 17);
    for (int64_t n : {1, 2, 5}) {
      const std::vector<float> x = gaussian_input(n, cols, 18);
      std::vector<float> reference;
      for (size_t offset_bytes : {0, 2, 16, 46, 62}) {
        // A buffer on a cache line, the weights `offset_bytes` into it.
        std::vector<uint64_t> storage(static_cast<size_t>(rows * cols) / 4 + 32);
        auto* line = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) &
                                                ~uintptr_t{63});
        auto* placed = reinterpret_cast<uint16_t*>(line + offset_bytes);
        std::copy(w.begin(), w.end(), placed);
        std::vector<float> y(static_cast<size_t>(n * rows));
        matmul(pool,
               MatmulTask{
                   .x = x.data(), .n = n, .w = {placed, DType::kBF16, rows, cols}, .y = y.data()});
        if (reference.empty())
          reference = y;
        else
          ASSERT_EQ(y, reference) << "cols=" << cols << " n=" << n << " offset=" << offset_bytes;
      }
    }
  }
  set_stream_tuning(saved);
}

// The rounded activations are reused from matmul to matmul and grow without being zeroed
// (scratch_vector.h): every element a kernel reads, the padding of a ragged row included, must be
// written by the rounding itself. A copy grown over NaN garbage gives the bits a fresh one gives.
TEST(Bf16FastMath, AReusedActivationCopyGivesTheBitsOfAFreshOne) {
  if (!fast_mode_runs_here()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  ModeGuard guard(Isa::kAvx512, Bf16Math::kFast);
  const int64_t rows = 24;
  for (int64_t cols : {40, 100, 1030}) {
    const std::vector<uint16_t> w = bf16_weights(rows, cols, 21);
    const MatrixView view{w.data(), DType::kBF16, rows, cols};
    for (int64_t n : {1, 7, 13}) {
      const std::vector<float> x = gaussian_input(n, cols, 22);
      Bf16Activations fresh;
      round_activations_to_bf16(x.data(), n, cols, cols, fresh);
      Bf16Activations reused;
      const std::vector<float> garbage(static_cast<size_t>(2 * n * (cols + 64)), NAN);
      round_activations_to_bf16(garbage.data(), 2 * n, cols + 64, cols + 64, reused);
      reused.values.resize(1);  // shrink, so that the next call grows over what was there
      round_activations_to_bf16(x.data(), n, cols, cols, reused);
      std::vector<float> expected(static_cast<size_t>(n * rows)), y(expected.size());
      bf16_matmul_rows(view, fresh, expected.data(), rows, 0, rows);
      bf16_matmul_rows(view, reused, y.data(), rows, 0, rows);
      for (float value : y) ASSERT_FALSE(std::isnan(value)) << "cols=" << cols << " n=" << n;
      EXPECT_EQ(y, expected) << "cols=" << cols << " n=" << n;
    }
  }
}

TEST(Bf16FastMath, WithoutTheInstructionTheExactKernelsRun) {
  // A forced AVX2 path stands for a CPU without AVX512_BF16: fast set, exact computed.
  if (best_supported_isa() < Isa::kAvx2) GTEST_SKIP() << "no AVX2";
  const int64_t rows = 12, cols = 80, n = 3;
  const std::vector<uint16_t> w = bf16_weights(rows, cols, 5);
  const MatrixView view{w.data(), DType::kBF16, rows, cols};
  const std::vector<float> x = gaussian_input(n, cols, 6);
  ThreadPool pool(1);
  std::vector<float> exact(static_cast<size_t>(n * rows)), fast(exact.size());
  {
    ModeGuard guard(Isa::kAvx2, Bf16Math::kExact);
    matmul(pool, MatmulTask{.x = x.data(), .n = n, .w = view, .y = exact.data()});
    EXPECT_EQ(kernel_report().bf16_math, "exact");
  }
  {
    ModeGuard guard(Isa::kAvx2, Bf16Math::kFast);
    EXPECT_FALSE(bf16_fast_in_use());
    matmul(pool, MatmulTask{.x = x.data(), .n = n, .w = view, .y = fast.data()});
    EXPECT_EQ(kernel_report().bf16_math.rfind("exact (fast set; ", 0), 0u)
        << kernel_report().bf16_math;
  }
  EXPECT_EQ(fast, exact);
}

TEST(Bf16FastMath, ModesParseAndDefaultToExact) {
  EXPECT_EQ(bf16_math(), Bf16Math::kExact);
  Bf16Math math = Bf16Math::kExact;
  EXPECT_TRUE(parse_bf16_math("fast", math));
  EXPECT_EQ(math, Bf16Math::kFast);
  EXPECT_TRUE(parse_bf16_math("exact", math));
  EXPECT_EQ(math, Bf16Math::kExact);
  EXPECT_FALSE(parse_bf16_math("Fast", math));
  EXPECT_FALSE(parse_bf16_math("", math));
}

}  // namespace
}  // namespace moeline::kernels
