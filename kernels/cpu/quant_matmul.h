#pragma once
// The fast arithmetic for block-quantized weights (as llama.cpp's): each activation row is
// quantized to 8-bit blocks matching the weights' blocks, and each weight block's contribution
// is an integer dot product scaled once:
//
//   Q8_0, Q4_0   activations in blocks of 32 (scale d = max|x| / 127):
//                y += d_w d_x Σ q_w q_x                          (Q4_0: q_w = nibble - 8)
//   Q4_K, Q5_K   activations in blocks of 256 with the sum of every 16:
//                y += d_x (d Σ_j sc_j Σ_{i∈j} q_i x_i - dmin Σ_j m_j Σ_{i∈j} x_i)   (j: 32 weights)
//   Q6_K         y += d_x d Σ_s sc_s (Σ_{i∈s} q_i x_i - 32 Σ_{i∈s} x_i)            (s: 16 weights)
//
// The exact mode (matmul.h) dequantizes the weights to F32 instead and keeps activations in F32.
// Like the F32 kernels, a row's result does not depend on the batch, the tile or the thread count.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/scratch_vector.h"

namespace moeline::kernels {

enum class QuantMath { kExact, kFast };

// Process-wide: what matmul does with quantized weights (default fast).
void set_quant_math(QuantMath math);
QuantMath quant_math();
// "exact" / "fast"; false for anything else.
bool parse_quant_math(const char* text, QuantMath& math);

// Activation rows quantized to 8-bit blocks of `block` (32 or 256) values.
struct QuantizedActivations {
  int64_t rows = 0, cols = 0;
  int64_t block = 32;
  ScratchVector<int8_t> q;      // [rows, cols]
  ScratchVector<float> scale;   // [rows, cols / block]
  ScratchVector<int32_t> sums;  // [rows, cols / 16]: Σ q of every 16 values
  // Block 256 only: q again, with the 32-value quarters 1 and 2 of every 128 values swapped. That
  // is the order in which a Q4_K super-block's nibbles come out of 64-byte loads split into low
  // and high halves, so the Q4_K decode kernel multiplies them without reordering its weights.
  ScratchVector<int8_t> q_nibble_order;  // [rows, cols]
  // Block 256 only: the sums of the 32-value sub-blocks 2p and 2p + 1 as the two 16-bit halves of
  // one int32 (|a sum of 32| ≤ 32 · 127 fits), so that one madd multiplies them by a Q4_K row's
  // two mins. Made here, once per matmul, not by every kernel call (decode calls a kernel per
  // claim of rows).
  ScratchVector<int32_t> min_pairs;  // [rows, cols / 64]

  const int8_t* row(int64_t r) const { return q.data() + r * cols; }
  const float* row_scales(int64_t r) const { return scale.data() + r * (cols / block); }
  const int32_t* row_sums(int64_t r) const { return sums.data() + r * (cols / 16); }
  const int8_t* row_in_nibble_order(int64_t r) const { return q_nibble_order.data() + r * cols; }
  // The value activation (r, k) stands for: scale * q.
  float value(int64_t r, int64_t k) const { return row_scales(r)[k / block] * row(r)[k]; }
};

// The activation block a weight type pairs with: 32 for Q8_0 and Q4_0, 256 for the K-quants.
int64_t activation_block(DType weights);

void quantize_activations(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                          int64_t block, QuantizedActivations& out);

// y[t * y_stride + r] for rows [row_begin, row_end) of w and every activation row t; `x` in
// the block size activation_block(w.dtype).
void quant_matmul_rows(const MatrixView& w, const QuantizedActivations& x, float* y,
                       int64_t y_stride, int64_t row_begin, int64_t row_end);

// Rows [a_begin, a_end) and [b_begin, b_end) together, row a_begin + i beside b_begin + i: two
// memory streams for decode (StreamTuning::decode_streams), where quant_two_streams(w.dtype);
// otherwise the two ranges one after the other. The same results as quant_matmul_rows on each.
void quant_matmul_rows_two_streams(const MatrixView& w, const QuantizedActivations& x, float* y,
                                   int64_t y_stride, int64_t a_begin, int64_t a_end,
                                   int64_t b_begin, int64_t b_end);
// Whether the active path reads weights of this type in two streams (Q8_0, Q4_0 and Q6_K on
// AVX-512).
bool quant_two_streams(DType weights);

namespace detail {
// Calls body(std::integral_constant<int, n>) for n = min(remaining, kMax): a tile's token count
// as a constant, so that its accumulators stay in registers (with a run-time count the compiler
// keeps them in memory, a store and reload on every block's chain).
template <int kMax, class Body>
void with_token_count(int64_t remaining, Body&& body) {
  const int64_t count = remaining < kMax ? remaining : kMax;
  [&]<int... N>(std::integer_sequence<int, N...>) {
    ((count == N + 1 ? (body(std::integral_constant<int, N + 1>{}), true) : false) || ...);
  }
  (std::make_integer_sequence<int, kMax>{});
}

// The activation rows of one tile of tokens, addressed once per tile: x.row_scales divides by
// the block size, and inside a kernel's block loop that division was its longest dependency chain.
template <int kTokens>
struct TokenTile {
  static constexpr int kCount = kTokens;
  int64_t first = 0;  // the tile's first token
  const int8_t* q0 = nullptr;
  const float* scales0 = nullptr;
  const int32_t* sums0 = nullptr;
  int64_t cols = 0, scale_stride = 0, sum_stride = 0;

  const int8_t* q(int t) const { return q0 + t * cols; }
  const float* scales(int t) const { return scales0 + t * scale_stride; }
  const int32_t* sums(int t) const { return sums0 + t * sum_stride; }
};

// Calls body(const TokenTile<n>&) for the tiles of at most kMax tokens covering x's rows, n a
// compile-time constant (see with_token_count).
template <int kMax, class Body>
void for_each_token_tile(const QuantizedActivations& x, Body&& body) {
  const int64_t scale_stride = x.cols / x.block, sum_stride = x.cols / 16;
  for (int64_t t0 = 0; t0 < x.rows; t0 += kMax) {
    with_token_count<kMax>(x.rows - t0, [&](auto count) {
      const TokenTile<decltype(count)::value> tile{t0,
                                                   x.q.data() + t0 * x.cols,
                                                   x.scale.data() + t0 * scale_stride,
                                                   x.sums.data() + t0 * sum_stride,
                                                   x.cols,
                                                   scale_stride,
                                                   sum_stride};
      body(tile);
    });
  }
}

// Calls body(tile, first, last) for runs of at most 16 rows of [row_begin, row_end) and, within
// each run, every tile of tokens (for_each_token_tile): a kernel's row loop then sits inside one
// tile, so a decode step's rows pay no per-row tile setup, and a run's rows stay in cache for the
// next tile of a batch.
template <int kMax, class Body>
void for_each_row_run(const QuantizedActivations& x, int64_t row_begin, int64_t row_end,
                      Body&& body) {
  constexpr int64_t kRowRun = 16;
  for (int64_t first = row_begin; first < row_end; first += kRowRun) {
    const int64_t last = first + kRowRun < row_end ? first + kRowRun : row_end;
    for_each_token_tile<kMax>(x, [&](const auto& tile) { body(tile, first, last); });
  }
}

// From this many tokens on, the AVX-512 paths take Q4_K rows sixteen at a time, unpacked once for
// every token of the batch (fewer: the decode kernel, which gathers the 16 rows' heads, is faster;
// moeline_quant_kernel_bench on an AMD EPYC, CPUID family 26: 4-6 tokens 61-76 GB/s-tokens in
// cache against the unpacking kernel's 49-65, 7 tokens 66 against 72).
constexpr int64_t kQ4KBatchFromTokens = 7;

// How far ahead along a row the SIMD paths prefetch weights (StreamTuning::quant_prefetch_bytes,
// matmul.h; 0: none), read once per call: decode reads each weight once, and the hardware
// prefetchers stop at page boundaries on some hosts.
int64_t quant_prefetch_bytes();

// The cache lines that start in [p, p + bytes) (prefetching never faults, so p may lie past the
// end of the weights).
inline void prefetch_lines(const uint8_t* p, int64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = (begin + 63) & ~uintptr_t{63}; line < begin + static_cast<uintptr_t>(bytes);
       line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
}

// The cache lines that start in [p, p + bytes), `ahead` bytes ahead (none when 0): consecutive
// blocks then prefetch every line of a row exactly once (blocks are not line multiples: a Q8_0
// pair is 68 bytes, a Q4_K super-block 144, so one prefetch per block would skip lines).
inline void prefetch_ahead(const uint8_t* p, int64_t bytes, int64_t ahead) {
  if (ahead > 0) prefetch_lines(p + ahead, bytes);
}

// One activation row quantized as quantize_activations does (ops_avx512.cpp, ops_avx2.cpp): the
// same bytes, scales and sums, 16 or 8 values at a time.
void quantize_activation_row_avx512(const float* src, int64_t cols, int64_t block, int8_t* q,
                                    float* scales, int32_t* sums);
void quantize_activation_row_avx2(const float* src, int64_t cols, int64_t block, int8_t* q,
                                  float* scales, int32_t* sums);

void quant_matmul_rows_portable(const MatrixView& w, const QuantizedActivations& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end);
void quant_matmul_rows_avx2(const MatrixView& w, const QuantizedActivations& x, float* y,
                            int64_t y_stride, int64_t row_begin, int64_t row_end);
void quant_matmul_rows_avx512(const MatrixView& w, const QuantizedActivations& x, float* y,
                              int64_t y_stride, int64_t row_begin, int64_t row_end);
// The same kernels compiled with AVX512_VNNI (quant_matmul_avx512_vnni.cpp): identical results.
void quant_matmul_rows_avx512_vnni(const MatrixView& w, const QuantizedActivations& x, float* y,
                                   int64_t y_stride, int64_t row_begin, int64_t row_end);
void quant_matmul_rows_two_streams_avx512(const MatrixView& w, const QuantizedActivations& x,
                                          float* y, int64_t y_stride, int64_t a_begin,
                                          int64_t a_end, int64_t b_begin, int64_t b_end);
void quant_matmul_rows_two_streams_avx512_vnni(const MatrixView& w, const QuantizedActivations& x,
                                               float* y, int64_t y_stride, int64_t a_begin,
                                               int64_t a_end, int64_t b_begin, int64_t b_end);

// A K-quant super-block's eight 6-bit scales then eight mins, from its 12 packed bytes (quant.h):
// scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; scales and mins 4-7 take
// their low nibbles from bytes 8-11 and their top two bits from the top of bytes 0-3 and 4-7.
inline void k_scales(const uint8_t* packed, uint8_t out[16]) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  const uint32_t words[4] = {w[0] & k6, (w[2] & k4) | (((w[0] >> 6) & k2) << 4), w[1] & k6,
                             ((w[2] >> 4) & k4) | (((w[1] >> 6) & k2) << 4)};
  std::memcpy(out, words, 16);
}
}  // namespace detail

}  // namespace moeline::kernels
