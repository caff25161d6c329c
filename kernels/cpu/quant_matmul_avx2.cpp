// AVX2 path of the fast quantized matmul (quant_matmul.h). Each
// 32 weights become 32 bytes in one register; maddubs multiplies them (unsigned) with 32 signed
// activation bytes into 16-bit pairs, madd widens the pairs with the block's (sub-block) scales
// into 32-bit sums, and a whole block or super-block is converted to float and scaled once.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "kernels/cpu/k_scales_vector.h"
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
template <bool q8>
void rows_q8_q4_0(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                  int64_t row_begin, int64_t row_end) {
  constexpr int64_t kBytes = q8 ? 34 : 18;
  const int64_t blocks = w.cols / 32, groups = blocks / 8, ahead = quant_prefetch_bytes();
  const __m256i ones = _mm256_set1_epi16(1);
  for_each_row_run<kTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
        for (int64_t r = first; r < last; ++r) {
          const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
          __m256 acc[kTokenTile];
          for (int t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t g = 0; g < groups; ++g) {
            const uint8_t* group = row + 8 * g * kBytes;
            const __m256 dw = eight_block_scales(group, kBytes);
            __m256i pairs[4][kTokenTile];
            for (int p = 0; p < 4; ++p) {
              const uint8_t* block = group + 2 * p * kBytes;
              prefetch_ahead(block, 2 * kBytes, ahead);
              const __m256i q0 = q8_q4_0_weights<q8>(block),
                            q1 = q8_q4_0_weights<q8>(block + kBytes);
              const __m256i magnitude0 = _mm256_sign_epi8(q0, q0);
              const __m256i magnitude1 = _mm256_sign_epi8(q1, q1);
              for (int t = 0; t < tokens; ++t) {
                const int8_t* xb = tile.q(t) + (8 * g + 2 * p) * 32;
                const __m256i s0 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude0, _mm256_sign_epi8(load(xb), q0)), ones);
                const __m256i s1 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude1, _mm256_sign_epi8(load(xb + 32), q1)), ones);
                pairs[p][t] = fold_pair(s0, s1);
              }
            }
            for (int t = 0; t < tokens; ++t) {
              const __m256 scales = _mm256_mul_ps(dw, _mm256_loadu_ps(tile.scales(t) + 8 * g));
              const __m256i sums = fold8(pairs[0][t], pairs[1][t], pairs[2][t], pairs[3][t]);
              acc[t] = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(sums), acc[t]);
            }
          }
          for (int64_t b = 8 * groups; b < blocks; ++b) {
            const uint8_t* block = row + b * kBytes;
            const __m256i q = q8_q4_0_weights<q8>(block);
            const float d = half_at(block);
            for (int t = 0; t < tokens; ++t) {
              const __m256i sums = dot_signed(q, load(tile.q(t) + b * 32));
              acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * tile.scales(t)[b]),
                                       _mm256_cvtepi32_ps(sums), acc[t]);
            }
          }
          for (int t = 0; t < tokens; ++t) y[(tile.first + t) * y_stride + r] = reduce(acc[t]);
        }
      });
}

// Byte-shuffle controls that fill each 128-bit lane with one 16-bit word of that lane (scales
// spread by one in-lane shuffle where a broadcast per scale from memory cost three operations):
// control i of kSameWord takes word i in both lanes, control k of kWordPair word 2k in the low
// lane and 2k + 1 in the high one.
struct WordControls {
  alignas(32) int8_t bytes[8][32];
};
constexpr WordControls word_controls(bool pair) {
  WordControls controls{};
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 32; ++b) {
      const int word = pair ? 2 * (i % 4) + b / 16 : i;
      controls.bytes[i][b] = static_cast<int8_t>(2 * word + b % 2);
    }
  return controls;
}
constexpr WordControls kSameWord = word_controls(false);
constexpr WordControls kWordPair = word_controls(true);

inline __m256i spread_word(__m256i words, const WordControls& controls, int i) {
  return _mm256_shuffle_epi8(words, load(controls.bytes[i]));
}

// Q4_K and Q5_K. Per super-block of a row: its scales spread by shuffles, its 256 weights unpacked
// 32 at a time and multiplied by every token of the tile while in a register (no spills of eight
// unpacked registers); the mins' products taken from QuantizedActivations::min_pairs (the
// activations' sums of two sub-blocks as 16-bit halves), one madd for the eight mins.
template <bool fifth>
void rows_q45_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                int64_t row_begin, int64_t row_end) {
  const int64_t bytes = fifth ? 176 : 144, blocks = w.cols / 256, ahead = quant_prefetch_bytes();
  const int64_t pair_stride = w.cols / 64;
  for_each_row_run<kKQuantTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
        const int32_t* min_pairs = x.min_pairs.data() + tile.first * pair_stride;
        for (int64_t r = first; r < last; ++r) {
          const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
          __m256 acc[kKQuantTokenTile];
          for (int t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = row + b * bytes;
            prefetch_ahead(block, bytes, ahead);
            const __m128i scales_mins = k_scales_vector(block + 4);
            const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales_mins));
            // Mins 2p and 2p + 1 as the two 16-bit halves of 32-bit lane p, as min_pairs holds
            // the sums they multiply.
            const __m128i mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(scales_mins, scales_mins));
            const float d = half_at(block), dmin = half_at(block + 2);
            const uint8_t* qs = block + (fifth ? 48 : 16);
            const __m256i qh = fifth ? load(block + 16) : _mm256_setzero_si256();
            __m256i sumi[kKQuantTokenTile];
            for (int t = 0; t < tokens; ++t) sumi[t] = _mm256_setzero_si256();
            for (int g = 0; g < 4; ++g) {  // 32 packed bytes: sub-blocks 2g (low) and 2g + 1
              const __m256i packed = load(qs + 32 * g);
              __m256i low = low_nibbles(packed), high = high_nibbles(packed);
              if constexpr (fifth) {  // sub-block j's fifth bits: bit j of the 32 high-bit bytes
                const __m256i one = _mm256_set1_epi8(1);
                low = _mm256_or_si256(
                    low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
                high = _mm256_or_si256(
                    high,
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
              }
              const __m256i scale_low = spread_word(scales, kSameWord, 2 * g);
              const __m256i scale_high = spread_word(scales, kSameWord, 2 * g + 1);
              for (int t = 0; t < tokens; ++t) {
                const int8_t* xb = tile.q(t) + b * 256 + 64 * g;
                sumi[t] = _mm256_add_epi32(sumi[t], dot_scaled(low, load(xb), scale_low));
                sumi[t] = _mm256_add_epi32(sumi[t], dot_scaled(high, load(xb + 32), scale_high));
              }
            }
            for (int t = 0; t < tokens; ++t) {
              // Σ_j m_j Σ_{i∈j} x_i in four lanes (|a 32-sum| ≤ 32 · 127 fits 16 bits).
              const __m128i pairs = _mm_loadu_si128(
                  reinterpret_cast<const __m128i*>(min_pairs + t * pair_stride + b * 4));
              const __m256i summ = _mm256_zextsi128_si256(_mm_madd_epi16(pairs, mins));
              const float dx = tile.scales(t)[b];
              acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
              acc[t] =
                  _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(summ), acc[t]);
            }
          }
          for (int t = 0; t < tokens; ++t) y[(tile.first + t) * y_stride + r] = reduce(acc[t]);
        }
      });
}

// Q6_K. Per super-block of a row: the 16 scales spread by shuffles (two 16-weight sub-blocks per
// register, one per 128-bit lane), the weights' top two bits moved into place with one shift and
// one mask each, and each 32 weights multiplied by every token of the tile while in a register.
void rows_q6_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end) {
  const int64_t blocks = w.cols / 256, ahead = quant_prefetch_bytes();
  const __m256i top_bits = _mm256_set1_epi8(0x30);
  for_each_row_run<kKQuantTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
        for (int64_t r = first; r < last; ++r) {
          const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
          __m256 acc[kKQuantTokenTile];
          for (int t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = row + b * 210;
            prefetch_ahead(block, 210, ahead);
            const float d = half_at(block + 208);
            const __m128i scale_bytes =
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
            // Scales 8h .. 8h + 7 as 16-bit words in both lanes of half_scales[h].
            const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes);
            const __m256i half_scales[2] = {_mm256_permute2x128_si256(scales16, scales16, 0x00),
                                            _mm256_permute2x128_si256(scales16, scales16, 0x11)};
            // The 16 scales as the low halves of 32-bit lanes (high halves zero), for madd_epi16.
            const __m256i low_halves = _mm256_set1_epi32(0xFFFF);
            const __m256i offset_low =
                _mm256_and_si256(_mm256_cvtepi8_epi32(scale_bytes), low_halves);
            const __m256i offset_high =
                _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_srli_si128(scale_bytes, 8)), low_halves);
            __m256i sumi[kKQuantTokenTile];
            for (int t = 0; t < tokens; ++t) sumi[t] = _mm256_setzero_si256();
            for (int h = 0; h < 2; ++h) {
              const __m256i low0 = load(block + 64 * h), low1 = load(block + 64 * h + 32);
              const __m256i high = load(block + 128 + 32 * h);
              // Quarter k's top two bits are bits 2k, 2k + 1 of the high bytes, wanted at bits 4
              // and 5 (bits a 16-bit shift moves into the next byte fall outside the mask).
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
                for (int t = 0; t < tokens; ++t)
                  sumi[t] = _mm256_add_epi32(
                      sumi[t],
                      dot_scaled(q[k], load(tile.q(t) + b * 256 + 128 * h + 32 * k), scales));
              }
            }
            for (int t = 0; t < tokens; ++t) {
              // Σ sc (q - 32) x = Σ sc q x - 32 Σ sc Σx, the offset taken lane by lane (sc_s times
              // the 16-sum s, which fits 16 bits) before converting.
              const int32_t* sums = tile.sums(t) + b * 16;
              const __m256i offset =
                  _mm256_add_epi32(_mm256_madd_epi16(load(sums), offset_low),
                                   _mm256_madd_epi16(load(sums + 8), offset_high));
              const __m256i total = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(offset, 5));
              const float dx = tile.scales(t)[b];
              acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(total), acc[t]);
            }
          }
          for (int t = 0; t < tokens; ++t) y[(tile.first + t) * y_stride + r] = reduce(acc[t]);
        }
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
