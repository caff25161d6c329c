// AVX2 path of the fast quantized matmul (quant_matmul.h). Each
// 32 weights become 32 bytes in one register; maddubs multiplies them (unsigned) with 32 signed
// activation bytes into 16-bit pairs, madd widens the pairs with the block's (sub-block) scales
// into 32-bit sums, and a whole block or super-block is converted to float and scaled once.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "kernels/cpu/k_scales_vector.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels::detail {
namespace {

constexpr int kTokenTile = 4;

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

void rows_q8_q4_0(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                  int64_t row_begin, int64_t row_end) {
  const bool q8 = w.dtype == DType::kQ8_0;
  const int64_t bytes = q8 ? 34 : 18, blocks = w.cols / 32, ahead = quant_prefetch_bytes();
  for_each_row_run<kTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
        for (int64_t r = first; r < last; ++r) {
          const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
          __m256 acc[kTokenTile];
          for (int t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = row + b * bytes;
            prefetch_ahead(block, bytes, ahead);
            __m256i q;
            if (q8) {
              q = load(block + 2);
            } else {
              const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
              const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
              q = _mm256_sub_epi8(low_nibbles(both), _mm256_set1_epi8(8));
            }
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

void rows_q45_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                int64_t row_begin, int64_t row_end) {
  const bool fifth = w.dtype == DType::kQ5_K;
  const int64_t bytes = fifth ? 176 : 144, blocks = w.cols / 256, ahead = quant_prefetch_bytes();
  for_each_row_run<kTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
        for (int64_t r = first; r < last; ++r) {
          const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
          __m256 acc[kTokenTile];
          for (int t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = row + b * bytes;
            prefetch_ahead(block, bytes, ahead);
            alignas(16) uint8_t scales[16];
            _mm_store_si128(reinterpret_cast<__m128i*>(scales), k_scales_vector(block + 4));
            const uint8_t* sc = scales;
            const uint8_t* mn = scales + 8;
            const float d = half_at(block), dmin = half_at(block + 2);
            // Each min beside the two 16-sums of its sub-block, one per 32-bit lane with its high
            // half zero, so a madd_epi16 with the (small) sums multiplies them exactly.
            const __m128i min_pairs =
                _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)),
                                 _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
            const __m256i mins_low = _mm256_cvtepu8_epi32(min_pairs);
            const __m256i mins_high = _mm256_cvtepu8_epi32(_mm_srli_si128(min_pairs, 8));
            // The super-block's 256 weights as eight registers of 32 (0-15 or 0-31).
            __m256i q[8];
            const uint8_t* qs = block + (fifth ? 48 : 16);
            const __m256i qh = fifth ? load(block + 16) : _mm256_setzero_si256();
            for (int g = 0; g < 4; ++g) {
              const __m256i packed = load(qs + 32 * g);
              q[2 * g] = low_nibbles(packed);
              q[2 * g + 1] = high_nibbles(packed);
              if (fifth) {
                const __m256i one = _mm256_set1_epi8(1);
                const __m256i bit_lo =
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one);  // bit 2g of each byte
                const __m256i bit_hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one);
                q[2 * g] = _mm256_or_si256(q[2 * g], _mm256_slli_epi16(bit_lo, 4));
                q[2 * g + 1] = _mm256_or_si256(q[2 * g + 1], _mm256_slli_epi16(bit_hi, 4));
              }
            }
            for (int t = 0; t < tokens; ++t) {
              const int8_t* xb = tile.q(t) + b * 256;
              __m256i sumi = _mm256_setzero_si256();
              for (int j = 0; j < 8; ++j)
                sumi = _mm256_add_epi32(sumi,
                                        dot_scaled(q[j], load(xb + 32 * j),
                                                   _mm256_set1_epi16(static_cast<short>(sc[j]))));
              // Σ_j m_j Σ_{i∈j} x_i, lane by lane (|a 16-sum| ≤ 16 · 127 fits 16 bits).
              const int32_t* sums = tile.sums(t) + b * 16;
              const __m256i summ = _mm256_add_epi32(_mm256_madd_epi16(load(sums), mins_low),
                                                    _mm256_madd_epi16(load(sums + 8), mins_high));
              const float dx = tile.scales(t)[b];
              acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc[t]);
              acc[t] =
                  _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(summ), acc[t]);
            }
          }
          for (int t = 0; t < tokens; ++t) y[(tile.first + t) * y_stride + r] = reduce(acc[t]);
        }
      });
}

void rows_q6_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end) {
  const int64_t blocks = w.cols / 256, ahead = quant_prefetch_bytes();
  const __m256i mask2 = _mm256_set1_epi8(3);
  for_each_row_run<kTokenTile>(
      x, row_begin, row_end, [&](const auto& tile, int64_t first, int64_t last) {
        constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
        for (int64_t r = first; r < last; ++r) {
          const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
          __m256 acc[kTokenTile];
          for (int t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = row + b * 210;
            prefetch_ahead(block, 210, ahead);
            const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
            const float d = half_at(block + 208);
            // The 16 scales as the low halves of 32-bit lanes (high halves zero), for madd_epi16.
            const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
            const __m256i low_halves = _mm256_set1_epi32(0xFFFF);
            const __m256i offset_low =
                _mm256_and_si256(_mm256_cvtepi8_epi32(scale_bytes), low_halves);
            const __m256i offset_high =
                _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_srli_si128(scale_bytes, 8)), low_halves);
            __m256i q[8], scales[8];  // weights 32k .. 32k + 31 and their two 16-weight scales
            for (int h = 0; h < 2; ++h) {
              const __m256i low0 = load(block + 64 * h), low1 = load(block + 64 * h + 32);
              const __m256i high = load(block + 128 + 32 * h);
              const __m256i parts[4] = {low_nibbles(low0), low_nibbles(low1), high_nibbles(low0),
                                        high_nibbles(low1)};
              for (int k = 0; k < 4; ++k) {
                const __m256i top =
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * k), mask2), 4);
                q[4 * h + k] = _mm256_or_si256(parts[k], top);
                const int s = 8 * h + 2 * k;
                scales[4 * h + k] =
                    _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
              }
            }
            for (int t = 0; t < tokens; ++t) {
              const int8_t* xb = tile.q(t) + b * 256;
              __m256i sumi = _mm256_setzero_si256();
              for (int j = 0; j < 8; ++j)
                sumi = _mm256_add_epi32(sumi, dot_scaled(q[j], load(xb + 32 * j), scales[j]));
              // Σ sc (q - 32) x = Σ sc q x - 32 Σ sc Σx, the offset taken lane by lane (sc_s times
              // the 16-sum s, which fits 16 bits) before converting.
              const int32_t* sums = tile.sums(t) + b * 16;
              const __m256i offset =
                  _mm256_add_epi32(_mm256_madd_epi16(load(sums), offset_low),
                                   _mm256_madd_epi16(load(sums + 8), offset_high));
              sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
              const float dx = tile.scales(t)[b];
              acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc[t]);
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
    case DType::kQ4_0:
      return rows_q8_q4_0(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ4_K:
    case DType::kQ5_K:
      return rows_q45_k(w, x, y, y_stride, row_begin, row_end);
    case DType::kQ6_K:
      return rows_q6_k(w, x, y, y_stride, row_begin, row_end);
    default:
      return quant_matmul_rows_portable(w, x, y, y_stride, row_begin, row_end);
  }
}

}  // namespace moeline::kernels::detail
