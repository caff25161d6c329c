// AVX2 path of the fast quantized matmul (quant_matmul.h). Each
// 32 weights become 32 bytes in one register; maddubs multiplies them (unsigned) with 32 signed
// activation bytes into 16-bit pairs, madd widens the pairs with the block's (sub-block) scales
// into 32-bit sums, and a whole block or super-block is converted to float and scaled once.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/q8_blocks_vector.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels::detail {
namespace {

constexpr int kTokenTile = 4;
// The K-quant kernels unpack a super-block of a row once per tile of tokens: tiles of 8 spill
// accumulators to the stack but pay the unpacking half as often (Zen 3, 64-token prefill: Q4_K
// +18%, Q6_K +9% against tiles of 4; tiles of 3, which fit the 16 registers, were 9% slower).
constexpr int kKQuantTokenTile = 8;

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

inline __m256i load(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

inline __m256i low_nibbles(__m256i bytes) {
  return _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
}
inline __m256i high_nibbles(__m256i bytes) {
  return _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
}

inline float reduce(__m256 v) {
  const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// Σ w x in 32-bit lanes for signed weight bytes (|w| times x with w's sign).
inline __m256i dot_signed(__m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// Σ scale * w x for unsigned weight bytes (< 64) and 16-bit scales per lane pair.
inline __m256i dot_scaled(__m256i w, __m256i x, __m256i scales) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scales);
}

// Two 8-lane registers' lanes folded pairwise: 128-bit lane L of the result holds, in 32-bit lane
// k, a partial sum of 4 lanes of a (k even) or b (k odd); see fold8.
inline __m256i fold_pair(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
// Eight registers of 8 int32 lanes summed lane-wise into one: lane j of the result is the sum of
// p[j]'s lanes, from the pairs fold_pair made of (p0, p1), (p2, p3), (p4, p5), (p6, p7). Exact.
inline __m256i fold8(__m256i p01, __m256i p23, __m256i p45, __m256i p67) {
  const __m256i low = _mm256_add_epi32(_mm256_unpacklo_epi64(p01, p23),
                                       _mm256_unpackhi_epi64(p01, p23));  // p0..p3 per lane
  const __m256i high =
      _mm256_add_epi32(_mm256_unpacklo_epi64(p45, p67), _mm256_unpackhi_epi64(p45, p67));  // p4..p7
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                          _mm256_permute2x128_si256(low, high, 0x31));
}

// Q8_0 and Q4_0, a group of 8 blocks at a time: each block's integer sum is folded into lane j
// of one register (fold8), so that a group costs one conversion and one multiply-add per token
// with the 8 blocks' scales (d_w d_x, 8 at once) where each block cost a conversion, a scalar
// product, a broadcast and a multiply-add, and the multiply-adds of a token no longer wait on one
// another block after block. The blocks past the last whole group, one at a time, lane-wise.
// One row of a tile of tokens: start(row) starts it, step(g) adds group g, finish() adds the
// blocks past the last group and writes y.
// Decode's kernels read rows in lockstep groups of this many, for tiles of at most this many
// tokens.
constexpr int kLockstepRows = 8;
constexpr int kLockstepTokens = 2;

// What run_rows' row kernels (Q8Row, Q6Row) hold for one row and a tile of kTokens tokens: where
// the row starts and one accumulator per token; store() writes the tile's sums of the row.
template <int kTokens>
struct RowSums {
  const uint8_t* row = nullptr;
  __m256 acc[kTokens];

  void start(const uint8_t* row_bytes) {
    row = row_bytes;
    for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  }
  template <class Tile>
  void store(const Tile& tile, float* y, int64_t y_stride, int64_t r) const {
    for (int t = 0; t < kTokens; ++t) y[(tile.first + t) * y_stride + r] = reduce(acc[t]);
  }
};

template <bool q8, int kTokens>
struct Q8Row : RowSums<kTokens> {
  static constexpr int64_t kBytes = q8 ? 34 : 18;
  using RowSums<kTokens>::row;
  using RowSums<kTokens>::acc;

  template <class Tile>
  __attribute__((always_inline)) void step(const Tile& tile, int64_t g, int64_t ahead) {
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* group = row + 8 * g * kBytes;
    // Batches take the helpers forced inline, decode as the compiler likes (q8_blocks_vector.h).
    constexpr bool kBatch = kTokens > kLockstepTokens;
    const __m256 dw =
        kBatch ? eight_block_scales_inlined(group, kBytes) : eight_block_scales(group, kBytes);
    __m256i pairs[4][kTokens];
    for (int p = 0; p < 4; ++p) {
      const uint8_t* block = group + 2 * p * kBytes;
      prefetch_ahead(block, 2 * kBytes, ahead);
      const __m256i q0 = kBatch ? q8_q4_0_weights_inlined<q8>(block) : q8_q4_0_weights<q8>(block);
      const __m256i q1 = kBatch ? q8_q4_0_weights_inlined<q8>(block + kBytes)
                                : q8_q4_0_weights<q8>(block + kBytes);
      const __m256i magnitude0 = _mm256_sign_epi8(q0, q0);
      const __m256i magnitude1 = _mm256_sign_epi8(q1, q1);
      for (int t = 0; t < kTokens; ++t) {
        const int8_t* xb = tile.q(t) + (8 * g + 2 * p) * 32;
        const __m256i s0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(magnitude0, _mm256_sign_epi8(load(xb), q0)), ones);
        const __m256i s1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(magnitude1, _mm256_sign_epi8(load(xb + 32), q1)), ones);
        pairs[p][t] = fold_pair(s0, s1);
      }
    }
    for (int t = 0; t < kTokens; ++t) {
      const __m256 scales = _mm256_mul_ps(dw, _mm256_loadu_ps(tile.scales(t) + 8 * g));
      const __m256i sums = fold8(pairs[0][t], pairs[1][t], pairs[2][t], pairs[3][t]);
      acc[t] = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(sums), acc[t]);
    }
  }

  template <class Tile>
  void finish(const Tile& tile, int64_t groups, int64_t blocks, float* y, int64_t y_stride,
              int64_t r) {
    for (int64_t b = 8 * groups; b < blocks; ++b) {
      const uint8_t* block = row + b * kBytes;
      const __m256i q = q8_q4_0_weights<q8>(block);
      const float d = half_at(block);
      for (int t = 0; t < kTokens; ++t) {
        const __m256i sums = dot_signed(q, load(tile.q(t) + b * 32));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * tile.scales(t)[b]), _mm256_cvtepi32_ps(sums),
                                 acc[t]);
      }
    }
    this->store(tile, y, y_stride, r);
  }
};

// Rows [first, last) of a run through Row's steps. For decode's tiles (at most kLockstepTokens
// tokens) kLockstepRows rows at a time in lockstep, step by step, each step also prefetching its
// share of the next rows' span (`step_bytes` a step): the strided order is one the hardware
// prefetchers do not follow, and the prefetches lead the whole stream (Zen 3, one token from
// memory: Q8_0 11.3-12.6 -> 12.7-17.2 GB/s). Each row's steps run in order, so its bits are those
// of a row read alone, which batches' tiles do.
template <template <int> class Row, class Tile>
__attribute__((always_inline)) inline void run_rows(const MatrixView& w, const Tile& tile,
                                                    int64_t first, int64_t last, int64_t steps,
                                                    int64_t step_bytes, int64_t ahead,
                                                    auto&& finish) {
  constexpr int tokens = Tile::kCount;
  int64_t r = first;
  if constexpr (tokens <= kLockstepTokens) {
    for (; r + kLockstepRows <= last; r += kLockstepRows) {
      Row<tokens> rows[kLockstepRows];
      for (int i = 0; i < kLockstepRows; ++i)
        rows[i].start(reinterpret_cast<const uint8_t*>(w.row(r + i)));
      const auto* next = reinterpret_cast<const uint8_t*>(w.row(r)) +
                         kLockstepRows * static_cast<int64_t>(w.row_bytes());
      for (int64_t s = 0; s < steps; ++s)
        for (int i = 0; i < kLockstepRows; ++i) {
          prefetch_lines(next + (s * kLockstepRows + i) * step_bytes, step_bytes);
          rows[i].step(tile, s, 0);
        }
      for (int i = 0; i < kLockstepRows; ++i) finish(rows[i], r + i);
    }
  }
  for (; r < last; ++r) {
    Row<tokens> row;
    row.start(reinterpret_cast<const uint8_t*>(w.row(r)));
    for (int64_t s = 0; s < steps; ++s) row.step(tile, s, ahead);
    finish(row, r);
  }
}

template <int kTokens>
using Q8_0Row = Q8Row<true, kTokens>;
template <int kTokens>
using Q4_0Row = Q8Row<false, kTokens>;

template <bool q8>
void rows_q8_q4_0(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                  int64_t row_begin, int64_t row_end) {
  const int64_t blocks = w.cols / 32, groups = blocks / 8, ahead = quant_prefetch_bytes();
  for_each_row_run<kTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        auto finish = [&](auto& row, int64_t r) {
          row.finish(tile, groups, blocks, y, y_stride, r);
        };
        if constexpr (q8)
          run_rows<Q8_0Row>(w, tile, first, last, groups, 8 * 34, ahead, finish);
        else
          run_rows<Q4_0Row>(w, tile, first, last, groups, 8 * 18, ahead, finish);
      });
}

// Byte-shuffle controls that fill each 128-bit lane with one 16-bit word of that lane (scales
// spread by one in-lane shuffle where a broadcast per scale from memory cost three operations):
// control k takes word 2k in the low lane and 2k + 1 in the high one.
struct WordControls {
  alignas(32) int8_t bytes[4][32];
};
constexpr WordControls word_pair_controls() {
  WordControls controls{};
  for (int k = 0; k < 4; ++k)
    for (int b = 0; b < 32; ++b)
      controls.bytes[k][b] = static_cast<int8_t>(2 * (2 * k + b / 16) + b % 2);
  return controls;
}
constexpr WordControls kWordPair = word_pair_controls();

inline __m256i spread_word(__m256i words, const WordControls& controls, int i) {
  return _mm256_shuffle_epi8(words, load(controls.bytes[i]));
}

// The 16-byte heads (d, dmin, the packed scales and mins: quant_matmul.h's k_scales) of a
// super-block of 8 rows, one row per 32-bit lane: four rows' heads in the 128-bit lanes of four
// registers and a 4x4 transpose of words inside each lane (lane r then holds row r). Rows past
// `rows` repeat the last one (the caller drops their lanes).
struct KHeads8 {
  __m256 d, dmin;
  __m256i min_pair[4];  // lane r: row r's mins 2p and 2p + 1 as 16-bit halves (for min_pairs)
  __m256i scales[2];    // [h] lane r: row r's scales 4h .. 4h + 3, one byte each
};

inline void gather_k_heads8(const uint8_t* heads, int64_t row_bytes, int rows, KHeads8& h) {
  auto head = [&](int r) {
    return _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(heads + (r < rows ? r : rows - 1) * row_bytes));
  };
  __m256i v[4];  // v[k]: the head of row k in the low lane, of row k + 4 in the high one
  for (int k = 0; k < 4; ++k)
    v[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(head(k)), head(k + 4), 1);
  const __m256i low01 = _mm256_unpacklo_epi32(v[0], v[1]),
                high01 = _mm256_unpackhi_epi32(v[0], v[1]),
                low23 = _mm256_unpacklo_epi32(v[2], v[3]),
                high23 = _mm256_unpackhi_epi32(v[2], v[3]);
  const __m256i d_dmin = _mm256_unpacklo_epi64(low01, low23);  // word 0 of each row: d, dmin
  const __m256i w0 = _mm256_unpackhi_epi64(low01, low23);      // packed bytes 0-3
  const __m256i w1 = _mm256_unpacklo_epi64(high01, high23);    // bytes 4-7
  const __m256i w2 = _mm256_unpackhi_epi64(high01, high23);    // bytes 8-11
  // The halves d (low) and dmin (high) of each lane gathered into 8 + 8 words, then converted.
  const __m256i halves = _mm256_permute4x64_epi64(
      _mm256_shuffle_epi8(
          d_dmin, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5,
                                   8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
      0xD8);
  h.d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  h.dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
  // Scales and mins 0-3: the low 6 bits of bytes 0-3 and 4-7; 4-7: low bits from the nibbles of
  // bytes 8-11, top two bits from the top of bytes 0-3 and 4-7.
  const __m256i k6 = _mm256_set1_epi32(0x3f3f3f3f), k4 = _mm256_set1_epi32(0x0f0f0f0f),
                k2 = _mm256_set1_epi32(0x03030303);
  h.scales[0] = _mm256_and_si256(w0, k6);
  h.scales[1] =
      _mm256_or_si256(_mm256_and_si256(w2, k4),
                      _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), k2), 4));
  const __m256i mins_low = _mm256_and_si256(w1, k6);
  const __m256i mins_high =
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), k4),
                      _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), k2), 4));
  const __m256i low_byte = _mm256_set1_epi32(0xFF), third_byte = _mm256_set1_epi32(0xFF0000);
  for (int half = 0; half < 2; ++half) {
    const __m256i m = half == 0 ? mins_low : mins_high;
    h.min_pair[2 * half] = _mm256_or_si256(_mm256_and_si256(m, low_byte),
                                           _mm256_and_si256(_mm256_slli_epi32(m, 8), third_byte));
    h.min_pair[2 * half + 1] =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(m, 16), low_byte),
                        _mm256_and_si256(_mm256_srli_epi32(m, 8), third_byte));
  }
}

// Byte-shuffle controls spreading scale k of a broadcast 4-byte word to every 16-bit lane.
struct ScaleBytes {
  __m256i control[4];
  ScaleBytes() {
    for (int k = 0; k < 4; ++k) control[k] = _mm256_set1_epi16(static_cast<int16_t>(0x8000 | k));
  }
};

// Q4_K and Q5_K, 8 rows at a time. Per super-block the 8 rows' heads are unpacked together
// (gather_k_heads8), each row's 256 weights are unpacked 32 at a time and multiplied by every token
// of the tile while in a register, and each (row, token)'s integer sums are folded into one lane
// of a register per token (fold8: lane r for row r) before anything is converted: the epilogue,
// d and dmin times the activation scale, the mins' products, a conversion and two multiply-adds,
// serves 8 rows where it served one, and each row's sum is exact until its one conversion per
// super-block. Every (row, token) takes the same integer sums and float steps in every tile and
// group, so decode and prefill agree bit for bit. Zen 3, moeline_quant_kernel_bench against the
// row-at-a-time kernel: one token from memory Q4_K 8.7 -> 10.6-11.0 GB/s; 64 tokens Q4_K 32-33 ->
// 33 GB/s-tokens, Q5_K 34-35 -> 40-41. The scales reach each row by a lane permute: broadcast
// from a stored copy they cost Q4_K's batches 5-15% (a wide store read back narrow).
template <bool fifth>
void rows_q45_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                int64_t row_begin, int64_t row_end) {
  const int64_t bytes = fifth ? 176 : 144, blocks = w.cols / 256;
  const auto row_bytes = static_cast<int64_t>(w.row_bytes());
  const int64_t pair_stride = w.cols / 64;
  const ScaleBytes spread;
  for_each_row_run<kKQuantTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
        const int32_t* min_pairs = x.min_pairs.data() + tile.first * pair_stride;
        for (int64_t r0 = first; r0 < last; r0 += 8) {
          const int rows = static_cast<int>(last - r0 < 8 ? last - r0 : 8);
          const auto* group = reinterpret_cast<const uint8_t*>(w.row(r0));
          // The 8 rows are one span read in a strided order, which the hardware prefetchers do
          // not follow: the next group's span is prefetched in step with this one (on the first
          // tile of tokens; the others find the rows in cache).
          const uint8_t* next_group = tile.first == 0 ? group + 8 * row_bytes : nullptr;
          __m256 acc[kKQuantTokenTile];
          for (int t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
          __m256i even[kKQuantTokenTile] = {};
          for (int64_t b = 0; b < blocks; ++b) {
            KHeads8 heads;
            gather_k_heads8(group + b * bytes, row_bytes, rows, heads);
            // Each row's sums stay in registers while it runs; an even row's wait for the next
            // one, and each pair is folded (fold_pair) as soon as both are done.
            __m256i folded[4][kKQuantTokenTile];
            for (int r = 0; r < 8; ++r) {
              const int row = r < rows ? r : rows - 1;
              const uint8_t* block = group + row * row_bytes + b * bytes;
              if (next_group) prefetch_lines(next_group + (b * 8 + r) * bytes, bytes);
              const uint8_t* qs = block + (fifth ? 48 : 16);
              const __m256i qh = fifth ? load(block + 16) : _mm256_setzero_si256();
              const __m256i lane = _mm256_set1_epi32(r);
              const __m256i scale_words[2] = {_mm256_permutevar8x32_epi32(heads.scales[0], lane),
                                              _mm256_permutevar8x32_epi32(heads.scales[1], lane)};
              __m256i sumi[kKQuantTokenTile];
              for (int t = 0; t < tokens; ++t) sumi[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
              for (int g = 0; g < 4; ++g) {  // 32 packed bytes: sub-blocks 2g (low), 2g + 1
                const __m256i packed = load(qs + 32 * g);
                __m256i low = low_nibbles(packed), high = high_nibbles(packed);
                if constexpr (fifth) {  // sub-block j's fifth bits: bit j of the qh bytes
                  const __m256i one = _mm256_set1_epi8(1);
                  low = _mm256_or_si256(
                      low,
                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
                  high = _mm256_or_si256(
                      high, _mm256_slli_epi16(
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
                }
                const __m256i scale_low =
                    _mm256_shuffle_epi8(scale_words[g / 2], spread.control[(2 * g) % 4]);
                const __m256i scale_high =
                    _mm256_shuffle_epi8(scale_words[g / 2], spread.control[(2 * g + 1) % 4]);
                for (int t = 0; t < tokens; ++t) {
                  const int8_t* xb = tile.q(t) + b * 256 + 64 * g;
                  sumi[t] = _mm256_add_epi32(sumi[t], dot_scaled(low, load(xb), scale_low));
                  sumi[t] = _mm256_add_epi32(sumi[t], dot_scaled(high, load(xb + 32), scale_high));
                }
              }
              if (r % 2 == 0) {
                for (int t = 0; t < tokens; ++t) even[t] = sumi[t];
              } else {
                for (int t = 0; t < tokens; ++t) folded[r / 2][t] = fold_pair(even[t], sumi[t]);
              }
            }
            for (int t = 0; t < tokens; ++t) {
              const __m256i sums = fold8(folded[0][t], folded[1][t], folded[2][t], folded[3][t]);
              // Σ_j m_j Σ_{i∈j} x_i, row by lane (|a 32-sum| ≤ 32 · 127 fits 16 bits).
              const int32_t* pairs = min_pairs + t * pair_stride + b * 4;
              __m256i mins = _mm256_madd_epi16(heads.min_pair[0], _mm256_set1_epi32(pairs[0]));
              for (int p = 1; p < 4; ++p)
                mins = _mm256_add_epi32(
                    mins, _mm256_madd_epi16(heads.min_pair[p], _mm256_set1_epi32(pairs[p])));
              const __m256 dx = _mm256_set1_ps(tile.scales(t)[b]);
              acc[t] =
                  _mm256_fmadd_ps(_mm256_mul_ps(heads.d, dx), _mm256_cvtepi32_ps(sums), acc[t]);
              acc[t] =
                  _mm256_fnmadd_ps(_mm256_mul_ps(heads.dmin, dx), _mm256_cvtepi32_ps(mins), acc[t]);
            }
          }
          for (int t = 0; t < tokens; ++t) {
            float* out = y + (tile.first + t) * y_stride + r0;
            if (rows == 8) {
              _mm256_storeu_ps(out, acc[t]);
            } else {
              alignas(32) float lanes[8];
              _mm256_store_ps(lanes, acc[t]);
              std::memcpy(out, lanes, static_cast<size_t>(rows) * sizeof(float));
            }
          }
        }
      });
}

// Q6_K. Per super-block of a row: the 16 scales spread by shuffles (two 16-weight sub-blocks per
// register, one per 128-bit lane), the weights' top two bits moved into place with one shift and
// one mask each, and each 32 weights multiplied by every token of the tile while in a register.
// One row of a tile of tokens: start(row), step(b) for super-block b, store() writes y.
template <int kTokens>
struct Q6Row : RowSums<kTokens> {
  using RowSums<kTokens>::row;
  using RowSums<kTokens>::acc;

  template <class Tile>
  __attribute__((always_inline)) void step(const Tile& tile, int64_t b, int64_t ahead) {
    const __m256i top_bits = _mm256_set1_epi8(0x30);
    const uint8_t* block = row + b * 210;
    prefetch_ahead(block, 210, ahead);
    const float d = half_at(block + 208);
    const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    // Scales 8h .. 8h + 7 as 16-bit words in both lanes of half_scales[h].
    const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes);
    const __m256i half_scales[2] = {_mm256_permute2x128_si256(scales16, scales16, 0x00),
                                    _mm256_permute2x128_si256(scales16, scales16, 0x11)};
    // The 16 scales as the low halves of 32-bit lanes (high halves zero), for madd_epi16.
    const __m256i low_halves = _mm256_set1_epi32(0xFFFF);
    const __m256i offset_low = _mm256_and_si256(_mm256_cvtepi8_epi32(scale_bytes), low_halves);
    const __m256i offset_high =
        _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_srli_si128(scale_bytes, 8)), low_halves);
    __m256i sumi[kTokens];
    for (int t = 0; t < kTokens; ++t) sumi[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i low0 = load(block + 64 * h), low1 = load(block + 64 * h + 32);
      const __m256i high = load(block + 128 + 32 * h);
      // Quarter k's top two bits are bits 2k, 2k + 1 of the high bytes, wanted at bits 4 and 5
      // (bits a 16-bit shift moves into the next byte fall outside the mask).
      const __m256i q[4] = {
          _mm256_or_si256(low_nibbles(low0),
                          _mm256_and_si256(_mm256_slli_epi16(high, 4), top_bits)),
          _mm256_or_si256(low_nibbles(low1),
                          _mm256_and_si256(_mm256_slli_epi16(high, 2), top_bits)),
          _mm256_or_si256(high_nibbles(low0), _mm256_and_si256(high, top_bits)),
          _mm256_or_si256(high_nibbles(low1),
                          _mm256_and_si256(_mm256_srli_epi16(high, 2), top_bits))};
      for (int k = 0; k < 4; ++k) {  // weights 128h + 32k: scales 8h + 2k and + 1
        const __m256i scales = spread_word(half_scales[h], kWordPair, k);
        for (int t = 0; t < kTokens; ++t)
          sumi[t] = _mm256_add_epi32(
              sumi[t], dot_scaled(q[k], load(tile.q(t) + b * 256 + 128 * h + 32 * k), scales));
      }
    }
    for (int t = 0; t < kTokens; ++t) {
      // Σ sc (q - 32) x = Σ sc q x - 32 Σ sc Σx, the offset taken lane by lane (sc_s times the
      // 16-sum s, which fits 16 bits) before converting.
      const int32_t* sums = tile.sums(t) + b * 16;
      const __m256i offset = _mm256_add_epi32(_mm256_madd_epi16(load(sums), offset_low),
                                              _mm256_madd_epi16(load(sums + 8), offset_high));
      const __m256i total = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(offset, 5));
      const float dx = tile.scales(t)[b];
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(total), acc[t]);
    }
  }
};

void rows_q6_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end) {
  const int64_t blocks = w.cols / 256, ahead = quant_prefetch_bytes();
  for_each_row_run<kKQuantTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        run_rows<Q6Row>(w, tile, first, last, blocks, 210, ahead,
                        [&](auto& row, int64_t r) { row.store(tile, y, y_stride, r); });
      });
}

}  // namespace

void quant_matmul_rows_avx2(const MatrixView& w, const QuantizedActivations& x, float* y,
                            int64_t y_stride, int64_t row_begin, int64_t row_end) {
  switch (w.dtype) {
    case DType::kQ8_0:
      return rows_q8_q4_0<true>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ4_0:
      return rows_q8_q4_0<false>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ4_K:
      return rows_q45_k<false>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ5_K:
      return rows_q45_k<true>(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ6_K:
      return rows_q6_k(w, x, y, y_stride, row_begin, row_end);
    default:
      return quant_matmul_rows_portable(w, x, y, y_stride, row_begin, row_end);
  }
}

}  // namespace moeline::kernels::detail
