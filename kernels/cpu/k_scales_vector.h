#pragma once
// A K-quant super-block's scales and mins unpacked in one SSSE3 register, for the AVX-512 kernels
// (only translation units compiled with those instructions include this; the AVX2 kernels unpack
// the heads of 8 rows at once instead).
#include <immintrin.h>

#include <cstdint>

namespace moeline::kernels::detail {

// k_scales (quant_matmul.h) in one register: bytes 0-7 the scales, 8-15 the mins. Reads 16 bytes
// from `packed` (the 12 packed bytes and 4 of the weights after them). Scalar unpacking through
// memory cost a Q4_K decode about a fifth of its time (and its stores stall the loads after them).
inline __m128i k_scales_vector(const uint8_t* packed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  // Low bits: scales 0-3 and mins 0-3 are bytes 0-3 and 4-7 (6 bits); scales 4-7 the low nibbles
  // of bytes 8-11, mins 4-7 their high nibbles.
  const __m128i low_source =
      _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i low_mask = _mm_setr_epi8(0x3F, 0x3F, 0x3F, 0x3F, 0x0F, 0x0F, 0x0F, 0x0F, 0x3F, 0x3F,
                                         0x3F, 0x3F, 0, 0, 0, 0);
  const __m128i high_nibble_mask =
      _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0F, 0x0F, 0x0F, 0x0F);
  const __m128i low = _mm_or_si128(_mm_and_si128(low_source, low_mask),
                                   _mm_and_si128(_mm_srli_epi16(low_source, 4), high_nibble_mask));
  // Top two bits of scales and mins 4-7: bits 6-7 of bytes 0-3 and 4-7, moved to bits 4-5.
  const __m128i top_source =
      _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i top = _mm_and_si128(_mm_srli_epi16(top_source, 2), _mm_set1_epi8(0x30));
  return _mm_or_si128(low, top);
}

}  // namespace moeline::kernels::detail
