#pragma once
// The fast arithmetic for block-quantized weights: each activation row is quantized to 8-bit
// groups of 32 (a float scale d = max|x| / 127 and the integers' sum per group), and every
// 32-weight group of a weight row is unpacked to 8-bit integers with its scale(s) and min, so a
// group's contribution is one integer dot product:
//
//   y += d_x * (s_lo * Σ_{i<16} w_i x_i + s_hi * Σ_{i>=16} w_i x_i - m * Σ x_i)
//
// where w = s * integer - m is the weight's dequantized value (s_lo and s_hi differ only for
// Q6_K's 16-weight sub-blocks; m is the K-quants' min, 0 for the symmetric types). The exact mode
// (matmul.h) dequantizes the weights to F32 instead and keeps activations in F32.
//
// Like the F32 kernels, a row's result does not depend on the batch, the tile or the thread count.

#include <cstdint>
#include <vector>

#include "kernels/cpu/dtype.h"

namespace moeline::kernels {

enum class QuantMath { kExact, kFast };

// Process-wide: what matmul does with quantized weights (default fast).
void set_quant_math(QuantMath math);
QuantMath quant_math();
// "exact" / "fast"; false for anything else.
bool parse_quant_math(const char* text, QuantMath& math);

constexpr int64_t kActivationGroup = 32;

// Activation rows quantized to groups of 32.
struct QuantizedActivations {
  int64_t rows = 0, cols = 0;  // cols: a multiple of 32
  std::vector<int8_t> q;       // [rows, cols]
  std::vector<float> scale;    // [rows, cols / 32]
  std::vector<int32_t> sum;    // [rows, cols / 32]: Σ q of the group

  const int8_t* row(int64_t r) const { return q.data() + r * cols; }
};

void quantize_activations(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                          QuantizedActivations& out);

// One 32-weight group of a quantized row as integers: weight i = (i < 16 ? lo : hi) * q[i] - min.
struct WeightGroup {
  alignas(32) int8_t q[32];
  float lo, hi, min;
};
// Group g (0-based, 32 weights each) of a row stored as `dtype`.
void unpack_group(DType dtype, const void* row, int64_t g, WeightGroup& out);

// y[t * y_stride + r] for rows [row_begin, row_end) of w and every activation row t.
void quant_matmul_rows(const MatrixView& w, const QuantizedActivations& x, float* y,
                       int64_t y_stride, int64_t row_begin, int64_t row_end);

namespace detail {
void quant_matmul_rows_portable(const MatrixView& w, const QuantizedActivations& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end);
void quant_matmul_rows_avx2(const MatrixView& w, const QuantizedActivations& x, float* y,
                            int64_t y_stride, int64_t row_begin, int64_t row_end);
}  // namespace detail

}  // namespace moeline::kernels
