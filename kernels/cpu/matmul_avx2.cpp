// AVX2 + FMA path: 16 lanes in two registers, tiles of 4 weight rows × 1 token.
#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/matmul_impl.h"

namespace moeline::kernels::detail {
namespace {

// Two 8-lane registers as one 16-lane vector: every (row, token) sum runs in two independent
// chains of multiply-adds, so that decode's one-row tile is not held to one FMA per latency (a
// Zen 3 core read BF16 rows at 11-14 GB/s with one chain per row, 17 with two, against 21 for a
// plain read; two or four rows side by side, one chain each, read 9-14); decode reads one row at a
// time per stream (two streams: rows from two halves side by side, two chains each). Packed tiles
// are 6 rows x 1 token: 12 accumulators, one activation load (from L2, where the token block lives)
// for 12 multiply-adds whose packed rows come from L1 as memory operands. On Zen 3, mini's shapes
// in one process (BF16 rows from memory, 64 and 512 tokens): 6 x 1 with the next tile
// prefetched 61.6-71.5 GFLOP/s, 4 x 1 57.3-67.8, 5 x 1 59.8-70.6; 2 x 2, with a clean register
// loop, lost 10-25% in the model: four activation loads from L2 per 8 multiply-adds.
struct Lanes16 {
  __m256 low, high;
};

struct Avx2 {
  using V = Lanes16;
  static constexpr int kLanes = 16;
  static constexpr int kMR = 6;
  static constexpr int kDirectRows = 1;
  // Packed rows in blocks of 1024 columns (6 rows: 24 KiB of the 32 KiB L1): mini's down
  // projection (2816 columns, 64 tokens) 34-35 -> 45-47 GFLOP/s on Zen 3 with 4-row tiles; 768 and
  // 1536 slower (6 rows in blocks of 768 lost 10% on 1024-column rows, split 768 + 256).
  static constexpr int64_t kKBlock = kAvx2PackedKBlock;
  static constexpr int kNR = 1;
  // Decode's batches of up to 6 tokens stream their rows unpacked, 4 tokens a call (8 accumulators)
  // or 2 with two rows side by side, where packing 6 rows for so few tokens waited on memory.
  // Zen 3, BF16 rows from memory, two streams (moeline_quant_kernel_bench --types bf16): 2 tokens
  // 9.5 -> 18.8-19.3 GB/s, 3 11.4 -> 12.8, 5 7.3 -> 8.7, 6 6.8 -> 7.9; wider two-row tiles
  // (2 x 3) spill and were no faster.
  static constexpr int kStreamedTileTokens = 4;
  static constexpr int kTwoStreamTileTokens = 2;
  static constexpr int kDirectTokens = 6;
  static constexpr bool kPrefetches = true;
  // The next packed tile's stored rows are prefetched while this tile runs: +1-4% on 1024-column
  // rows (their widening waited on memory), no change on 2816.
  static constexpr bool kPrefetchesNextTile = true;
  static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V load_f32(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static __m256 widen_bf16(const uint16_t* p) {
    const __m256i widened =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
  }
  static V load_bf16(const uint16_t* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
  static __m256 widen_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_f16(const uint16_t* p) { return {widen_f16(p), widen_f16(p + 8)}; }
  // 8 FP8 bytes as 2^-8 of their values (dtype.h's e4m3_as_f16_bits), NaN codes as NaN.
  static __m256 widen_e4m3(const uint8_t* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i wide = _mm_cvtepu8_epi16(bytes);
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7f)), 7));
    const __m256i nan = _mm256_cvtepi8_epi32(
        _mm_cmpeq_epi8(_mm_and_si128(bytes, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f)));
    return _mm256_blendv_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(NAN), _mm256_castsi256_ps(nan));
  }
  static V load_e4m3(const uint8_t* p) { return {widen_e4m3(p), widen_e4m3(p + 8)}; }
  static V broadcast(float value) { return {_mm256_set1_ps(value), _mm256_set1_ps(value)}; }
  static V mul(V a, V b) { return {_mm256_mul_ps(a.low, b.low), _mm256_mul_ps(a.high, b.high)}; }
  static V fmadd(V a, V b, V c) {
    return {_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high)};
  }
  static float reduce(V v) {
    __m256 both = _mm256_add_ps(v.low, v.high);
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
    __m128 odd = _mm_movehdup_ps(sum);
    sum = _mm_add_ps(sum, odd);
    odd = _mm_movehl_ps(odd, sum);
    return _mm_cvtss_f32(_mm_add_ss(sum, odd));
  }
  static void store(float* p, V v) {
    _mm256_storeu_ps(p, v.low);
    _mm256_storeu_ps(p + 8, v.high);
  }
};

}  // namespace

void matmul_rows_avx2(const MatmulTask& task, int64_t row_begin, int64_t row_end) {
  MatmulKernel<Avx2>::run(task, row_begin, row_end);
}

void matmul_rows_two_streams_avx2(const MatmulTask& task, int64_t a_begin, int64_t a_end,
                                  int64_t b_begin, int64_t b_end) {
  MatmulKernel<Avx2>::run_two_streams(task, a_begin, a_end, b_begin, b_end);
}

}  // namespace moeline::kernels::detail
