// The fast quantized matmul (8-bit activations, integer dot products) on every instruction-set
// path and block type: against a double-precision sum over the exactly dequantized weights and
// activations (what the integer arithmetic must equal), against the exact mode within the
// activations' 8-bit rounding, and bit-identical per row whatever the batch.
#include "kernels/cpu/quant_matmul.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "kernel_test_inputs.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/kernel_report.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quantize.h"

namespace moeline::kernels {
namespace {

constexpr DType kQuantized[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K,
                                DType::kQ6_K, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1};

using test::gaussian_input;
using test::random_quantized_rows;
using test::supported_isas;

class ModeGuard {
 public:
  ModeGuard(Isa isa, QuantMath math) : isa_(active_isa()), math_(quant_math()) {
    EXPECT_TRUE(set_active_isa(isa));
    set_quant_math(math);
  }
  ~ModeGuard() {
    set_active_isa(isa_);
    set_quant_math(math_);
  }

 private:
  Isa isa_;
  QuantMath math_;
};

std::vector<float> run(ThreadPool& pool, const MatrixView& w, const std::vector<float>& x,
                       int64_t n) {
  std::vector<float> y(static_cast<size_t>(n * w.rows));
  matmul(pool, MatmulTask{.x = x.data(), .n = n, .w = w, .y = y.data()});
  return y;
}

TEST(QuantMatmul, FastEqualsTheSumOverDequantizedWeightsAndActivations) {
  ThreadPool pool(2);
  const int64_t rows = 21, cols = 512;
  for (Isa isa : supported_isas()) {
    ModeGuard guard(isa, QuantMath::kFast);
    for (DType dtype : kQuantized) {
      const std::vector<uint8_t> bytes = random_quantized_rows(dtype, rows, cols, 11);
      const MatrixView w{bytes.data(), dtype, rows, cols};
      for (int64_t n : {1, 3, 11}) {
        const std::vector<float> x = gaussian_input(n, cols, 5);
        const std::vector<float> y = run(pool, w, x, n);
        QuantizedActivations xq;
        quantize_activations(x.data(), n, cols, cols, activation_block(dtype), xq);
        std::vector<float> weights(static_cast<size_t>(cols));
        for (int64_t r = 0; r < rows; ++r) {
          dequantize_row(quant_type(dtype), w.row(r), cols, weights.data());
          for (int64_t t = 0; t < n; ++t) {
            double expected = 0.0, magnitude = 0.0;
            for (int64_t k = 0; k < cols; ++k) {
              const double activation = xq.value(t, k);
              expected += activation * weights[static_cast<size_t>(k)];
              magnitude += std::abs(activation * weights[static_cast<size_t>(k)]);
            }
            // Float products of float scales and integer sums: a few ulps of the magnitude.
            const double tolerance = 2e-6 * magnitude + 1e-9;
            ASSERT_NEAR(y[static_cast<size_t>(t * rows + r)], expected, tolerance)
                << isa_name(isa) << ' ' << dtype_name(dtype) << " n=" << n << " t=" << t
                << " r=" << r;
          }
        }
      }
    }
  }
}

TEST(QuantMatmul, ActivationsRoundToTheirBlockScale) {
  const std::vector<float> x = gaussian_input(3, 512, 2);
  for (int64_t block : {32, 256}) {
    QuantizedActivations xq;
    quantize_activations(x.data(), 3, 512, 512, block, xq);
    for (int64_t t = 0; t < 3; ++t)
      for (int64_t k = 0; k < 512; ++k) {
        const float d = xq.row_scales(t)[k / block];
        EXPECT_LE(std::abs(xq.value(t, k) - x[static_cast<size_t>(t * 512 + k)]),
                  0.5f * d * 1.0001f);
      }
    for (int64_t s = 0; s < 3 * 512 / 16; ++s) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += xq.q[static_cast<size_t>(s * 16 + i)];
      EXPECT_EQ(xq.sums[static_cast<size_t>(s)], sum);
    }
  }
}

// Every path quantizes activations to the same bytes, scales and sums (the AVX-512 form is a
// separate implementation), including ties between two integers (rounded to even), zero blocks,
// NaN and infinities, and the Q4_K kernels' nibble order and min pairs.
TEST(QuantMatmul, ActivationsQuantizeToTheSameBytesOnEveryPath) {
  const int64_t rows = 3, cols = 1024;
  std::vector<float> x = gaussian_input(rows, cols, 5);
  for (int64_t k = 0; k < 256; ++k) x[static_cast<size_t>(k)] = 0.0f;  // a zero block
  for (int64_t k = 256; k < 512; ++k)  // -127 .. 126.5, so a scale of 1: every x.5 is a tie
    x[static_cast<size_t>(k)] = static_cast<float>((k % 254) - 127) + (k % 2 ? 0.5f : 0.0f);
  x[600] = std::nanf("");
  x[767] = std::nanf("");  // the last value a lane of the block maximum sees
  x[700] = INFINITY;
  x[1500] = -INFINITY;
  x[2100] = 3e38f;
  for (int64_t block : {32, 256}) {
    QuantizedActivations reference;
    {
      ModeGuard guard(Isa::kPortable, QuantMath::kFast);
      quantize_activations(x.data(), rows, cols, cols, block, reference);
    }
    for (Isa isa : supported_isas()) {
      ModeGuard guard(isa, QuantMath::kFast);
      QuantizedActivations xq;
      quantize_activations(x.data(), rows, cols, cols, block, xq);
      EXPECT_EQ(xq.q, reference.q) << isa_name(isa) << " block " << block;
      EXPECT_EQ(xq.sums, reference.sums) << isa_name(isa) << " block " << block;
      EXPECT_EQ(xq.q_nibble_order, reference.q_nibble_order) << isa_name(isa);
      EXPECT_EQ(xq.min_pairs, reference.min_pairs) << isa_name(isa);
      ASSERT_EQ(xq.scale.size(), reference.scale.size());
      for (size_t i = 0; i < xq.scale.size(); ++i)  // bit equality (NaN and inf included)
        EXPECT_EQ(std::bit_cast<uint32_t>(xq.scale[i]), std::bit_cast<uint32_t>(reference.scale[i]))
            << isa_name(isa) << " block " << block << " scale " << i;
    }
  }
  // The ties went to even (the scale of that block is exactly 1).
  QuantizedActivations xq;
  quantize_activations(x.data(), rows, cols, cols, 256, xq);
  EXPECT_EQ(xq.row_scales(0)[1], 1.0f);
  EXPECT_EQ(xq.q[257], -124);  // -123.5
  EXPECT_EQ(xq.q[259], -122);  // -121.5
  EXPECT_EQ(xq.q[383], 2);     // 2.5
  EXPECT_EQ(xq.q[385], 4);     // 4.5
  // Nibble order: quarters 1 and 2 of every 128 values swapped.
  EXPECT_EQ(xq.q_nibble_order[32], xq.q[64]);
  EXPECT_EQ(xq.q_nibble_order[64 + 5], xq.q[32 + 5]);
  EXPECT_EQ(xq.q_nibble_order[128 + 96], xq.q[128 + 96]);
}

TEST(QuantMatmul, FastStaysWithinEightBitRoundingOfExact) {
  ThreadPool pool(2);
  const int64_t rows = 64, cols = 1024, n = 4;
  for (DType dtype : kQuantized) {
    const std::vector<uint8_t> bytes = random_quantized_rows(dtype, rows, cols, 3);
    const MatrixView w{bytes.data(), dtype, rows, cols};
    const std::vector<float> x = gaussian_input(n, cols, 8);
    std::vector<float> exact, fast;
    {
      ModeGuard guard(best_supported_isa(), QuantMath::kExact);
      exact = run(pool, w, x, n);
    }
    {
      ModeGuard guard(best_supported_isa(), QuantMath::kFast);
      fast = run(pool, w, x, n);
    }
    double error = 0.0, norm = 0.0;
    for (size_t i = 0; i < exact.size(); ++i) {
      error += (fast[i] - exact[i]) * (fast[i] - exact[i]);
      norm += exact[i] * exact[i];
    }
    // Gaussian activations rounded to 1/127 of their group's maximum (~3 sigma): ~0.7% per
    // activation, averaging down over a row's 1024 terms to about that relative error overall.
    EXPECT_LT(std::sqrt(error / norm), 0.02) << dtype_name(dtype);
    EXPECT_GT(std::sqrt(error / norm), 0.0) << dtype_name(dtype) << ": fast is not the fast path";
  }
}

// Tasks of one matmul call that read the same input share its quantization (q, k and v; an
// expert's gate and up): every task still gives the bits it gives alone, whether its weights take
// the same activation blocks (Q4_K, Q6_K: 256) or not (Q8_0: 32), and a task on another input
// between them is not mixed up with them.
TEST(QuantMatmul, TasksOnOneInputGiveTheirOwnBits) {
  const int64_t rows = 40, cols = 512;
  for (Isa isa : supported_isas()) {
    ModeGuard guard(isa, QuantMath::kFast);
    for (int64_t n : {1, 3, 9}) {
      const std::vector<float> x = gaussian_input(n, cols, 8), other = gaussian_input(n, cols, 9);
      const DType types[] = {DType::kQ4_K, DType::kQ8_0, DType::kQ6_K, DType::kQ4_K};
      std::vector<std::vector<uint8_t>> bytes;
      std::vector<MatrixView> weights;
      for (size_t i = 0; i < std::size(types); ++i) {
        bytes.push_back(random_quantized_rows(types[i], rows, cols, 50 + static_cast<int>(i)));
        weights.push_back({bytes.back().data(), types[i], rows, cols});
      }
      ThreadPool pool(2);
      std::vector<std::vector<float>> together(std::size(types),
                                               std::vector<float>(static_cast<size_t>(n * rows)));
      std::vector<MatmulTask> tasks;
      for (size_t i = 0; i < std::size(types); ++i)  // the third task reads the other input
        tasks.push_back(
            {.x = (i == 2 ? other : x).data(), .n = n, .w = weights[i], .y = together[i].data()});
      matmul(pool, tasks);
      for (size_t i = 0; i < std::size(types); ++i)
        ASSERT_EQ(together[i], run(pool, weights[i], i == 2 ? other : x, n))
            << isa_name(isa) << " task " << i << ' ' << dtype_name(types[i]) << " n=" << n;
    }
  }
}

TEST(QuantMatmul, RowResultDoesNotDependOnBatchOrThreads) {
  const int64_t rows = 37, cols = 256, n = 19;
  for (Isa isa : supported_isas()) {
    ModeGuard guard(isa, QuantMath::kFast);
    for (DType dtype : kQuantized) {
      const std::vector<uint8_t> bytes = random_quantized_rows(dtype, rows, cols, 4);
      const MatrixView w{bytes.data(), dtype, rows, cols};
      const std::vector<float> x = gaussian_input(n, cols, 6);
      ThreadPool two(2), one(1);
      const std::vector<float> batched = run(two, w, x, n);
      // How far ahead the kernels prefetch (StreamTuning, chosen per host) changes no bit.
      const StreamTuning host = stream_tuning();
      for (const int64_t ahead : {0, 512, 2048}) {
        set_stream_tuning({.decode_streams = host.decode_streams,
                           .prefetch_bytes = host.prefetch_bytes,
                           .quant_prefetch_bytes = ahead});
        ASSERT_EQ(run(two, w, x, n), batched)
            << isa_name(isa) << ' ' << dtype_name(dtype) << " quant_prefetch_bytes=" << ahead;
      }
      set_stream_tuning(host);
      for (int64_t t = 0; t < n; ++t) {
        const std::vector<float> single(x.begin() + t * cols, x.begin() + (t + 1) * cols);
        const std::vector<float> alone = run(one, w, single, 1);
        for (int64_t r = 0; r < rows; ++r)
          ASSERT_EQ(batched[static_cast<size_t>(t * rows + r)], alone[static_cast<size_t>(r)])
              << isa_name(isa) << ' ' << dtype_name(dtype) << " t=" << t << " r=" << r;
      }
    }
  }
}

// Decode's weight streams (StreamTuning: one per thread, or a thread's rows in two halves read
// side by side, which the Q8_0/Q4_0 kernels do on AVX-512) and prefetch distances change no bit:
// each row equals the same row computed alone in one stream. Matrices large enough to leave the
// inline path (over 256 KiB), row counts whose halves are uneven, 1 to 6 tokens, 1 and 2 threads.
TEST(QuantMatmul, TwoStreamsGiveTheOneStreamBits) {
  const StreamTuning saved = stream_tuning();
  for (Isa isa : supported_isas()) {
    ModeGuard guard(isa, QuantMath::kFast);
    for (DType dtype : kQuantized) {
      for (auto [rows, cols, n, threads] :
           {std::tuple{1001, 512, 1, 1}, {777, 768, 2, 2}, {613, 1024, 5, 2}, {999, 256, 6, 1}}) {
        const std::vector<uint8_t> bytes = random_quantized_rows(dtype, rows, cols, 41);
        const MatrixView w{bytes.data(), dtype, rows, cols};
        std::vector<float> x = gaussian_input(n, cols, 43);
        for (int64_t k = 0; k < 64; ++k) x[static_cast<size_t>(k)] = k % 2 ? 90.0f : -90.0f;
        ThreadPool pool(threads);
        set_stream_tuning({.decode_streams = 1, .prefetch_bytes = 1024, .quant_prefetch_bytes = 0});
        const std::vector<float> one_stream = run(pool, w, x, n);
        for (const StreamTuning tuning :
             {StreamTuning{.decode_streams = 2, .prefetch_bytes = 0, .quant_prefetch_bytes = 0},
              StreamTuning{
                  .decode_streams = 2, .prefetch_bytes = 0, .quant_prefetch_bytes = 2048}}) {
          set_stream_tuning(tuning);
          ASSERT_EQ(run(pool, w, x, n), one_stream)
              << isa_name(isa) << ' ' << dtype_name(dtype) << " rows=" << rows << " n=" << n
              << " threads=" << threads << " quant_prefetch=" << tuning.quant_prefetch_bytes;
        }
        // And the kernel on its own: the two ranges side by side equal each range alone.
        QuantizedActivations xq;
        quantize_activations(x.data(), n, cols, cols, activation_block(dtype), xq);
        std::vector<float> apart(static_cast<size_t>(n * rows)), together(apart.size());
        const int64_t a_end = rows / 3, b_begin = rows / 2;
        quant_matmul_rows(w, xq, apart.data(), rows, 0, a_end);
        quant_matmul_rows(w, xq, apart.data(), rows, b_begin, rows);
        quant_matmul_rows_two_streams(w, xq, together.data(), rows, 0, a_end, b_begin, rows);
        ASSERT_EQ(together, apart) << isa_name(isa) << ' ' << dtype_name(dtype);
      }
    }
  }
  set_stream_tuning(saved);
}

// Batches large enough for the kernels that unpack a group of rows once for all tokens (the
// interleaved Q4_K kernel takes 16 rows and kQ4KBatchFromTokens tokens or more; fewer take the
// decode kernel in passes of up to 3 tokens): every row of every token equals,
// bit for bit, the same row computed for that token alone, and the sum over the dequantized
// weights within a few ulps of its magnitude. Rows not a multiple of the group, extreme
// activations (±127 after quantization) and both thread counts.
TEST(QuantMatmul, BatchKernelsGiveTheSingleTokenBits) {
  const int64_t rows = 53, cols = 768;
  for (Isa isa : supported_isas()) {
    ModeGuard guard(isa, QuantMath::kFast);
    for (DType dtype : {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K, DType::kQ8_0}) {
      const std::vector<uint8_t> bytes = random_quantized_rows(dtype, rows, cols, 31);
      const MatrixView w{bytes.data(), dtype, rows, cols};
      for (int64_t n : {5, 8, 13, 40}) {
        std::vector<float> x = gaussian_input(n, cols, 37);
        for (int64_t k = 0; k < 256; ++k) x[static_cast<size_t>(k)] = k % 3 == 0 ? 90.0f : -90.0f;
        for (int threads : {1, 2}) {
          ThreadPool pool(threads), one(1);
          const std::vector<float> batched = run(pool, w, x, n);
          QuantizedActivations xq;
          quantize_activations(x.data(), n, cols, cols, activation_block(dtype), xq);
          std::vector<float> weights(static_cast<size_t>(cols));
          for (int64_t t = 0; t < n; ++t) {
            const std::vector<float> single(x.begin() + t * cols, x.begin() + (t + 1) * cols);
            const std::vector<float> alone = run(one, w, single, 1);
            for (int64_t r = 0; r < rows; ++r) {
              ASSERT_EQ(batched[static_cast<size_t>(t * rows + r)], alone[static_cast<size_t>(r)])
                  << isa_name(isa) << ' ' << dtype_name(dtype) << " n=" << n << " t=" << t
                  << " r=" << r << " threads=" << threads;
              dequantize_row(quant_type(dtype), w.row(r), cols, weights.data());
              double expected = 0.0, magnitude = 0.0;
              for (int64_t k = 0; k < cols; ++k) {
                const double term = xq.value(t, k) * weights[static_cast<size_t>(k)];
                expected += term;
                magnitude += std::abs(term);
              }
              ASSERT_NEAR(alone[static_cast<size_t>(r)], expected, 2e-6 * magnitude + 1e-9)
                  << isa_name(isa) << ' ' << dtype_name(dtype) << " t=" << t << " r=" << r;
            }
          }
        }
      }
    }
  }
}

// What `moeline run` and /healthz report: the path in use (and the CPU's best), the CPU, the
// arithmetic, and the tuning of the kernels that path runs.
TEST(KernelReport, NamesThePathTheCpuTheArithmeticAndTheTuning) {
  for (Isa isa : supported_isas()) {
    ModeGuard guard(isa, QuantMath::kFast);
    const KernelReport report = kernel_report();
    EXPECT_EQ(report.isa, isa_name(isa));
    EXPECT_EQ(report.best_isa, isa_name(best_supported_isa()));
    EXPECT_FALSE(report.cpu.empty());
    EXPECT_EQ(report.quant_math, "fast");
    auto tuning = [&](const std::string& name) -> int64_t {
      for (const auto& [key, value] : report.tuning)
        if (key == name) return value;
      return -1;
    };
    EXPECT_EQ(tuning("wide_prefetch_bytes"), stream_tuning().prefetch_bytes);
    EXPECT_EQ(tuning("decode_streams"), stream_tuning().decode_streams);
    EXPECT_EQ(tuning("quant_prefetch_bytes"),
              isa == Isa::kPortable ? -1 : stream_tuning().quant_prefetch_bytes);
    const bool avx512 = isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni;
    EXPECT_EQ(tuning("q4_k_batch_from_tokens"), avx512 ? detail::kQ4KBatchFromTokens : -1);
    EXPECT_EQ(tuning("kv_prefetch_bytes"), detail::kKvPrefetchBytes);  // attention, every path
    EXPECT_EQ(tuning("packed_k_block"), isa == Isa::kAvx2 ? detail::kAvx2PackedKBlock : -1);
    const auto fields = report_fields(report);
    ASSERT_GE(fields.size(), 4u);
    EXPECT_EQ(fields[0], std::make_pair(std::string("isa"), report.isa));
  }
  ModeGuard exact(best_supported_isa(), QuantMath::kExact);
  EXPECT_EQ(kernel_report().quant_math, "exact");
  // What MOELINE_KERNELS asked for and did not get is explained (the path in use is named).
  KernelReport report = kernel_report();
  report.forced = report.isa;
  EXPECT_EQ(forced_path_problem(report), "");
  report.forced = "avx9000";
  EXPECT_NE(forced_path_problem(report).find("names no kernel path"), std::string::npos);
  report.forced = "avx512_vnni";  // on a CPU whose best path is AVX2
  report.isa = report.best_isa = "avx2";
  EXPECT_NE(forced_path_problem(report).find("cannot run (its best is avx2); using avx2"),
            std::string::npos);
}

// One entry per kernel path, so that a path this CPU cannot run shows in the test report as
// skipped (the tests above loop over the paths the CPU has, which would leave it out silently):
// where the CPU has it, the path's F32 and fast quantized matmul agree with the portable path.
class EveryKernelPath : public ::testing::TestWithParam<Isa> {};

TEST_P(EveryKernelPath, RunsHereOrIsReportedSkipped) {
  const Isa isa = GetParam();
  if (best_supported_isa() < isa)
    GTEST_SKIP() << "this CPU cannot run the " << isa_name(isa)
                 << " kernels: they are not tested on this host";
  ThreadPool pool(1);
  const int64_t rows = 9, cols = 512, n = 3;
  const std::vector<float> x = gaussian_input(n, cols, 17);
  const std::vector<float> f32_weights = gaussian_input(rows, cols, 23);
  for (DType dtype : {DType::kF32, DType::kQ8_0, DType::kQ4_K, DType::kQ6_K}) {
    const std::vector<uint8_t> bytes = random_quantized_rows(dtype, rows, cols, 19);
    const MatrixView w{dtype == DType::kF32 ? static_cast<const void*>(f32_weights.data())
                                            : static_cast<const void*>(bytes.data()),
                       dtype, rows, cols};
    std::vector<float> portable, path;
    {
      ModeGuard guard(Isa::kPortable, QuantMath::kFast);
      portable = run(pool, w, x, n);
    }
    {
      ModeGuard guard(isa, QuantMath::kFast);
      path = run(pool, w, x, n);
    }
    for (size_t i = 0; i < portable.size(); ++i)
      ASSERT_NEAR(path[i], portable[i], 1e-4 * (1.0 + std::abs(portable[i])))
          << isa_name(isa) << ' ' << dtype_name(dtype) << " i=" << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, EveryKernelPath,
                         ::testing::Values(Isa::kPortable, Isa::kAvx2, Isa::kAvx512,
                                           Isa::kAvx512Vnni),
                         [](const ::testing::TestParamInfo<Isa>& param) {
                           return std::string(isa_name(param.param));
                         });

// The VNNI build replaces instruction pairs with one exact instruction each: a stack whose
// stages run on AVX-512 hosts with and without VNNI must produce the same bits (exact prefix reuse
// compares them). Extreme activations and weights (±127, all of a block at its maximum) exercise
// the 16-bit pair sums where saturation would show.
TEST(QuantMatmul, VnniGivesTheSameBitsAsAvx512) {
  if (best_supported_isa() < Isa::kAvx512Vnni) GTEST_SKIP() << "the CPU has no AVX512_VNNI";
  ThreadPool pool(1);
  const int64_t rows = 19, cols = 768;
  for (DType dtype : kQuantized) {
    const std::vector<uint8_t> bytes = random_quantized_rows(dtype, rows, cols, 21);
    const MatrixView w{bytes.data(), dtype, rows, cols};
    for (int64_t n : {1, 5, 9}) {
      std::vector<float> x = gaussian_input(n, cols, 13);
      for (int64_t k = 0; k < 64; ++k) x[static_cast<size_t>(k)] = k % 2 == 0 ? 100.0f : -100.0f;
      std::vector<float> plain, vnni;
      {
        ModeGuard guard(Isa::kAvx512, QuantMath::kFast);
        plain = run(pool, w, x, n);
      }
      {
        ModeGuard guard(Isa::kAvx512Vnni, QuantMath::kFast);
        vnni = run(pool, w, x, n);
      }
      for (size_t i = 0; i < plain.size(); ++i)
        ASSERT_EQ(plain[i], vnni[i]) << dtype_name(dtype) << " n=" << n << " i=" << i;
    }
  }
}

}  // namespace
}  // namespace moeline::kernels

namespace moeline::kernels {
namespace {

// moeline quantize's block quantizers, through the dequantization the reader uses: Gaussian
// weights come back within each type's rounding (bounds a little above llama.cpp's measured
// errors for these types: Q8_0 ~0.4%, Q6_K ~1.5%, Q5_K ~3%, Q4_K ~6.5%, Q4_0 ~9% relative RMS).
TEST(Quantize, RoundTripsWithinEachTypesRounding) {
  const std::pair<DType, double> bounds[] = {
      {DType::kQ8_0, 0.006}, {DType::kQ6_K, 0.02}, {DType::kQ5_K, 0.04}, {DType::kQ4_K, 0.08},
      {DType::kQ4_0, 0.11},  {DType::kF16, 5e-4},  {DType::kBF16, 4e-3}};
  const int64_t n = 256 * 16;
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng);
  for (const auto& [dtype, bound] : bounds) {
    std::vector<uint8_t> stored(stored_bytes(dtype, n));
    quantize_row(dtype, x.data(), n, stored.data());
    std::vector<float> back(static_cast<size_t>(n));
    dequantize_row(quant_type(dtype), stored.data(), n, back.data());
    double error = 0, norm = 0;
    for (int64_t i = 0; i < n; ++i) {
      error += (back[i] - x[i]) * (back[i] - x[i]);
      norm += x[i] * x[i];
    }
    EXPECT_LT(std::sqrt(error / norm), bound) << dtype_name(dtype);
    EXPECT_GT(std::sqrt(error / norm), 0.0) << dtype_name(dtype);
  }
}

TEST(Quantize, HalfPrecisionRoundsToNearestEven) {
  // Every F16 value converts back to itself, and midpoints go to the even neighbour.
  for (uint32_t bits = 0; bits < 0x7c00u; bits += 7) {
    const float value = f16_to_float(static_cast<uint16_t>(bits));
    uint16_t out = 0;
    quantize_row(DType::kF16, &value, 1, &out);
    ASSERT_EQ(out, bits);
  }
  const float midpoint = (f16_to_float(0x3c00) + f16_to_float(0x3c01)) / 2;  // 1 + 2^-11
  uint16_t out = 0;
  quantize_row(DType::kF16, &midpoint, 1, &out);
  EXPECT_EQ(out, 0x3c00);
  const float huge = 1e6f;
  quantize_row(DType::kF16, &huge, 1, &out);
  EXPECT_EQ(out, 0x7c00);
}

// A block of zeros (a pruned row) quantizes to zeros, not NaN.
TEST(Quantize, ZeroBlocksStayZero) {
  std::vector<float> zeros(256, 0.0f), back(256, 1.0f);
  for (DType dtype : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    std::vector<uint8_t> stored(stored_bytes(dtype, 256));
    quantize_row(dtype, zeros.data(), 256, stored.data());
    dequantize_row(quant_type(dtype), stored.data(), 256, back.data());
    for (float v : back) ASSERT_EQ(v, 0.0f) << dtype_name(dtype);
  }
}

}  // namespace
}  // namespace moeline::kernels
