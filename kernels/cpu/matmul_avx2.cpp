// AVX2 + FMA path: 8 lanes, 2 weight rows × 4 tokens = 8 accumulators of the 16 ymm registers.
#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/matmul_impl.h"

namespace moeline::kernels::detail {
namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMR = 2;
  static constexpr int kDirectRows = 2;
  static constexpr int kNR = 4;
  static constexpr bool kPrefetches = true;
  static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
  static V zero() { return _mm256_setzero_ps(); }
  static V load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    const __m256i widened =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // 8 FP8 bytes as 2^-8 of their values (dtype.h's e4m3_as_f16_bits), NaN codes as NaN.
  static V load_e4m3(const uint8_t* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i wide = _mm_cvtepu8_epi16(bytes);
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7f)), 7));
    const __m256i nan = _mm256_cvtepi8_epi32(
        _mm_cmpeq_epi8(_mm_and_si128(bytes, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f)));
    return _mm256_blendv_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(NAN), _mm256_castsi256_ps(nan));
  }
  static V broadcast(float value) { return _mm256_set1_ps(value); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce(V v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 odd = _mm_movehdup_ps(sum);
    sum = _mm_add_ps(sum, odd);
    odd = _mm_movehl_ps(odd, sum);
    return _mm_cvtss_f32(_mm_add_ss(sum, odd));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};

}  // namespace

void matmul_rows_avx2(const MatmulTask& task, int64_t row_begin, int64_t row_end) {
  MatmulKernel<Avx2>::run(task, row_begin, row_end);
}

}  // namespace moeline::kernels::detail
