// AVX-512 path of the fast quantized matmul (quant_matmul.h): the AVX2 path's arithmetic on
// 64 weights per instruction. Two sub-blocks (or two Q8_0/Q4_0 blocks) share a register: maddubs
// gives 32 16-bit pair sums, a madd with the two sub-blocks' scales spread over their halves
// gives 16 32-bit sums, and a super-block is converted and scaled once.
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/k_scales_vector.h"
#include "kernels/cpu/q8_blocks_vector.h"
#include "kernels/cpu/quant_matmul.h"

// quant_matmul_avx512_vnni.cpp compiles this file again with AVX512_VNNI under another name.
#ifndef MOELINE_QUANT_AVX512_ENTRY
#define MOELINE_QUANT_AVX512_ENTRY quant_matmul_rows_avx512
#define MOELINE_QUANT_AVX512_TWO_STREAMS_ENTRY quant_matmul_rows_two_streams_avx512
#endif

namespace moeline::kernels::detail {
namespace {

// Tokens per unpacked weight tile: 32 registers hold 8 accumulators beside a super-block's
// unpacked weights and scales.
constexpr int kTokenTile = 8;

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
inline __m512i load512(const void* p) {
  return _mm512_loadu_si512(p);
}
inline __m512i join(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// Σ w x in 32-bit lanes for signed weight bytes: |w| times x negated where w < 0.
inline __m512i dot_signed(__m512i w, __m512i x) {
  const __mmask64 negative = _mm512_movepi8_mask(w);
  const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), signed_x);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x),
                           _mm512_set1_epi16(1));
#endif
}

// sum + Σ scale * (pair of 16-bit lanes): one instruction with VNNI. Both forms wrap the same
// way (vpdpwssd does not saturate), so the two builds give identical results.
inline __m512i add_scaled_pairs(__m512i sum, __m512i pairs, __m512i scales) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(sum, pairs, scales);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, scales));
#endif
}

// 16-bit scales spread over lanes: lane i takes value[index[i]] (values in a 128-bit register).
inline __m512i spread(__m128i values, __m512i index) {
  return _mm512_permutexvar_epi16(index, _mm512_castsi128_si512(values));
}

// Σ_i scale(i) w_i x_i over 256 weights (four registers of unsigned weight bytes) added to the
// 32-bit lanes of `sum`, the scales spread by `kRegisters` registers whose spread indices
// indices() makes from `scale_of(r, lane)`: the scale (an index into the 8 values spread) of
// 32-bit lane `lane` of weight register r, where that lane holds four consecutive weights.
//
// PairDot: maddubs gives 16-bit pair sums, and a madd (or vpdpwssd) with the scales spread over
// both halves of each 32-bit lane adds them up.
struct PairDot {
  static constexpr int kRegisters = 4;
  template <class ScaleOf>
  static void indices(ScaleOf scale_of, __m512i index[kRegisters]) {
    for (int r = 0; r < kRegisters; ++r) {
      alignas(64) int16_t lanes[32];
      for (int l = 0; l < 32; ++l) lanes[l] = static_cast<int16_t>(scale_of(r, l / 2));
      index[r] = _mm512_load_si512(lanes);
    }
  }
  static __m512i add(__m512i sum, const __m512i w[4], const int8_t* x,
                     const __m512i scales[kRegisters]) {
    for (int g = 0; g < 4; ++g)
      sum = add_scaled_pairs(sum, _mm512_maddubs_epi16(w[g], load512(x + 64 * g)), scales[g]);
    return sum;
  }
};

#ifdef __AVX512VNNI__
// InterleavedDot (VNNI): vpdpbusd sums four products per 32-bit lane, and each such sum fits 16
// bits (weights ≤ 63, |x| ≤ 127), so two registers' sums interleave as the 16-bit halves of one
// register and one vpdpwssd scales both: three multiply-class instructions per 128 weights where
// PairDot takes four. Lane i then holds exactly the integer sum PairDot's lane i holds (the same
// weights, the same scales), so the two give the same bits after the conversion to float.
struct InterleavedDot {
  static constexpr int kRegisters = 2;
  // 16-bit lane l of the interleaved sums: 32-bit lane l / 2 of weight register 2p + l % 2.
  template <class ScaleOf>
  static void indices(ScaleOf scale_of, __m512i index[kRegisters]) {
    for (int p = 0; p < kRegisters; ++p) {
      alignas(64) int16_t lanes[32];
      for (int l = 0; l < 32; ++l) lanes[l] = static_cast<int16_t>(scale_of(2 * p + l % 2, l / 2));
      index[p] = _mm512_load_si512(lanes);
    }
  }
  static __m512i add(__m512i sum, const __m512i w[4], const int8_t* x,
                     const __m512i scales[kRegisters]) {
    alignas(64) static constexpr int16_t kInterleave[32] = {
        0,  32, 2,  34, 4,  36, 6,  38, 8,  40, 10, 42, 12, 44, 14, 46,
        16, 48, 18, 50, 20, 52, 22, 54, 24, 56, 26, 58, 28, 60, 30, 62};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    for (int p = 0; p < 2; ++p) {
      const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2 * p], load512(x + 128 * p));
      const __m512i b =
          _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2 * p + 1], load512(x + 128 * p + 64));
      sum = _mm512_dpwssd_epi32(sum, _mm512_permutex2var_epi16(a, interleave, b), scales[p]);
    }
    return sum;
  }
};
// Measured per type (moeline_quant_kernel_bench, Zen 4): Q4_K and Q6_K gain (decode +15% and
// +6%), Q5_K's prefill tiles lose 10% (its fifth-bit unpacking beside the interleave's
// registers), so Q5_K keeps the pairs.
using Q4KDot = InterleavedDot;
using Q5KDot = PairDot;
using Q6KDot = InterleavedDot;
#else
using Q4KDot = PairDot;
using Q5KDot = PairDot;
using Q6KDot = PairDot;
#endif

// Row kernels for one or two memory streams. A Row holds one weight row's accumulators for a tile
// of tokens: Row(context, row) starts it, step(context, tile, s) adds step s of the row (s <
// context.steps), finish(context, tile, y, y_stride, r) adds what the steps left and writes y.
// rows_in_one_stream drives rows one after the other; rows_in_two_streams two rows from distant
// parts of the matrix side by side (StreamTuning::decode_streams: on an AMD core one dot-product
// stream read 38-42 GB/s from memory, two 49-53, a one-token Q8_0 kernel alone over 24 matrices
// of 2816 x 1024; rows next to each other read in step are no second stream, the hardware
// prefetchers then fall to 14 GB/s). A row's operations are the same in either, and so its bits.
template <class Row, class Context, class Tile>
__attribute__((always_inline)) inline void rows_in_one_stream(const MatrixView& w,
                                                              const Context& context,
                                                              const Tile& tile, float* y,
                                                              int64_t y_stride, int64_t row_begin,
                                                              int64_t row_end) {
  const int64_t steps = context.steps;
  for (int64_t r = row_begin; r < row_end; ++r) {
    Row row(context, reinterpret_cast<const uint8_t*>(w.row(r)));
    for (int64_t s = 0; s < steps; ++s) row.step(context, tile, s);
    row.finish(context, tile, y, y_stride, r);
  }
}

template <class Row, class Context, class Tile>
__attribute__((always_inline)) inline void rows_in_two_streams(const MatrixView& w,
                                                               const Context& context,
                                                               const Tile& tile, float* y,
                                                               int64_t y_stride, int64_t a_begin,
                                                               int64_t b_begin, int64_t count) {
  const int64_t steps = context.steps;
  for (int64_t i = 0; i < count; ++i) {
    Row a(context, reinterpret_cast<const uint8_t*>(w.row(a_begin + i)));
    Row b(context, reinterpret_cast<const uint8_t*>(w.row(b_begin + i)));
    for (int64_t s = 0; s < steps; ++s) {
      a.step(context, tile, s);
      b.step(context, tile, s);
    }
    a.finish(context, tile, y, y_stride, a_begin + i);
    b.finish(context, tile, y, y_stride, b_begin + i);
  }
}

// Tokens per tile of the two-stream kernels: two rows' accumulators and scales in registers.
constexpr int kTwoStreamTokenTile = 4;

// A row kernel's two types: Kernel::Context, what every row of a call shares, built from the
// matrix; Kernel::Row<kTokens>, one row's state for a tile of kTokens tokens.
//
// kernel_rows: rows [row_begin, row_end) in one stream, the row loop inside each tile of tokens
// (for_each_row_run) so that a decode step's per-row work is the blocks alone (with the rows
// outside, each row paid the tile's setup and reloaded the lane indices: 20% of a one-token Q8_0
// row at 1024 columns).
template <class Kernel>
void kernel_rows(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                 int64_t row_begin, int64_t row_end) {
  for_each_row_run<kTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int kTokens = std::remove_cvref_t<decltype(tile)>::kCount;
        const typename Kernel::Context context(w);
        rows_in_one_stream<typename Kernel::template Row<kTokens>>(w, context, tile, y, y_stride,
                                                                   first, last);
      });
}

// kernel_rows_two_streams: runs of row pairs from [a_begin, a_end) and [b_begin, b_end), each run
// through every tile of tokens while its rows are in cache; then what one range has beyond the
// other in one stream.
template <class Kernel>
void kernel_rows_two_streams(const MatrixView& w, const QuantizedActivations& x, float* y,
                             int64_t y_stride, int64_t a_begin, int64_t a_end, int64_t b_begin,
                             int64_t b_end) {
  const int64_t both = std::min(a_end - a_begin, b_end - b_begin);
  for_each_row_run<kTwoStreamTokenTile>(
      x, 0, both, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int kTokens = std::remove_cvref_t<decltype(tile)>::kCount;
        const typename Kernel::Context context(w);
        rows_in_two_streams<typename Kernel::template Row<kTokens>>(
            w, context, tile, y, y_stride, a_begin + first, b_begin + first, last - first);
      });
  if (a_begin + both < a_end) kernel_rows<Kernel>(w, x, y, y_stride, a_begin + both, a_end);
  if (b_begin + both < b_end) kernel_rows<Kernel>(w, x, y, y_stride, b_begin + both, b_end);
}

// Q8_0 and Q4_0: a step is a group of 8 blocks, whose weight scales are converted together and
// multiplied by each token's 8 activation scales in one instruction (the same products d_w * d_x
// as the pairs in finish() compute one by one, so a row's result does not depend on the route).
struct Q8Context {
  int64_t blocks, steps, ahead;
  __m512i pair_index[4];  // lanes 0-7: block 2p of a group of 8, lanes 8-15: block 2p + 1

  explicit Q8Context(const MatrixView& w)
      : blocks(w.cols / 32), steps(w.cols / 256), ahead(quant_prefetch_bytes()) {
    for (int p = 0; p < 4; ++p)
      pair_index[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
  }
};

template <bool q8, int kTokens>
struct Q8Row {
  static constexpr int64_t kBytes = q8 ? 34 : 18;
  const uint8_t* row;
  __m512 acc[kTokens];

  Q8Row(const Q8Context&, const uint8_t* start) : row(start) {
    for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  }
  static __m256i weights(const uint8_t* block) { return q8_q4_0_weights<q8>(block); }
  __attribute__((always_inline)) void step(const Q8Context& c, const TokenTile<kTokens>& tile,
                                           int64_t s) {
    const int64_t b = 8 * s;
    const uint8_t* first_block = row + b * kBytes;
    const __m256 dw = eight_block_scales(first_block, kBytes);
    __m512 scales[kTokens];
    for (int t = 0; t < kTokens; ++t)
      scales[t] = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(tile.scales(t) + b)));
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const uint8_t* first = first_block + 2 * p * kBytes;
      prefetch_ahead(first, 2 * kBytes, c.ahead);
      const __m512i q = join(weights(first), weights(first + kBytes));
      for (int t = 0; t < kTokens; ++t) {
        const __m512i sums = dot_signed(q, load512(tile.q(t) + (b + 2 * p) * 32));
        acc[t] = _mm512_fmadd_ps(_mm512_permutexvar_ps(c.pair_index[p], scales[t]),
                                 _mm512_cvtepi32_ps(sums), acc[t]);
      }
    }
  }
  // The blocks the groups did not take (fewer than 8): pairs, then an odd last block.
  __attribute__((always_inline)) void finish(const Q8Context& c, const TokenTile<kTokens>& tile,
                                             float* y, int64_t y_stride, int64_t r) {
    int64_t b = 8 * c.steps;
    for (; b + 2 <= c.blocks; b += 2) {
      const uint8_t* first = row + b * kBytes;
      prefetch_ahead(first, 2 * kBytes, c.ahead);
      const __m512i q = join(weights(first), weights(first + kBytes));
      const float d0 = half_at(first), d1 = half_at(first + kBytes);
      for (int t = 0; t < kTokens; ++t) {
        const float* dx = tile.scales(t) + b;
        const __m512i sums = dot_signed(q, load512(tile.q(t) + b * 32));
        const __m512 scale =
            _mm512_insertf32x8(_mm512_set1_ps(d0 * dx[0]), _mm256_set1_ps(d1 * dx[1]), 1);
        acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc[t]);
      }
    }
    for (; b < c.blocks; ++b) {  // in the low half
      const uint8_t* block = row + b * kBytes;
      const __m512i q = _mm512_castsi256_si512(weights(block));
      const float d = half_at(block);
      for (int t = 0; t < kTokens; ++t) {
        const __m512i xq = _mm512_castsi256_si512(load256(tile.q(t) + b * 32));
        const __m512i sums =
            dot_signed(_mm512_maskz_mov_epi64(0x0F, q), _mm512_maskz_mov_epi64(0x0F, xq));
        acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * tile.scales(t)[b]), _mm512_cvtepi32_ps(sums),
                                 acc[t]);
      }
    }
    for (int t = 0; t < kTokens; ++t)
      y[(tile.first + t) * y_stride + r] = _mm512_reduce_add_ps(acc[t]);
  }
};

template <bool q8>
struct Q8Kernel {
  using Context = Q8Context;
  template <int kTokens>
  using Row = Q8Row<q8, kTokens>;
};

// A Q4_K super-block's two integer sums for one row and token, Σ sc q x (16 lanes of partial
// sums) and Σ m Σx (4 lanes), folded to one value each and converted: lane 0 and lane 2. The
// folding narrows the registers as it goes (a 512-bit operation costs two 256-bit ones on Zen 4).
// Integer sums are exact, so the order of the folding does not change them.
inline __m128 fold_k_sums(__m512i scaled, __m128i mins) {
  const __m256i eight =
      _mm256_add_epi32(_mm512_castsi512_si256(scaled), _mm512_extracti64x4_epi64(scaled, 1));
  const __m128i four =
      _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
  __m128i both = _mm_add_epi32(_mm_unpacklo_epi64(four, mins), _mm_unpackhi_epi64(four, mins));
  both = _mm_add_epi32(both, _mm_shuffle_epi32(both, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtepi32_ps(both);
}

// One super-block's share of a Q4_K row: acc + dx (d Σ sc q x - dmin Σ m Σx), with these
// float operations in this order in every kernel that computes the row (one row at a time, or
// sixteen rows per register in the interleaved kernel), so that a row's result is the same bits
// whichever kernel a batch's size chose (exact prefix reuse compares prefill with decode).
inline float k_block_step(float acc, float d, float dmin, float dx, __m128 sums) {
  const float mins = dmin * _mm_cvtss_f32(_mm_movehl_ps(sums, sums));
  return std::fma(dx, std::fma(d, _mm_cvtss_f32(sums), -mins), acc);
}
inline __m512 k_block_step(__m512 acc, __m512 d, __m512 dmin, __m512 dx, __m512i scaled_sum,
                           __m512i min_sum) {
  const __m512 mins = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(min_sum));
  return _mm512_fmadd_ps(dx, _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(scaled_sum), mins), acc);
}

// quarters[k], 128-bit lane L: four partial sums of item 4k + L. Lane 4L + m of the result: the
// sum of item 4m + L.
inline __m512i sums_of_quarters(const __m512i quarters[4]) {
  __m512i pairs[2];
  for (int i = 0; i < 2; ++i)  // 128-bit lane L: items 8i + L and 8i + 4 + L, two partials each
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(quarters[2 * i], quarters[2 * i + 1]),
                                _mm512_unpackhi_epi64(quarters[2 * i], quarters[2 * i + 1]));
  const __m512 a = _mm512_castsi512_ps(pairs[0]), b = _mm512_castsi512_ps(pairs[1]);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                          _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
}

// A Q4_K or Q5_K super-block's 256 packed nibbles (`qs`) as they split: register 2h holds the low
// nibbles of bytes 64h .. 64h + 63 (sub-blocks 4h and 4h + 2), register 2h + 1 their high nibbles
// (4h + 1 and 4h + 3), for activations in QuantizedActivations' nibble order.
inline void split_k_nibbles(const uint8_t* qs, __m512i q[4]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m512i packed = load512(qs + 64 * h);
    q[2 * h] = _mm512_and_si512(packed, nibble);
    q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  }
}

// The same in sub-block order (register g: sub-blocks 2g and 2g + 1): one 128-bit-lane shuffle
// per pair of split registers (two 32-byte loads and an insert per register cost more
// instructions).
inline void unpack_k_nibbles(const uint8_t* qs, __m512i q[4]) {
  split_k_nibbles(qs, q);
  for (int h = 0; h < 2; ++h) {
    const __m512i lo = q[2 * h], hi = q[2 * h + 1];
    q[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
    q[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
  }
}

// One Q4_K or Q5_K super-block of a row, unpacked for the row-at-a-time kernels: the weights in
// four registers (register g: sub-blocks 2g and 2g + 1), the sub-block scales spread over the
// lanes the Dot multiplies, and the mins in the form each type's arithmetic takes.
template <bool fifth, class Dot>
struct KQuantBlock {
  __m512i q[4], sc[Dot::kRegisters];
  __m128i min_pairs;  // Q4_K: the mins as 16-bit pairs (m_2p, m_2p+1), for
                      // QuantizedActivations::min_pairs
  __m512i mins;       // Q5_K: each min beside the two 16-sums of its sub-block
  float d, dmin;

  KQuantBlock(const uint8_t* block, const __m512i index[Dot::kRegisters]) {
    const __m128i unpacked = k_scales_vector(block + 4);
    const __m128i scales16 = _mm_cvtepu8_epi16(unpacked);
    const __m128i min_bytes = _mm_unpackhi_epi64(unpacked, unpacked);
    if constexpr (fifth) {
      // One min per 32-bit lane with its high half zero, so a madd_epi16 with the (small) sums
      // multiplies them exactly.
      mins = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(
          min_bytes, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
    } else {
      min_pairs = _mm_cvtepu8_epi16(min_bytes);
    }
    unpack_k_nibbles(block + (fifth ? 48 : 16), q);
    if constexpr (fifth) {  // sub-block j's fifth bits: bit j of the 32 high-bit bytes
      const __m256i qh = load256(block + 16), one = _mm256_set1_epi8(1);
      for (int g = 0; g < 4; ++g) {
        const __m256i lo =
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4);
        const __m256i hi =
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4);
        q[g] = _mm512_or_si512(q[g], join(lo, hi));
      }
    }
    for (int s = 0; s < Dot::kRegisters; ++s) sc[s] = spread(scales16, index[s]);
    d = half_at(block);
    dmin = half_at(block + 2);
  }
};

// The spread indices of KQuantBlock's scales: register g holds sub-blocks 2g and 2g + 1 (32
// weights, eight 32-bit lanes each).
template <class Dot>
void k_quant_indices(__m512i index[Dot::kRegisters]) {
  Dot::indices([](int g, int lane) { return 2 * g + lane / 8; }, index);
}
// The same for split_k_nibbles' registers (register g: sub-blocks 4 (g / 2) + g % 2 and two more).
template <class Dot>
void split_k_indices(__m512i index[Dot::kRegisters]) {
  Dot::indices([](int g, int lane) { return 4 * (g / 2) + g % 2 + 2 * (lane / 8); }, index);
}

// min_pairs: Q4_K's (QuantizedActivations::min_pairs); Q5_K's arithmetic keeps 16 lanes and does
// not use them.
template <bool fifth, class Dot, int kTokens>
void q45_k_tile(const MatrixView& w, const TokenTile<kTokens>& tile, float* y, int64_t y_stride,
                int64_t row_begin, int64_t row_end, const int32_t* min_pairs) {
  const int64_t bytes = fifth ? 176 : 144, blocks = w.cols / 256, ahead = quant_prefetch_bytes();
  __m512i index[Dot::kRegisters];
  k_quant_indices<Dot>(index);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
    // Q4_K: k_block_step's scalar chain, which the 16-row kernels repeat for 16 rows at a
    // time; Q5_K (no 16-row kernel): 16 lanes converted and scaled, folded at the end.
    __m512 lanes[kTokens];
    float acc[kTokens];
    for (int t = 0; t < kTokens; ++t) {
      lanes[t] = _mm512_setzero_ps();
      acc[t] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * bytes;
      prefetch_ahead(block, bytes, ahead);
      const KQuantBlock<fifth, Dot> k(block, index);
      for (int t = 0; t < kTokens; ++t) {
        const int8_t* xb = tile.q(t) + b * 256;
        const __m512i sumi = Dot::add(_mm512_setzero_si512(), k.q, xb, k.sc);
        const float dx = tile.scales(t)[b];
        if constexpr (fifth) {
          // Σ_j m_j Σ_{i∈j} x_i, lane by lane (|a 16-sum| ≤ 16 · 127 fits 16 bits).
          const __m512i summ = _mm512_madd_epi16(load512(tile.sums(t) + b * 16), k.mins);
          lanes[t] = _mm512_fmadd_ps(_mm512_set1_ps(k.d * dx), _mm512_cvtepi32_ps(sumi), lanes[t]);
          lanes[t] =
              _mm512_fnmadd_ps(_mm512_set1_ps(k.dmin * dx), _mm512_cvtepi32_ps(summ), lanes[t]);
        } else {
          const __m128i pairs = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(min_pairs + (tile.first + t) * blocks * 4 + b * 4));
          acc[t] = k_block_step(acc[t], k.d, k.dmin, dx,
                                fold_k_sums(sumi, _mm_madd_epi16(pairs, k.min_pairs)));
        }
      }
    }
    for (int t = 0; t < kTokens; ++t) {
      if constexpr (fifth)
        y[(tile.first + t) * y_stride + r] = _mm512_reduce_add_ps(lanes[t]);
      else
        y[(tile.first + t) * y_stride + r] = acc[t];
    }
  }
}

template <bool fifth, class Dot>
void rows_q45_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                int64_t row_begin, int64_t row_end, const int32_t* min_pairs = nullptr) {
  for_each_row_run<kTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        q45_k_tile<fifth, Dot>(w, tile, y, y_stride, first, last, min_pairs);
      });
}

// Sixteen registers of 16 lanes summed lane-wise into one: lane 4L + m of the result is the sum
// of v[4m + L] (the transposed order falls out of the shuffles; the caller permutes it back).
// Exact integer sums, 45 instructions where sixteen separate folds take about twice as many.
inline __m512i transposed_sums(const __m512i v[16]) {
  __m512i halves[8], quarters[4];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i] folded to 8, lanes 8-15: v[2i + 1]
    halves[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0x44),
                                 _mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: v[4i + L] folded to 4
    quarters[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(halves[2 * i], halves[2 * i + 1], 0x88),
                                   _mm512_shuffle_i64x2(halves[2 * i], halves[2 * i + 1], 0xDD));
  return sums_of_quarters(quarters);
}

// Q4_K for a few tokens (decode), rows sixteen at a time as the file stores them: each row's
// weights are multiplied as in rows_q45_k, but the sums of 16 rows are folded together
// (transposed_sums) and one k_block_step serves the 16, where the row kernel folds and scales
// each row on its own. Each super-block's 16-byte heads (d, dmin and the packed scales and mins)
// of the 16 rows are gathered (gather_k_heads) into 16 lanes, one row per lane in transposed_sums'
// lane order, and unpacked there for all 16 rows at once: per row then only a broadcast and a byte
// shuffle spread its scales (the per-row unpacking had been about a third of the kernel's
// instructions), and the mins' products are taken for 16 rows by four vpdpwssd. The weights'
// nibbles are multiplied in the order they split (split_k_nibbles), with the activations in that
// order (quantized so once per matmul), saving four cross-lane shuffles per row and super-block.
// The same integers and float steps as the other Q4_K kernels, so the same bits.
//
// Tokens per pass of the decode kernel over a group of 16 rows (batches of 4-6 tokens take two
// passes, still faster than the unpacking kernel: kQ4KBatchFromTokens).
constexpr int kGroupedTokenTile = 3;

// Where a Dot's scale registers take their scales from, for 16-row lanes of packed scale bytes:
// register s spreads 16-bit scales from the four bytes of scales 0-3 (half 0) or 4-7 (half 1) of
// one row, broadcast to every 32-bit lane, by a byte shuffle (its control in `control[s]`).
template <class Dot>
struct ScaleSpread {
  __m512i control[Dot::kRegisters];
  int half[Dot::kRegisters];

  ScaleSpread() {
    __m512i index[Dot::kRegisters];
    split_k_indices<Dot>(index);
    for (int s = 0; s < Dot::kRegisters; ++s) {
      alignas(64) int16_t scale[32];
      alignas(64) int8_t bytes[64];
      _mm512_store_si512(scale, index[s]);
      half[s] = scale[0] / 4;  // every lane of a register reads the same half (split_k_indices)
      for (int l = 0; l < 32; ++l) {
        bytes[2 * l] = static_cast<int8_t>(scale[l] % 4);
        bytes[2 * l + 1] = -128;  // zero: the high byte of the 16-bit scale
      }
      control[s] = _mm512_load_si512(bytes);
    }
  }
};

// The 16-byte heads of 16 rows (at `heads`, `row_bytes` apart) as four registers of 16 lanes, one
// per 32-bit word of a head, lane l holding row 4 (l % 4) + l / 4 (transposed_sums' order): four
// rows' heads loaded into the 128-bit lanes of each of four registers, then a 4x4 transpose of
// words inside each 128-bit lane. Fewer operations than four 16-lane gathers (vpgatherdd).
inline void gather_k_heads(const uint8_t* heads, int64_t row_bytes, __m512i& word0, __m512i& word1,
                           __m512i& word2, __m512i& word3) {
  auto head = [&](int r) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(heads + r * row_bytes));
  };
  __m512i rows[4];  // rows[k], 128-bit lane L: the head of row 4k + L
  for (int k = 0; k < 4; ++k)
    rows[k] = _mm512_inserti32x4(
        _mm512_inserti32x4(
            _mm512_inserti32x4(_mm512_castsi128_si512(head(4 * k)), head(4 * k + 1), 1),
            head(4 * k + 2), 2),
        head(4 * k + 3), 3);
  const __m512i low01 = _mm512_unpacklo_epi32(rows[0], rows[1]),
                high01 = _mm512_unpackhi_epi32(rows[0], rows[1]),
                low23 = _mm512_unpacklo_epi32(rows[2], rows[3]),
                high23 = _mm512_unpackhi_epi32(rows[2], rows[3]);
  word0 = _mm512_unpacklo_epi64(low01, low23);  // lane 4L + k: word 0 of row 4k + L
  word1 = _mm512_unpackhi_epi64(low01, low23);
  word2 = _mm512_unpacklo_epi64(high01, high23);
  word3 = _mm512_unpackhi_epi64(high01, high23);
}

template <class Dot>
void rows_q4_k_grouped(const MatrixView& w, const QuantizedActivations& x, float* y,
                       int64_t y_stride, int64_t row_begin, int64_t row_end) {
  const int32_t* min_pairs = x.min_pairs.data();
  const int64_t blocks = w.cols / 256;
  const auto row_bytes = static_cast<int64_t>(w.row_bytes());
  const ScaleSpread<Dot> spread_by;
  // Lane l of transposed_sums holds row 4 (l % 4) + l / 4; the map is its own inverse.
  alignas(64) static constexpr int32_t kTransposed[16] = {0, 4, 8,  12, 1, 5, 9,  13,
                                                          2, 6, 10, 14, 3, 7, 11, 15};
  const __m512i transposed = _mm512_load_si512(kTransposed);
  const __m512i k6 = _mm512_set1_epi32(0x3f3f3f3f), k4 = _mm512_set1_epi32(0x0f0f0f0f),
                k2 = _mm512_set1_epi32(0x03030303), low_byte = _mm512_set1_epi32(0xFF),
                third_byte = _mm512_set1_epi32(0xFF0000);
  int64_t first = row_begin;
  for (; first + 16 <= row_end; first += 16) {
    const auto* group = reinterpret_cast<const uint8_t*>(w.row(first));
    const uint8_t* next_group = group + 16 * row_bytes;
    for_each_token_tile<kGroupedTokenTile>(x, [&](const auto& tile) {
      constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
      __m512 acc[tokens];
      const int8_t* xq[tokens];
      for (int t = 0; t < tokens; ++t) {
        acc[t] = _mm512_setzero_ps();
        xq[t] = x.row_in_nibble_order(tile.first + t);
      }
      for (int64_t b = 0; b < blocks; ++b) {
        // The 16 rows' heads (k_scales in quant_matmul.h, 16 rows at a time): scales and mins
        // 0-3 are the low 6 bits of words 1 and 2, 4-7 take their low bits from word 3's
        // nibbles and their top two from the top of words 1 and 2.
        __m512i d_dmin, w0, w1, w2;
        gather_k_heads(group + b * 144, row_bytes, d_dmin, w0, w1, w2);
        alignas(64) int32_t scales[2][16];
        _mm512_store_si512(scales[0], _mm512_and_si512(w0, k6));
        _mm512_store_si512(
            scales[1],
            _mm512_or_si512(_mm512_and_si512(w2, k4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), k2), 4)));
        const __m512i mins_low = _mm512_and_si512(w1, k6);
        const __m512i mins_high =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), k4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), k2), 4));
        // Mins 2p and 2p + 1 as the two 16-bit halves of each lane, for
        // QuantizedActivations::min_pairs' sums.
        __m512i min_pair[4];
        for (int h = 0; h < 2; ++h) {
          const __m512i m = h == 0 ? mins_low : mins_high;
          min_pair[2 * h] = _mm512_or_si512(_mm512_and_si512(m, low_byte),
                                            _mm512_and_si512(_mm512_slli_epi32(m, 8), third_byte));
          min_pair[2 * h + 1] =
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(m, 16), low_byte),
                              _mm512_and_si512(_mm512_srli_epi32(m, 8), third_byte));
        }
        const __m512 d_lanes = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d_dmin));
        const __m512 dmin_lanes =
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(d_dmin, 16)));
        __m512i scaled[tokens][16];
        for (int r = 0; r < 16; ++r) {
          const uint8_t* block = group + r * row_bytes + b * 144;
          // The 16 rows are one contiguous span read in a strided order, which the hardware
          // prefetchers do not follow: the next group's span is prefetched in step with this one.
          prefetch_lines(next_group + (b * 16 + r) * 144, 144);
          __m512i q[4], sc[Dot::kRegisters];
          split_k_nibbles(block + 16, q);
          const int lane = kTransposed[r];
          for (int s = 0; s < Dot::kRegisters; ++s)
            sc[s] = _mm512_shuffle_epi8(_mm512_set1_epi32(scales[spread_by.half[s]][lane]),
                                        spread_by.control[s]);
          for (int t = 0; t < tokens; ++t)
            scaled[t][r] = Dot::add(_mm512_setzero_si512(), q, xq[t] + b * 256, sc);
        }
        for (int t = 0; t < tokens; ++t) {
          const int32_t* pairs = min_pairs + (tile.first + t) * blocks * 4 + b * 4;
          __m512i min_sum = _mm512_setzero_si512();
          for (int p = 0; p < 4; ++p)
            min_sum = add_scaled_pairs(min_sum, min_pair[p], _mm512_set1_epi32(pairs[p]));
          acc[t] = k_block_step(acc[t], d_lanes, dmin_lanes, _mm512_set1_ps(tile.scales(t)[b]),
                                transposed_sums(scaled[t]), min_sum);
        }
      }
      for (int t = 0; t < tokens; ++t)
        _mm512_storeu_ps(y + (tile.first + t) * y_stride + first,
                         _mm512_permutexvar_ps(transposed, acc[t]));
    });
  }
  if (first < row_end) rows_q45_k<false, Dot>(w, x, y, y_stride, first, row_end, min_pairs);
}

// Q4_K rows sixteen at a time, for batches of tokens (prefill): each super-block of 16 rows is
// unpacked once into registers whose 32-bit lane r belongs to row r, and every token of the batch
// then multiplies it with instructions that each serve 16 rows. The row-at-a-time kernel spends
// most of a token's work per super-block on one row's epilogue (the scales spread over lanes, the
// sums folded, converted and scaled); here that epilogue is shared by 16 rows. The arithmetic is
// the row kernel's (the same integer sums, then k_block_step), so the results are the same bits.
constexpr int64_t kInterleavedRows = 16;
// Tokens per pass over an unpacked super-block: three accumulators each beside its weights.
constexpr int kInterleavedTokenTile = 8;

struct alignas(64) InterleavedQ4K {
  __m512i q[64];      // group k: weights 4k .. 4k + 3 of each row, one byte each
  __m512i scales[8];  // sub-block j's scale in the low 16 bits of each lane, the high bits zero
  __m512i mins[4];    // the mins of sub-blocks 2p and 2p + 1 as the two 16-bit halves of a lane
  __m512 d, dmin;
};

// v[c] lane r = v[r] lane c, for 16 registers of 16 32-bit lanes.
inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  // v[4g + c], 128-bit lane L: rows 4g .. 4g + 3 at column 4L + c.
  for (int g = 0; g < 16; g += 4) {
    v[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    v[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    v[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    v[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(v[c], v[4 + c], 0x88);           // columns c, 8 + c of rows 0-7
    t[4 + c] = _mm512_shuffle_i32x4(v[c], v[4 + c], 0xDD);       // columns 4 + c, 12 + c
    t[8 + c] = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0x88);  // the same of rows 8-15
    t[12 + c] = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    v[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    v[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

void interleave_q4_k(const MatrixView& w, int64_t first_row, int64_t blocks, InterleavedQ4K* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // The next group's span, prefetched in step (as rows_q4_k_grouped: a strided read of one span).
  const auto* next_group = reinterpret_cast<const uint8_t*>(w.row(first_row + kInterleavedRows));
  for (int64_t b = 0; b < blocks; ++b) {
    InterleavedQ4K& o = out[b];
    const uint8_t* block[kInterleavedRows];
    for (int r = 0; r < kInterleavedRows; ++r) {
      block[r] = reinterpret_cast<const uint8_t*>(w.row(first_row + r)) + b * 144;
      prefetch_lines(next_group + (b * kInterleavedRows + r) * 144, 144);
    }
    // Byte 64h + 4m + i of the packed nibbles lies in 32-byte chunk c = 2h + m / 8: its low nibble
    // is weight 64c + 4 (m % 8) + i (group 16c + m % 8), its high nibble that weight + 32.
    for (int h = 0; h < 2; ++h) {
      __m512i v[kInterleavedRows];
      for (int r = 0; r < kInterleavedRows; ++r) v[r] = load512(block[r] + 16 + 64 * h);
      transpose16(v);
      for (int m = 0; m < 16; ++m) {
        const int group = 16 * (2 * h + m / 8) + m % 8;
        o.q[group] = _mm512_and_si512(v[m], nibble);
        o.q[group + 8] = _mm512_and_si512(_mm512_srli_epi16(v[m], 4), nibble);
      }
    }
    alignas(64) int32_t scales[8][kInterleavedRows], mins[4][kInterleavedRows];
    alignas(64) float d[kInterleavedRows], dmin[kInterleavedRows];
    for (int r = 0; r < kInterleavedRows; ++r) {
      alignas(16) uint8_t packed[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(packed), k_scales_vector(block[r] + 4));
      for (int j = 0; j < 8; ++j) scales[j][r] = packed[j];
      for (int p = 0; p < 4; ++p) mins[p][r] = packed[8 + 2 * p] | packed[9 + 2 * p] << 16;
      d[r] = half_at(block[r]);
      dmin[r] = half_at(block[r] + 2);
    }
    for (int j = 0; j < 8; ++j) o.scales[j] = _mm512_load_si512(scales[j]);
    for (int p = 0; p < 4; ++p) o.mins[p] = _mm512_load_si512(mins[p]);
    o.d = _mm512_load_ps(d);
    o.dmin = _mm512_load_ps(dmin);
  }
}

// Σ over four weight bytes times four activation bytes per lane (exact either way: a pair of
// products ≤ 2 · 15 · 127 does not saturate maddubs' 16 bits).
inline __m512i add_dot4(__m512i sum, __m512i weights, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(sum, weights, x);
#else
  return _mm512_add_epi32(
      sum, _mm512_madd_epi16(_mm512_maddubs_epi16(weights, x), _mm512_set1_epi16(1)));
#endif
}

inline int32_t i32_at(const int8_t* p) {
  int32_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

// y[t, 0 .. 15] for the tile's tokens against 16 interleaved rows. min_pairs[t][4b + p]: the
// activations' sums over sub-blocks 2p and 2p + 1 of super-block b as two 16-bit halves.
template <int kTokens>
void interleaved_q4_k_tile(const InterleavedQ4K* blocks, int64_t count,
                           const TokenTile<kTokens>& tile, const int32_t* min_pairs, float* y,
                           int64_t y_stride) {
  __m512 acc[kTokens];
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < count; ++b) {
    const InterleavedQ4K& block = blocks[b];
    __m512i scaled[kTokens];
    for (int t = 0; t < kTokens; ++t) scaled[t] = _mm512_setzero_si512();
    // 16 weights of a row times ±127: |Σ q x| ≤ 16 · 15 · 127 fits the 16 bits the scale takes.
    for (int s = 0; s < 16; ++s) {
      __m512i part[kTokens];
      for (int t = 0; t < kTokens; ++t) part[t] = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        const __m512i weights = block.q[4 * s + k];
        for (int t = 0; t < kTokens; ++t)
          part[t] = add_dot4(part[t], weights,
                             _mm512_set1_epi32(i32_at(tile.q(t) + b * 256 + 16 * s + 4 * k)));
      }
      for (int t = 0; t < kTokens; ++t)
        scaled[t] = add_scaled_pairs(scaled[t], part[t], block.scales[s / 2]);
    }
    for (int t = 0; t < kTokens; ++t) {
      const int32_t* pairs = min_pairs + t * count * 4 + b * 4;
      __m512i min_sum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)
        min_sum = add_scaled_pairs(min_sum, block.mins[p], _mm512_set1_epi32(pairs[p]));
      acc[t] = k_block_step(acc[t], block.d, block.dmin, _mm512_set1_ps(tile.scales(t)[b]),
                            scaled[t], min_sum);
    }
  }
  for (int t = 0; t < kTokens; ++t) _mm512_storeu_ps(y + (tile.first + t) * y_stride, acc[t]);
}

// Q4_K for a batch: rows in groups of 16 through the interleaved kernel, the rest one at a time.
template <class Dot>
void rows_q4_k_batch(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                     int64_t row_begin, int64_t row_end) {
  const int64_t blocks = w.cols / 256;
  thread_local std::vector<InterleavedQ4K> unpacked;
  if (unpacked.size() < static_cast<size_t>(blocks)) unpacked.resize(static_cast<size_t>(blocks));
  const int32_t* min_pairs = x.min_pairs.data();
  int64_t r = row_begin;
  for (; r + kInterleavedRows <= row_end; r += kInterleavedRows) {
    interleave_q4_k(w, r, blocks, unpacked.data());
    for_each_token_tile<kInterleavedTokenTile>(x, [&](const auto& tile) {
      interleaved_q4_k_tile(unpacked.data(), blocks, tile, min_pairs + tile.first * blocks * 4,
                            y + r, y_stride);
    });
  }
  if (r < row_end) rows_q45_k<false, Dot>(w, x, y, y_stride, r, row_end, min_pairs);
}

// Q6_K: a step is one super-block.
template <class Dot>
struct Q6KContext {
  int64_t steps, ahead;
  // 16-bit shift counts per 256-bit half that bring quarter k's two top bits (2k, 2k+1) to bits
  // 4, 5: left by 4 | 2 for quarters 0 | 1, right by 0 | 2 for quarters 2 | 3.
  __m512i shift01, shift23;
  // Weight register r holds weights 64r .. 64r + 63: 16-weight sub-blocks 4 (r % 2) .. + 3 of
  // half r / 2 (four 32-bit lanes each), whose 8 scales are spread half by half.
  __m512i index[Dot::kRegisters];

  explicit Q6KContext(const MatrixView& w)
      : steps(w.cols / 256),
        ahead(quant_prefetch_bytes()),
        shift01(join(_mm256_set1_epi16(4), _mm256_set1_epi16(2))),
        shift23(join(_mm256_set1_epi16(0), _mm256_set1_epi16(2))) {
    Dot::indices([](int r, int lane) { return 4 * (r % 2) + lane / 4; }, index);
  }
};

template <class Dot, int kTokens>
struct Q6KRow {
  const uint8_t* row;
  __m512 acc[kTokens];

  Q6KRow(const Q6KContext<Dot>&, const uint8_t* start) : row(start) {
    for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  }
  __attribute__((always_inline)) void step(const Q6KContext<Dot>& c, const TokenTile<kTokens>& tile,
                                           int64_t b) {
    const uint8_t* block = row + b * 210;
    prefetch_ahead(block, 210, c.ahead);
    const auto* sc8 = reinterpret_cast<const int8_t*>(block + 192);
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc8)));
    const float d = half_at(block + 208);
    __m512i q[4], sc[Dot::kRegisters];  // pairs of quarters: weights 64p .. 64p + 63
    for (int h = 0; h < 2; ++h) {
      // 64 low-bit bytes: their low nibbles are quarters 0 and 1 of the half (weights 0-63),
      // their high nibbles quarters 2 and 3; quarter k's top two bits are bits 2k, 2k+1 of
      // the half's 32 high-bit bytes, moved to bits 4, 5 (bits that cross into the next byte
      // of a 16-bit lane fall outside the 0x30 mask).
      const __m512i low = load512(block + 64 * h);
      const __m512i high = _mm512_broadcast_i64x4(load256(block + 128 + 32 * h));
      const __m512i nibble = _mm512_set1_epi8(0x0F), top_bits = _mm512_set1_epi8(0x30);
      const __m512i top01 = _mm512_and_si512(_mm512_sllv_epi16(high, c.shift01), top_bits);
      const __m512i top23 = _mm512_and_si512(_mm512_srlv_epi16(high, c.shift23), top_bits);
      q[2 * h] = _mm512_or_si512(_mm512_and_si512(low, nibble), top01);
      q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble), top23);
      const __m128i half_scales =
          h == 0 ? _mm256_castsi256_si128(scales16) : _mm256_extracti128_si256(scales16, 1);
      constexpr int kPerHalf = Dot::kRegisters / 2;
      for (int s = h * kPerHalf; s < (h + 1) * kPerHalf; ++s)
        sc[s] = spread(half_scales, c.index[s]);
    }
    // Σ sc (q - 32) x = Σ sc q x + Σ_s (-32 sc_s) Σ_{i∈s} x_i: the offset taken lane by lane,
    // -32 sc_s (|.| ≤ 4096) as the low half of a 32-bit lane with the high half zero, so that
    // a madd with the activations' 16-sums (which fit 16 bits) multiplies the two exactly.
    const __m512i scales32 =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc8)));
    const __m512i offset_scale =
        _mm512_and_si512(_mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(scales32, 5)),
                         _mm512_set1_epi32(0xFFFF));
    for (int t = 0; t < kTokens; ++t) {
      const int8_t* xb = tile.q(t) + b * 256;
      __m512i sumi = Dot::add(_mm512_setzero_si512(), q, xb, sc);
      sumi = add_scaled_pairs(sumi, load512(tile.sums(t) + b * 16), offset_scale);
      const float dx = tile.scales(t)[b];
      acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(sumi), acc[t]);
    }
  }
  __attribute__((always_inline)) void finish(const Q6KContext<Dot>&, const TokenTile<kTokens>& tile,
                                             float* y, int64_t y_stride, int64_t r) {
    for (int t = 0; t < kTokens; ++t)
      y[(tile.first + t) * y_stride + r] = _mm512_reduce_add_ps(acc[t]);
  }
};

template <class Dot>
struct Q6KKernel {
  using Context = Q6KContext<Dot>;
  template <int kTokens>
  using Row = Q6KRow<Dot, kTokens>;
};

}  // namespace

void MOELINE_QUANT_AVX512_ENTRY(const MatrixView& w, const QuantizedActivations& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end) {
  switch (w.dtype) {
    case DType::kQ8_0:
      return kernel_rows<Q8Kernel<true>>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ4_0:
      return kernel_rows<Q8Kernel<false>>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ4_K:
      if (x.rows >= kQ4KBatchFromTokens)
        return rows_q4_k_batch<Q4KDot>(w, x, y, y_stride, row_begin, row_end);
      return rows_q4_k_grouped<Q4KDot>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ5_K:
      return rows_q45_k<true, Q5KDot>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ6_K:
      return kernel_rows<Q6KKernel<Q6KDot>>(w, x, y, y_stride, row_begin, row_end);
    default:
      return quant_matmul_rows_portable(w, x, y, y_stride, row_begin, row_end);
  }
}

void MOELINE_QUANT_AVX512_TWO_STREAMS_ENTRY(const MatrixView& w, const QuantizedActivations& x,
                                            float* y, int64_t y_stride, int64_t a_begin,
                                            int64_t a_end, int64_t b_begin, int64_t b_end) {
  switch (w.dtype) {
    case DType::kQ8_0:
      return kernel_rows_two_streams<Q8Kernel<true>>(w, x, y, y_stride, a_begin, a_end, b_begin,
                                                     b_end);
    case DType::kQ4_0:
      return kernel_rows_two_streams<Q8Kernel<false>>(w, x, y, y_stride, a_begin, a_end, b_begin,
                                                      b_end);
    case DType::kQ6_K:
      return kernel_rows_two_streams<Q6KKernel<Q6KDot>>(w, x, y, y_stride, a_begin, a_end, b_begin,
                                                        b_end);
    default:
      MOELINE_QUANT_AVX512_ENTRY(w, x, y, y_stride, a_begin, a_end);
      MOELINE_QUANT_AVX512_ENTRY(w, x, y, y_stride, b_begin, b_end);
  }
}

}  // namespace moeline::kernels::detail
