// The AVX2 attention of one query's heads (attention.cpp picks it on the AVX2 path): the AVX-512
// form (attention_avx512.cpp) on 8 lanes. Per head the arithmetic is fixed by the query and its
// keys alone, so prefill and decode agree bit for bit and a query's result does not depend on its
// company:
//   score(i) = scale · Σ_lanes (Σ_chunks q[chunk] ⊙ k_i[chunk]), the 8 lanes summed by the same
//              tree whichever 8 keys are reduced together;
//   p(i)     = exp(score(i) - max), by exp_avx2.h's vectorized formula;
//   out      = Σ_i (p(i) / Σ p) v_i, one fused multiply-add per key in key order.
// The portable path's per-key horizontal sums and scalar exponentials were 15-17% of a Q4_K_M
// prefill of 512 tokens on `mini` (Zen 3).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/exp_avx2.h"

namespace moeline::kernels::detail {
namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kMaxHeads = 16;

// The 8 lane sums of a[0..7]: lane j of the result is the sum of a[j]'s lanes, added in a fixed
// pattern (pairs within each 128-bit half, then halves) that does not depend on the other
// vectors' values.
__m256 sum_lanes_of_8(const __m256 a[8]) {
  __m256 pairs[4];
  for (int j = 0; j < 4; ++j)
    pairs[j] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * j], a[2 * j + 1]),
                             _mm256_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  __m256 quads[2];
  for (int j = 0; j < 2; ++j) {
    const __m256d x = _mm256_castps_pd(pairs[2 * j]), y = _mm256_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // quads[j], half L: the half-L sums of rows 4j..4j+3.
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

// All-ones in the first `count` lanes (a maskload/maskstore mask).
__m256i first_lanes(int64_t count) {
  const int32_t n = static_cast<int32_t>(std::min(count, kLanes));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One block of the weighted sum of values: kHeads heads × kChunks 8-column chunks, from column
// chunk `first_chunk` on, accumulated in registers over the keys in order.
struct WeightedValues {
  const PagedKvLayer& kv;
  const int32_t* block_table;
  int64_t kv_head;
  int64_t first_position;
  bool prefetch;
  const float* weights;  // [head][padded]: e^(s - max) of the block's first head
  int64_t padded;
  const float* weight_scale;  // 1 / Σ of each head
  int64_t count;
  int64_t first_chunk;
  float* out;  // the block's first head's output row

  template <int kHeads, int kChunks>
  void run() const {
    __m256i masks[kChunks];
    for (int c = 0; c < kChunks; ++c)
      masks[c] = first_lanes(kv.value_dim - (first_chunk + c) * kLanes);
    __m256 acc[kHeads][kChunks];
    for (int h = 0; h < kHeads; ++h)
      for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm256_setzero_ps();
    ValueWalk values(kv, block_table, kv_head, first_position, count, first_chunk * kLanes,
                     std::min<int64_t>(kChunks * kLanes, kv.value_dim - first_chunk * kLanes),
                     prefetch);
    for (int64_t i = 0; i < count; ++i) {
      const float* v = values.next();
      __m256 chunk[kChunks];
      for (int c = 0; c < kChunks; ++c) chunk[c] = _mm256_maskload_ps(v + c * kLanes, masks[c]);
      for (int h = 0; h < kHeads; ++h) {
        const __m256 weight = _mm256_set1_ps(weights[h * padded + i] * weight_scale[h]);
        for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm256_fmadd_ps(weight, chunk[c], acc[h][c]);
      }
    }
    for (int h = 0; h < kHeads; ++h)
      for (int c = 0; c < kChunks; ++c)
        _mm256_maskstore_ps(out + h * kv.value_dim + (first_chunk + c) * kLanes, masks[c],
                            acc[h][c]);
  }
};

}  // namespace

void attend_heads_avx2(const PagedKvLayer& kv, const AttentionQuery& query, int64_t head_begin,
                       int64_t head_end, int64_t group, float scale, int64_t sliding_window,
                       bool prefetch_kv, std::vector<float>& scores) {
  const auto [kv_head, first, count, heads, padded] =
      HeadsOfOneQuery(query, head_begin, head_end, group, sliding_window, kLanes, scores);
  // Scores, 8 keys at a time: each key row is read once for all heads.
  const int64_t key_chunks = (kv.key_dim + kLanes - 1) / kLanes;
  const __m256i key_tail = first_lanes(kv.key_dim - (key_chunks - 1) * kLanes);
  __m256 max_score[kMaxHeads];
  for (int64_t h = 0; h < heads; ++h) max_score[h] = _mm256_set1_ps(-INFINITY);
  const __m256 scale_v = _mm256_set1_ps(scale);
  KeyWalk key_rows(kv, query.block_table, kv_head, first, count, 0, kv.key_dim, prefetch_kv);
  for (int64_t i0 = 0; i0 < count; i0 += kLanes) {
    const int64_t keys = std::min(kLanes, count - i0);
    // Past the last key the last row stands in (its lanes are never used): every pass is 8.
    const float* rows[kLanes];
    for (int64_t j = 0; j < keys; ++j) rows[j] = key_rows.next();
    for (int64_t j = keys; j < kLanes; ++j) rows[j] = rows[keys - 1];
    const __m256 valid = _mm256_castsi256_ps(first_lanes(keys));
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = query.q + (head_begin + h) * kv.key_dim;
      __m256 partial[kLanes];
      for (int j = 0; j < kLanes; ++j) partial[j] = _mm256_setzero_ps();
      int64_t c = 0;
      for (; c + 1 < key_chunks; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + c * kLanes);
        for (int j = 0; j < kLanes; ++j)
          partial[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[j] + c * kLanes), partial[j]);
      }
      const __m256 qc = _mm256_maskload_ps(q + c * kLanes, key_tail);
      for (int j = 0; j < kLanes; ++j)
        partial[j] =
            _mm256_fmadd_ps(qc, _mm256_maskload_ps(rows[j] + c * kLanes, key_tail), partial[j]);
      const __m256 s = _mm256_mul_ps(sum_lanes_of_8(partial), scale_v);
      _mm256_storeu_ps(scores.data() + h * padded + i0, s);
      max_score[h] = _mm256_blendv_ps(max_score[h], _mm256_max_ps(max_score[h], s), valid);
    }
  }

  // Softmax weights: e^(s - max), their sum in double (lane by lane in key order, lanes then
  // added in order), and each weight times 1 / sum, as the portable path forms them.
  float weight_scale[kMaxHeads];
  for (int64_t h = 0; h < heads; ++h) {
    __m128 m =
        _mm_max_ps(_mm256_castps256_ps128(max_score[h]), _mm256_extractf128_ps(max_score[h], 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const __m256 max_v = _mm256_set1_ps(_mm_cvtss_f32(m));
    float* row = scores.data() + h * padded;
    __m256d sum_low = _mm256_setzero_pd(), sum_high = _mm256_setzero_pd();
    for (int64_t i0 = 0; i0 < count; i0 += kLanes) {
      const __m256 p = _mm256_and_ps(_mm256_castsi256_ps(first_lanes(count - i0)),
                                     exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i0), max_v)));
      _mm256_storeu_ps(row + i0, p);
      sum_low = _mm256_add_pd(sum_low, _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
      sum_high = _mm256_add_pd(sum_high, _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
    }
    alignas(32) double lanes[8];
    _mm256_store_pd(lanes, sum_low);
    _mm256_store_pd(lanes + 4, sum_high);
    double sum = 0.0;
    for (double lane : lanes) sum += lane;
    weight_scale[h] = static_cast<float>(1.0 / sum);
  }

  // out = Σ_i weight(i) v_i: up to 16 value columns of up to 4 heads in 8 registers at a time.
  const int64_t value_chunks = (kv.value_dim + kLanes - 1) / kLanes;
  for (int64_t h0 = 0; h0 < heads; h0 += 4) {
    for (int64_t c0 = 0; c0 < value_chunks; c0 += 2) {
      const WeightedValues block{.kv = kv,
                                 .block_table = query.block_table,
                                 .kv_head = kv_head,
                                 .first_position = first,
                                 .prefetch = prefetch_kv,
                                 .weights = scores.data() + h0 * padded,
                                 .padded = padded,
                                 .weight_scale = weight_scale + h0,
                                 .count = count,
                                 .first_chunk = c0,
                                 .out = query.out + (head_begin + h0) * kv.value_dim};
      with_count<4>(heads - h0, [&](auto head_count) {
        with_count<2>(value_chunks - c0, [&](auto chunk_count) {
          block.template run<decltype(head_count)::value, decltype(chunk_count)::value>();
        });
      });
    }
  }
}

}  // namespace moeline::kernels::detail
