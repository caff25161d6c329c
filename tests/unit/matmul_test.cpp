// Matmul paths against a double-precision reference, and the determinism contract: a row's result
// is bit-identical whatever the batch size, tile position, thread count.
#include "kernels/cpu/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "kernel_test_inputs.h"
#include "kernels/cpu/cpu_features.h"

namespace moeline::kernels {
namespace {

struct Weights {
  std::vector<float> f32;
  std::vector<uint16_t> raw;  // BF16/F16 bits
  DType dtype;
  int64_t rows, cols;
  MatrixView view() const {
    return {dtype == DType::kF32 ? static_cast<const void*>(f32.data()) : raw.data(), dtype, rows,
            cols};
  }
};

uint16_t float_to_f16(float value) {
  // Only for test data in the normal range: round to nearest even via the 11-bit mantissa.
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = bits & 0x7fffffu;
  if (exponent <= 0) return static_cast<uint16_t>(sign);
  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

Weights make_weights(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
  Weights w{{}, {}, dtype, rows, cols};
  w.f32.resize(static_cast<size_t>(rows * cols));
  w.raw.resize(w.f32.size());
  for (size_t i = 0; i < w.f32.size(); ++i) {
    float value = normal(rng);
    if (dtype == DType::kBF16) {
      w.raw[i] = float_to_bf16(value);
      value = bf16_to_float(w.raw[i]);
    } else if (dtype == DType::kF16) {
      w.raw[i] = float_to_f16(value);
      value = f16_to_float(w.raw[i]);
    }
    w.f32[i] = value;  // exactly the stored weight, for the reference
  }
  return w;
}

using test::gaussian_input;
using test::supported_isas;

class IsaGuard {
 public:
  explicit IsaGuard(Isa isa) : saved_(active_isa()) { EXPECT_TRUE(set_active_isa(isa)); }
  ~IsaGuard() { set_active_isa(saved_); }

 private:
  Isa saved_;
};

TEST(Matmul, MatchesDoubleReferenceOnEveryPathAndDtype) {
  ThreadPool pool(2);
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      // Shapes with ragged rows (not a multiple of any tile) and ragged K (not a lane multiple),
      // and one with rows long enough to be multiplied in k blocks.
      for (auto [rows, cols, n] :
           {std::tuple{7, 37, 1}, {33, 64, 5}, {19, 100, 13}, {64, 259, 40}, {5, 2085, 9}}) {
        const Weights w = make_weights(dtype, rows, cols, 7);
        const std::vector<float> x = gaussian_input(n, cols, 9);
        std::vector<float> y(static_cast<size_t>(n * rows));
        matmul(pool, MatmulTask{.x = x.data(), .n = n, .w = w.view(), .y = y.data()});
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t r = 0; r < rows; ++r) {
            double expected = 0.0, magnitude = 0.0;
            for (int64_t k = 0; k < cols; ++k) {
              const double term = static_cast<double>(x[t * cols + k]) * w.f32[r * cols + k];
              expected += term;
              magnitude += std::abs(term);
            }
            // F32 accumulation of `cols` terms: error bounded by ~cols * 2^-24 * sum|terms|.
            const double tolerance = static_cast<double>(cols) * 6e-8 * magnitude + 1e-7;
            ASSERT_NEAR(y[t * rows + r], expected, tolerance)
                << isa_name(isa) << ' ' << dtype_name(dtype) << " rows=" << rows << " cols=" << cols
                << " n=" << n << " t=" << t << " r=" << r;
          }
        }
      }
    }
  }
}

TEST(Matmul, RowResultDoesNotDependOnBatchOrThreads) {
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    // n large enough to take the packed route; 2085 columns: packed rows multiplied in k blocks
    // (two of 1024 and a ragged tail on AVX2) and 70 tokens: two token blocks. Decode's batches
    // (2-6 tokens) stream their rows unpacked, in chunks of tokens per tile call.
    for (auto [dtype, rows, cols, n] :
         std::vector<std::tuple<DType, int64_t, int64_t, int64_t>>{{DType::kF32, 45, 131, 29},
                                                                   {DType::kBF16, 45, 131, 29},
                                                                   {DType::kBF16, 9, 2085, 70},
                                                                   {DType::kF16, 6, 1040, 7},
                                                                   {DType::kBF16, 45, 131, 2},
                                                                   {DType::kBF16, 77, 259, 5},
                                                                   {DType::kF16, 33, 64, 6},
                                                                   {DType::kF32, 19, 100, 3}}) {
      const Weights w = make_weights(dtype, rows, cols, 3);
      const std::vector<float> x = gaussian_input(n, cols, 4);
      ThreadPool two(2), one(1);
      std::vector<float> batched(static_cast<size_t>(n * rows));
      matmul(two, MatmulTask{.x = x.data(), .n = n, .w = w.view(), .y = batched.data()});
      for (int64_t t = 0; t < n; ++t) {
        std::vector<float> alone(static_cast<size_t>(rows));
        matmul(one, MatmulTask{.x = x.data() + t * cols, .n = 1, .w = w.view(), .y = alone.data()});
        for (int64_t r = 0; r < rows; ++r)
          ASSERT_EQ(batched[t * rows + r], alone[r])
              << isa_name(isa) << ' ' << dtype_name(dtype) << " cols=" << cols << " t=" << t
              << " r=" << r;
      }
    }
  }
}

// How decode streams its weights (one stream per thread or two, software prefetch or none: chosen
// per host) never changes a bit of the results.
TEST(Matmul, StreamTuningDoesNotChangeResults) {
  const StreamTuning saved = stream_tuning();
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (auto [rows, cols, n, threads] :
           {std::tuple{45, 131, 1, 1}, {200, 64, 1, 2}, {77, 259, 3, 2}, {300, 48, 6, 1}}) {
        const Weights w = make_weights(dtype, rows, cols, 11);
        const std::vector<float> x = gaussian_input(n, cols, 12);
        ThreadPool pool(threads);
        std::vector<float> reference;
        for (const StreamTuning tuning : {StreamTuning{.decode_streams = 1, .prefetch_bytes = 1024},
                                          StreamTuning{.decode_streams = 2, .prefetch_bytes = 0},
                                          StreamTuning{.decode_streams = 2, .prefetch_bytes = 512},
                                          StreamTuning{.decode_streams = 1, .prefetch_bytes = 0}}) {
          set_stream_tuning(tuning);
          std::vector<float> y(static_cast<size_t>(n * rows));
          matmul(pool, MatmulTask{.x = x.data(), .n = n, .w = w.view(), .y = y.data()});
          if (reference.empty())
            reference = y;
          else
            ASSERT_EQ(y, reference)
                << isa_name(isa) << ' ' << dtype_name(dtype) << " rows=" << rows << " n=" << n
                << " streams=" << tuning.decode_streams << " prefetch=" << tuning.prefetch_bytes;
        }
      }
    }
  }
  set_stream_tuning(saved);
}

TEST(Matmul, StreamTuningParsesItsTextAndRefusesAnythingElse) {
  StreamTuning tuning{.decode_streams = 1, .prefetch_bytes = 1024};
  EXPECT_TRUE(parse_stream_tuning("decode_streams=2,prefetch_bytes=0", tuning));
  EXPECT_EQ(tuning.decode_streams, 2);
  EXPECT_EQ(tuning.prefetch_bytes, 0);
  EXPECT_TRUE(parse_stream_tuning("prefetch_bytes=2048", tuning));
  EXPECT_EQ(tuning.decode_streams, 2);
  EXPECT_EQ(tuning.prefetch_bytes, 2048);
  EXPECT_TRUE(parse_stream_tuning("quant_prefetch_bytes=0", tuning));
  EXPECT_EQ(tuning.quant_prefetch_bytes, 0);
  EXPECT_EQ(tuning.prefetch_bytes, 2048);
  for (const char* bad :
       {"decode_streams=3", "prefetch_bytes=-1", "prefetch_bytes=1e3", "streams=2",
        "decode_streams", "decode_streams=2,", "prefetch_bytes=65537", "quant_prefetch_bytes=65537",
        "quant_prefetch=512"})
    EXPECT_FALSE(parse_stream_tuning(bad, tuning)) << bad;
  EXPECT_EQ(tuning.decode_streams, 2);  // a refused text changes nothing
  EXPECT_EQ(tuning.prefetch_bytes, 2048);
  EXPECT_EQ(tuning.quant_prefetch_bytes, 0);
}

TEST(Matmul, StridedInputAndOutput) {
  ThreadPool pool(2);
  const Weights w = make_weights(DType::kBF16, 10, 32, 5);
  const std::vector<float> x = gaussian_input(3, 48, 6);  // rows 48 apart, only 32 used
  std::vector<float> y(3 * 16, -1.0f);                    // rows 16 apart, only 10 written
  matmul(pool,
         MatmulTask{
             .x = x.data(), .n = 3, .w = w.view(), .y = y.data(), .x_stride = 48, .y_stride = 16});
  for (int64_t t = 0; t < 3; ++t) {
    for (int64_t r = 0; r < 16; ++r) {
      if (r >= 10) {
        EXPECT_EQ(y[t * 16 + r], -1.0f);
        continue;
      }
      double expected = 0.0;
      for (int64_t k = 0; k < 32; ++k)
        expected += static_cast<double>(x[t * 48 + k]) * w.f32[r * 32 + k];
      EXPECT_NEAR(y[t * 16 + r], expected, 1e-5);
    }
  }
}

// FP8 weights with block scales, on every path: widen_row decodes every code as the format
// defines it (checked against a decoder written here from the definition), and matmul over a
// row_range sub-view (the experts' and MLA's views) uses the scales of the rows it covers. Block
// shapes that leave partial blocks, and columns blocks that are not lane multiples, take each
// path's vector and scalar routes.
double e4m3_definition(uint8_t byte) {
  const int exponent = (byte >> 3) & 0xf, mantissa = byte & 7;
  if ((byte & 0x7f) == 0x7f) return NAN;
  const double magnitude = exponent == 0 ? mantissa / 8.0 * std::ldexp(1.0, -6)
                                         : (1.0 + mantissa / 8.0) * std::ldexp(1.0, exponent - 7);
  return byte & 0x80 ? -magnitude : magnitude;
}

TEST(Matmul, Fp8BlockScaledWeights) {
  ThreadPool pool(2);
  for (uint32_t code = 0; code < 256; ++code) {
    const double want = e4m3_definition(static_cast<uint8_t>(code));
    const float got = e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << code;
    } else {
      EXPECT_EQ(got, want) << code;
    }
  }
  std::mt19937 rng(11);
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (auto [rows, cols, block_rows, block_cols, n] :
         {std::tuple{40, 96, 16, 24, 1}, {37, 131, 8, 40, 3}, {64, 256, 128, 128, 20}}) {
      std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
      for (uint8_t& b : q) {
        b = static_cast<uint8_t>(rng());
        if ((b & 0x7f) == 0x7f) b ^= 1;  // NaN codes are checked above, not multiplied here
      }
      const int64_t row_blocks = (rows + block_rows - 1) / block_rows;
      const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
      std::vector<float> scales(static_cast<size_t>(row_blocks * col_blocks));
      for (float& s : scales) s = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000, -12);
      MatrixView w{q.data(), DType::kF8E4M3, rows, cols};
      w.block_scales = scales.data();
      w.scale_block_rows = static_cast<int32_t>(block_rows);
      w.scale_block_cols = static_cast<int32_t>(block_cols);
      // Rows [first, rows) as their own view: their scales come from their place in the tensor.
      const int64_t first = rows / 3, count = rows - first;
      const MatrixView part = w.row_range(first, count);
      const std::vector<float> x = gaussian_input(n, cols, 12);
      std::vector<float> y(static_cast<size_t>(n * count));
      matmul(pool, MatmulTask{.x = x.data(), .n = n, .w = part, .y = y.data()});
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < count; ++r) {
        widen_row(part, r, row.data());
        const int64_t tensor_row = first + r;
        for (int64_t c = 0; c < cols; ++c) {
          const double want =
              e4m3_definition(q[static_cast<size_t>(tensor_row * cols + c)]) *
              scales[static_cast<size_t>(tensor_row / block_rows * col_blocks + c / block_cols)];
          ASSERT_EQ(row[static_cast<size_t>(c)], static_cast<float>(want))
              << isa_name(isa) << " r=" << tensor_row << " c=" << c;
        }
        for (int64_t t = 0; t < n; ++t) {
          double expected = 0.0, magnitude = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            const double term = static_cast<double>(x[t * cols + c]) * row[static_cast<size_t>(c)];
            expected += term;
            magnitude += std::abs(term);
          }
          ASSERT_NEAR(y[t * count + r], expected,
                      static_cast<double>(cols) * 6e-8 * magnitude + 1e-9)
              << isa_name(isa) << " rows=" << rows << " cols=" << cols << " t=" << t << " r=" << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace moeline::kernels
