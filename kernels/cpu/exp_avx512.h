#pragma once
// e^x on 16 lanes for the AVX-512 kernels (include only from files compiled with AVX-512): range
// reduction x = n ln2 + r with |r| <= ln2/2, Cephes' degree-6 polynomial for e^r, times 2^n; within
// 2 ulp of the exact value. Below -87 (under the smallest normal result) it gives 0, above 88.7
// infinity, and NaN stays NaN. One formula for every caller, so a value's bits never depend on
// which kernel took its exponential.
#include <immintrin.h>

#include "kernels/cpu/exp_polynomial.h"

namespace moeline::kernels::detail {

inline __m512 exp16(__m512 x) {
  using namespace exp_polynomial;
  const __m512 low = _mm512_set1_ps(kLowest), high = _mm512_set1_ps(kHighest);
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, low), high);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kCoefficients[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoefficients[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 result = _mm512_scalef_ps(p, n);
  result = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), result);
  result = _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, high, _CMP_GT_OQ),
                              _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

}  // namespace moeline::kernels::detail
