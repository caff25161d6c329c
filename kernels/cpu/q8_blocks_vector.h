#pragma once
// Q8_0 and Q4_0 blocks (34 or 18 bytes: an F16 scale, then 32 weights) in registers, for the AVX2
// and AVX-512 paths (only translation units compiled with AVX2 and F16C include this).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace moeline::kernels::detail {

// A block's 32 weights as signed bytes: Q8_0's as stored, Q4_0's nibbles less 8 (the low nibbles
// are weights 0-15, the high ones 16-31).
template <bool q8>
__attribute__((always_inline)) inline __m256i q8_q4_0_weights_inlined(const uint8_t* block) {
  if constexpr (q8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
}

// The F16 scales of 8 consecutive blocks, `block_bytes` apart, as 8 floats.
__attribute__((always_inline)) inline __m256 eight_block_scales_inlined(const uint8_t* first_block,
                                                                        int64_t block_bytes) {
  auto bits_at = [&](int i) {
    uint16_t bits;
    std::memcpy(&bits, first_block + i * block_bytes, sizeof bits);
    return static_cast<int>(bits);
  };
  __m128i bits = _mm_cvtsi32_si128(bits_at(0));
  bits = _mm_insert_epi16(bits, bits_at(1), 1);
  bits = _mm_insert_epi16(bits, bits_at(2), 2);
  bits = _mm_insert_epi16(bits, bits_at(3), 3);
  bits = _mm_insert_epi16(bits, bits_at(4), 4);
  bits = _mm_insert_epi16(bits, bits_at(5), 5);
  bits = _mm_insert_epi16(bits, bits_at(6), 6);
  bits = _mm_insert_epi16(bits, bits_at(7), 7);
  return _mm256_cvtph_ps(bits);
}

// The same, inlining left to the compiler: the AVX2 one-token kernels run faster calling them
// (Zen 3: Q8_0 from memory 15-18 GB/s against 5-7 with them forced inline), its batch kernels
// slower (38-39 GB/s x tokens against 42-43).
template <bool q8>
inline __m256i q8_q4_0_weights(const uint8_t* block) {
  return q8_q4_0_weights_inlined<q8>(block);
}
inline __m256 eight_block_scales(const uint8_t* first_block, int64_t block_bytes) {
  return eight_block_scales_inlined(first_block, block_bytes);
}

}  // namespace moeline::kernels::detail
