// AVX2 forms of the element-wise ops whose scalar exp dominated them (ops.cpp dispatches), and of
// the fast quantized matmul's activation quantizing (quant_matmul.cpp dispatches).
#include <immintrin.h>

#include "kernels/cpu/exp_avx2.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels::detail {
namespace {

inline int32_t sum_lanes(__m256i v) {
  __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
  return _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 1)));
}

}  // namespace

// gate / (1 + e^-gate) * up, 8 values at a time (the last few through a zero-padded copy); each
// value's result depends on it alone.
void silu_mul_avx2(float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  auto silu_mul8 = [&](__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(gate + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    alignas(32) float g[8] = {}, u[8] = {};
    for (int64_t k = i; k < n; ++k) {
      g[k - i] = gate[k];
      u[k - i] = up[k];
    }
    _mm256_store_ps(g, silu_mul8(_mm256_load_ps(g), _mm256_load_ps(u)));
    for (int64_t k = i; k < n; ++k) gate[k] = g[k - i];
  }
}

// The scalar form's steps on 8 values at a time, as quantize_activation_row_avx512 takes them on
// 16: the block maximum (max with the new value first, so a NaN is skipped as std::max skips it),
// the same division and product, the conversion to nearest even, and the low byte of each 32-bit
// result (the scalar cast: a NaN's INT_MIN becomes 0 in both); sums of those bytes.
void quantize_activation_row_avx2(const float* src, int64_t cols, int64_t block, int8_t* q,
                                  float* scales, int32_t* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // Byte 0 of each 32-bit lane to bytes 0-3 of its 128-bit lane, then lanes 0 and 4 together.
  const __m256i low_bytes =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i gather = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < cols / block; ++b) {
    const float* x = src + b * block;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < block; i += 8)
      amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), amax);
    __m128 folded = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    folded = _mm_max_ps(folded, _mm_movehl_ps(folded, folded));
    folded = _mm_max_ss(folded, _mm_movehdup_ps(folded));
    const float d = _mm_cvtss_f32(folded) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    for (int64_t i = 0; i < block; i += 16) {
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inverse));
      const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inverse));
      const __m256i bytes0 =
          _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q0, low_bytes), gather);
      const __m256i bytes1 =
          _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q1, low_bytes), gather);
      const __m128i bytes =
          _mm_unpacklo_epi64(_mm256_castsi256_si128(bytes0), _mm256_castsi256_si128(bytes1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * block + i), bytes);
      sums[(b * block + i) / 16] = sum_lanes(_mm256_add_epi32(
          _mm256_cvtepi8_epi32(bytes), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes))));
    }
    scales[b] = d;
  }
}

}  // namespace moeline::kernels::detail
