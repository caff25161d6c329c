// AVX-512 path: 16 lanes, 4 weight rows × 6 tokens = 24 accumulators of the 32 zmm registers.
#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/matmul_impl.h"

namespace moeline::kernels::detail {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMR = 4;
  static constexpr int kDirectRows = 1;
  // Packed rows in one pass (K-blocking measured only on the AVX2 path so far).
  static constexpr int64_t kKBlock = 0;
  static constexpr int kNR = 6;
  // Decode's tokens all in one tile call, with one row or two.
  static constexpr int kStreamedTileTokens = kNR;
  static constexpr int kTwoStreamTileTokens = kNR;
  static constexpr int kDirectTokens = kNR;
  static constexpr bool kPrefetches = true;
  // The next packed tile's rows are prefetched on the AVX2 path only (measured only there).
  static constexpr bool kPrefetchesNextTile = false;
  static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
  static V zero() { return _mm512_setzero_ps(); }
  static V load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    const __m512i widened =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 16 FP8 bytes as 2^-8 of their values (dtype.h's e4m3_as_f16_bits), NaN codes as NaN.
  static V load_e4m3(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i wide = _mm256_cvtepu8_epi16(bytes);
    const __m256i half =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7f)), 7));
    const __mmask16 nan =
        _mm_cmpeq_epi8_mask(_mm_and_si128(bytes, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(half), nan, _mm512_set1_ps(NAN));
  }
  static V broadcast(float value) { return _mm512_set1_ps(value); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce(V v) { return _mm512_reduce_add_ps(v); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};

}  // namespace

void matmul_rows_avx512(const MatmulTask& task, int64_t row_begin, int64_t row_end) {
  MatmulKernel<Avx512>::run(task, row_begin, row_end);
}

void matmul_rows_two_streams_avx512(const MatmulTask& task, int64_t a_begin, int64_t a_end,
                                    int64_t b_begin, int64_t b_end) {
  MatmulKernel<Avx512>::run_two_streams(task, a_begin, a_end, b_begin, b_end);
}

}  // namespace moeline::kernels::detail
