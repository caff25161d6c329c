// AVX-512 path of the fast quantized matmul (quant_matmul.h): the AVX2 path's arithmetic on
// 64 weights per instruction. Two sub-blocks (or two Q8_0/Q4_0 blocks) share a register: maddubs
// gives 32 16-bit pair sums, a madd with the two sub-blocks' scales spread over their halves
// gives 16 32-bit sums, and a super-block is converted and scaled once.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "kernels/cpu/quant_matmul.h"

// quant_matmul_avx512_vnni.cpp compiles this file again with AVX512_VNNI under another name.
#ifndef MOELINE_QUANT_AVX512_ENTRY
#define MOELINE_QUANT_AVX512_ENTRY quant_matmul_rows_avx512
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

inline int u16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
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
inline __m256i low_nibbles(__m256i b) {
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}
inline __m256i high_nibbles(__m256i b) {
  return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
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

// Lane i of a madd result covers weights 2i, 2i+1: index i / (lanes per scale).
__m512i scale_index(int lanes_per_scale, int first) {
  alignas(64) int16_t index[32];
  for (int i = 0; i < 32; ++i) index[i] = static_cast<int16_t>(first + i / lanes_per_scale);
  return _mm512_load_si512(index);
}

void rows_q8_q4_0(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                  int64_t row_begin, int64_t row_end) {
  const bool q8 = w.dtype == DType::kQ8_0;
  const int64_t bytes = q8 ? 34 : 18, blocks = w.cols / 32;
  auto weights = [&](const uint8_t* block) {
    if (q8) return load256(block + 2);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_sub_epi8(low_nibbles(both), _mm256_set1_epi8(8));
  };
  __m512i pair_index[4];  // lanes 0-7: block 2p of a group of 8, lanes 8-15: block 2p + 1
  for (int p = 0; p < 4; ++p)
    pair_index[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
    for_each_token_tile<kTokenTile>(x, [&](const auto& tile) {
      constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
      __m512 acc[kTokenTile];
      for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
      int64_t b = 0;
      // Groups of 8 blocks: their weight scales converted together and multiplied by each
      // token's 8 activation scales in one instruction (the same products d_w * d_x as the
      // pairs below compute one by one, so a row's result does not depend on the route).
      for (; b + 8 <= blocks; b += 8) {
        const uint8_t* group = row + b * bytes;
        __m128i bits = _mm_cvtsi32_si128(u16_at(group));
        bits = _mm_insert_epi16(bits, u16_at(group + bytes), 1);
        bits = _mm_insert_epi16(bits, u16_at(group + 2 * bytes), 2);
        bits = _mm_insert_epi16(bits, u16_at(group + 3 * bytes), 3);
        bits = _mm_insert_epi16(bits, u16_at(group + 4 * bytes), 4);
        bits = _mm_insert_epi16(bits, u16_at(group + 5 * bytes), 5);
        bits = _mm_insert_epi16(bits, u16_at(group + 6 * bytes), 6);
        bits = _mm_insert_epi16(bits, u16_at(group + 7 * bytes), 7);
        const __m256 dw = _mm256_cvtph_ps(bits);
        __m512 scales[kTokenTile];
        for (int t = 0; t < tokens; ++t)
          scales[t] =
              _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(tile.scales(t) + b)));
        for (int p = 0; p < 4; ++p) {
          const uint8_t* first = group + 2 * p * bytes;
          prefetch_ahead(first, 2 * bytes);
          const __m512i q = join(weights(first), weights(first + bytes));
          for (int t = 0; t < tokens; ++t) {
            const __m512i sums = dot_signed(q, load512(tile.q(t) + (b + 2 * p) * 32));
            acc[t] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pair_index[p], scales[t]),
                                     _mm512_cvtepi32_ps(sums), acc[t]);
          }
        }
      }
      for (; b + 2 <= blocks; b += 2) {
        const uint8_t* first = row + b * bytes;
        prefetch_ahead(first, 2 * bytes);
        const __m512i q = join(weights(first), weights(first + bytes));
        const float d0 = half_at(first), d1 = half_at(first + bytes);
        for (int t = 0; t < tokens; ++t) {
          const float* dx = tile.scales(t) + b;
          const __m512i sums = dot_signed(q, load512(tile.q(t) + b * 32));
          const __m512 scale =
              _mm512_insertf32x8(_mm512_set1_ps(d0 * dx[0]), _mm256_set1_ps(d1 * dx[1]), 1);
          acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc[t]);
        }
      }
      for (; b < blocks; ++b) {  // an odd last block, in the low half
        const uint8_t* block = row + b * bytes;
        const __m512i q = _mm512_castsi256_si512(weights(block));
        const float d = half_at(block);
        for (int t = 0; t < tokens; ++t) {
          const __m512i xq = _mm512_castsi256_si512(load256(tile.q(t) + b * 32));
          const __m512i sums =
              dot_signed(_mm512_maskz_mov_epi64(0x0F, q), _mm512_maskz_mov_epi64(0x0F, xq));
          acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * tile.scales(t)[b]), _mm512_cvtepi32_ps(sums),
                                   acc[t]);
        }
      }
      for (int t = 0; t < tokens; ++t)
        y[(tile.first + t) * y_stride + r] = _mm512_reduce_add_ps(acc[t]);
    });
  }
}

void rows_q45_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
                int64_t row_begin, int64_t row_end) {
  const bool fifth = w.dtype == DType::kQ5_K;
  const int64_t bytes = fifth ? 176 : 144, blocks = w.cols / 256;
  __m512i index[4];  // sub-blocks 2g and 2g+1: 16 lanes each
  for (int g = 0; g < 4; ++g) index[g] = scale_index(16, 2 * g);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
    for_each_token_tile<kTokenTile>(x, [&](const auto& tile) {
      constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
      __m512 acc[kTokenTile];
      for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = row + b * bytes;
        prefetch_ahead(block, bytes);
        uint8_t packed_scales[16];
        k_scales(block + 4, packed_scales);
        const __m128i scale_bytes =
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed_scales));
        const __m128i scales16 = _mm_cvtepu8_epi16(scale_bytes);
        const float d = half_at(block), dmin = half_at(block + 2);
        // Each min beside the two 16-sums of its sub-block, one per 32-bit lane with its high
        // half zero, so a madd_epi16 with the (small) sums multiplies them exactly.
        const __m512i mins = _mm512_cvtepu8_epi32(
            _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed_scales + 8)),
                             _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
        const uint8_t* qs = block + (fifth ? 48 : 16);
        const __m256i qh = fifth ? load256(block + 16) : _mm256_setzero_si256();
        __m512i q[4], sc[4];
        for (int g = 0; g < 4; ++g) {
          const __m256i packed = load256(qs + 32 * g);
          __m256i lo = low_nibbles(packed), hi = high_nibbles(packed);
          if (fifth) {
            const __m256i one = _mm256_set1_epi8(1);
            lo = _mm256_or_si256(
                lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
            hi = _mm256_or_si256(
                hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
          }
          q[g] = join(lo, hi);
          sc[g] = spread(scales16, index[g]);
        }
        for (int t = 0; t < tokens; ++t) {
          const int8_t* xb = tile.q(t) + b * 256;
          __m512i sumi = _mm512_setzero_si512();
          for (int g = 0; g < 4; ++g)
            sumi = add_scaled_pairs(sumi, _mm512_maddubs_epi16(q[g], load512(xb + 64 * g)), sc[g]);
          // Σ_j m_j Σ_{i∈j} x_i, lane by lane (|a 16-sum| ≤ 16 · 127 fits 16 bits).
          const __m512i summ = _mm512_madd_epi16(load512(tile.sums(t) + b * 16), mins);
          const float dx = tile.scales(t)[b];
          acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(sumi), acc[t]);
          acc[t] = _mm512_fnmadd_ps(_mm512_set1_ps(dmin * dx), _mm512_cvtepi32_ps(summ), acc[t]);
        }
      }
      for (int t = 0; t < tokens; ++t)
        y[(tile.first + t) * y_stride + r] = _mm512_reduce_add_ps(acc[t]);
    });
  }
}

void rows_q6_k(const MatrixView& w, const QuantizedActivations& x, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end) {
  const int64_t blocks = w.cols / 256;
  // 16-bit shift counts per 256-bit half that bring quarter k's two top bits (2k, 2k+1) to bits
  // 4, 5: left by 4 | 2 for quarters 0 | 1, right by 0 | 2 for quarters 2 | 3.
  const __m512i shift01 = join(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
  const __m512i shift23 = join(_mm256_set1_epi16(0), _mm256_set1_epi16(2));
  __m512i index[4];  // quarters (2p, 2p+1) of a half: four 16-weight scales, 8 lanes each
  for (int p = 0; p < 4; ++p) index[p] = scale_index(8, 4 * p);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
    for_each_token_tile<kTokenTile>(x, [&](const auto& tile) {
      constexpr int tokens = std::remove_cvref_t<decltype(tile)>::kCount;
      __m512 acc[kTokenTile];
      for (int t = 0; t < tokens; ++t) acc[t] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = row + b * 210;
        prefetch_ahead(block, 210);
        const auto* sc8 = reinterpret_cast<const int8_t*>(block + 192);
        const __m256i scales16 =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc8)));
        const float d = half_at(block + 208);
        __m512i q[4], sc[4];  // pairs of quarters: weights 64p .. 64p + 63
        for (int h = 0; h < 2; ++h) {
          // 64 low-bit bytes: their low nibbles are quarters 0 and 1 of the half (weights 0-63),
          // their high nibbles quarters 2 and 3; quarter k's top two bits are bits 2k, 2k+1 of
          // the half's 32 high-bit bytes, moved to bits 4, 5 (bits that cross into the next byte
          // of a 16-bit lane fall outside the 0x30 mask).
          const __m512i low = load512(block + 64 * h);
          const __m512i high = _mm512_broadcast_i64x4(load256(block + 128 + 32 * h));
          const __m512i nibble = _mm512_set1_epi8(0x0F), top_bits = _mm512_set1_epi8(0x30);
          const __m512i top01 = _mm512_and_si512(_mm512_sllv_epi16(high, shift01), top_bits);
          const __m512i top23 = _mm512_and_si512(_mm512_srlv_epi16(high, shift23), top_bits);
          q[2 * h] = _mm512_or_si512(_mm512_and_si512(low, nibble), top01);
          q[2 * h + 1] =
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble), top23);
          const __m128i half_scales =
              h == 0 ? _mm256_castsi256_si128(scales16) : _mm256_extracti128_si256(scales16, 1);
          sc[2 * h] = spread(half_scales, index[0]);
          sc[2 * h + 1] = spread(half_scales, index[1]);
        }
        // Σ sc (q - 32) x = Σ sc q x + Σ_s (-32 sc_s) Σ_{i∈s} x_i: the offset taken lane by lane,
        // -32 sc_s (|.| ≤ 4096) as the low half of a 32-bit lane with the high half zero, so that
        // a madd with the activations' 16-sums (which fit 16 bits) multiplies the two exactly.
        const __m512i scales32 =
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc8)));
        const __m512i offset_scale = _mm512_and_si512(
            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(scales32, 5)),
            _mm512_set1_epi32(0xFFFF));
        for (int t = 0; t < tokens; ++t) {
          const int8_t* xb = tile.q(t) + b * 256;
          __m512i sumi = _mm512_setzero_si512();
          for (int p = 0; p < 4; ++p)
            sumi = add_scaled_pairs(sumi, _mm512_maddubs_epi16(q[p], load512(xb + 64 * p)), sc[p]);
          sumi = add_scaled_pairs(sumi, load512(tile.sums(t) + b * 16), offset_scale);
          const float dx = tile.scales(t)[b];
          acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(sumi), acc[t]);
        }
      }
      for (int t = 0; t < tokens; ++t)
        y[(tile.first + t) * y_stride + r] = _mm512_reduce_add_ps(acc[t]);
    });
  }
}

}  // namespace

void MOELINE_QUANT_AVX512_ENTRY(const MatrixView& w, const QuantizedActivations& x, float* y,
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
