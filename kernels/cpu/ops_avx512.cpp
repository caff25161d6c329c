// AVX-512 forms of the element-wise ops whose scalar exp dominated them (ops.cpp dispatches), and
// of the fast quantized matmul's activation quantizing (quant_matmul.cpp dispatches).
#include <immintrin.h>

#include "kernels/cpu/exp_avx512.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels::detail {

// first_max_index's largest value (ops.h), x[0] not NaN, 16 lanes at a time: vmaxps keeps the
// lane's value where the candidate is NaN.
float largest_avx512(const float* x, int64_t n) {
  __m512 lanes = _mm512_set1_ps(x[0]);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask =
        n - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1);
    lanes = _mm512_mask_max_ps(lanes, mask, _mm512_maskz_loadu_ps(mask, x + i), lanes);
  }
  return _mm512_reduce_max_ps(lanes);
}

// gate / (1 + e^-gate) * up, 16 values at a time; each value's result depends on it alone.
void silu_mul_avx512(float* gate, const float* up, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask =
        n - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(gate + i, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + i)));
  }
}

// The scalar form's steps on 16 values at a time: the block maximum (max with the new value
// first, so a NaN is skipped as std::max skips it), the same division and product, the conversion
// in the current rounding mode (to nearest even, as lrintf), and the low byte of each 32-bit
// result (the scalar cast: a NaN's INT_MIN becomes 0 in both); sums of those bytes.
void quantize_activation_row_avx512(const float* src, int64_t cols, int64_t block, int8_t* q,
                                    float* scales, int32_t* sums) {
  for (int64_t b = 0; b < cols / block; ++b) {
    const float* x = src + b * block;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < block; i += 16)
      amax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), amax);
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inverse = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    for (int64_t i = 0; i < block; i += 16) {
      const __m128i bytes =
          _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inverse)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * block + i), bytes);
      sums[(b * block + i) / 16] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(bytes));
    }
    scales[b] = d;
  }
}

}  // namespace moeline::kernels::detail
