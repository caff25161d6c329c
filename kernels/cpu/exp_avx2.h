#pragma once
// e^x on 8 lanes for the AVX2 kernels (include only from files compiled with AVX2 and FMA).
#include <immintrin.h>

#include "kernels/cpu/exp_polynomial.h"

namespace moeline::kernels::detail {

// e^x on 8 lanes: exp16's formula (exp_avx512.h; the constants of exp_polynomial.h), with
// 2^n built from exponent bits in two halves (n reaches 128 at the upper limit, one past what an
// exponent field holds); multiplying by powers of two is exact there, so the value is p 2^n.
inline __m256 exp8(__m256 x) {
  using namespace exp_polynomial;
  const __m256 low = _mm256_set1_ps(kLowest), high = _mm256_set1_ps(kHighest);
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, low), high);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kCoefficients[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kCoefficients[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(exponent, 1);
  auto power_of_two = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  __m256 result = _mm256_mul_ps(_mm256_mul_ps(p, power_of_two(half)),
                                power_of_two(_mm256_sub_epi32(exponent, half)));
  result = _mm256_and_ps(result, _mm256_cmp_ps(x, low, _CMP_GE_OQ));
  result = _mm256_blendv_ps(result, _mm256_set1_ps(__builtin_inff()),
                            _mm256_cmp_ps(x, high, _CMP_GT_OQ));
  return _mm256_blendv_ps(result, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

}  // namespace moeline::kernels::detail
