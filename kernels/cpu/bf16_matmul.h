#pragma once
// The fast arithmetic for BF16 weights (opt-in; the default multiplies them exactly, matmul.h):
// each activation row is rounded to BF16 (to nearest, ties to even) once per matmul, and the CPU's
// BF16 dot-product instruction (AVX512_BF16 `vdpbf16ps`) adds each lane's two weight × activation
// products into an F32 accumulator, 32 weights per instruction read as stored, with no widening:
//
//   y = Σ_k w_k · bf16(x_k)     (each product exact in F32; the sums rounded to F32)
//
// Its error against the exact path is the rounding of the activations (relative 2^-9 per value;
// docs/PERFORMANCE.md reports it on whole models). Like the exact kernels, a row's result does not
// depend on the batch, the tile or the thread count, so prefill and decode of one sequence agree
// bit for bit within the mode. Every process of a stack must use the same mode: it is part of the
// settings hash peers agree on (stages/common). On CPUs without AVX512_BF16, or with a path below
// AVX-512 forced, the exact kernels run (bf16_fast_in_use() says which, and the kernel report
// shows it).

#include <cstdint>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/scratch_vector.h"

namespace moeline::kernels {

enum class Bf16Math { kExact, kFast };

// Process-wide: what matmul does with BF16 weights (default exact).
void set_bf16_math(Bf16Math math);
Bf16Math bf16_math();
// "exact" / "fast"; false for anything else.
bool parse_bf16_math(const char* text, Bf16Math& math);
// True when the fast mode is set and this CPU and kernel path can run it.
bool bf16_fast_in_use();
// Whether this CPU has the BF16 dot product (AVX512_BF16), whatever the mode.
bool cpu_has_bf16_dot_product();

// Activation rows rounded to BF16, each padded with zeros to a whole number of 32-value chunks.
struct Bf16Activations {
  int64_t rows = 0, cols = 0;
  int64_t padded_cols = 0;
  ScratchVector<uint16_t> values;  // [rows, padded_cols]

  const uint16_t* row(int64_t r) const { return values.data() + r * padded_cols; }
};

// Needs bf16_fast_in_use().
void round_activations_to_bf16(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                               Bf16Activations& out);

// y[t * y_stride + r] for rows [row_begin, row_end) of the BF16 matrix w and every activation
// row t. Needs bf16_fast_in_use().
void bf16_matmul_rows(const MatrixView& w, const Bf16Activations& x, float* y, int64_t y_stride,
                      int64_t row_begin, int64_t row_end);
// Rows [a_begin, a_end) and [b_begin, b_end) read side by side (matmul.h's two decode streams).
void bf16_matmul_rows_two_streams(const MatrixView& w, const Bf16Activations& x, float* y,
                                  int64_t y_stride, int64_t a_begin, int64_t a_end, int64_t b_begin,
                                  int64_t b_end);

namespace detail {
void round_activations_to_bf16_avx512(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                                      Bf16Activations& out);
void bf16_matmul_rows_avx512(const MatrixView& w, const Bf16Activations& x, float* y,
                             int64_t y_stride, int64_t row_begin, int64_t row_end);
void bf16_matmul_rows_two_streams_avx512(const MatrixView& w, const Bf16Activations& x, float* y,
                                         int64_t y_stride, int64_t a_begin, int64_t a_end,
                                         int64_t b_begin, int64_t b_end);
}  // namespace detail

}  // namespace moeline::kernels
