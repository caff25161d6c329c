// AVX-512 forms of the element-wise ops whose scalar exp dominated them (ops.cpp dispatches).
#include <immintrin.h>

#include "kernels/cpu/exp_avx512.h"
#include "kernels/cpu/ops.h"

namespace moeline::kernels::detail {

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

}  // namespace moeline::kernels::detail
