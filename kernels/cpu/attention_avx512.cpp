// The AVX-512 attention of one query's heads (attention.cpp picks it on the AVX-512 paths). Per
// head the arithmetic is fixed by the query and its keys alone, so prefill and decode agree bit for
// bit and a query's result does not depend on its company:
//   score(i) = scale · Σ_lanes (Σ_chunks q[chunk] ⊙ k_i[chunk]), the 16 lanes summed by the same
//              tree whichever 16 keys are reduced together;
//   p(i)     = exp(score(i) - max), by exp_avx512.h's vectorized formula;
//   out      = Σ_i (p(i) / Σ p) v_i, one fused multiply-add per key in key order.
// The per-key horizontal sums of the portable path (16 scalar additions per dot product) were
// most of a prefill's attention; here 16 dot products share one transposing reduction.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/exp_avx512.h"

namespace moeline::kernels::detail {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeads = 16;

// The 16 lane sums of a[0..15]: lane j of the result is the sum of a[j]'s lanes, added in a
// fixed pattern (pairs within each 128-bit quarter, then quarters) that does not depend on the
// other vectors' values.
__m512 sum_lanes_of_16(__m512 a[16]) {
  __m512 pairs[8];
  for (int j = 0; j < 8; ++j)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]),
                             _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  __m512 quads[4];
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(pairs[2 * j]), y = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // quads[j], quarter L: the quarter-L sums of rows 4j..4j+3.
  const __m512 halves0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                       _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 halves1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                       _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves0, halves1, 0x88),
                       _mm512_shuffle_f32x4(halves0, halves1, 0xdd));
}

__mmask16 first_lanes(int64_t count) {
  return count >= kLanes ? __mmask16{0xffff} : static_cast<__mmask16>((1u << count) - 1);
}

// One block of the weighted sum of values: kHeads heads × kChunks 16-column chunks, from column
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
    __mmask16 masks[kChunks];
    for (int c = 0; c < kChunks; ++c)
      masks[c] = first_lanes(kv.value_dim - (first_chunk + c) * kLanes);
    __m512 acc[kHeads][kChunks];
    for (int h = 0; h < kHeads; ++h)
      for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm512_setzero_ps();
    ValueWalk values(kv, block_table, kv_head, first_position, count, first_chunk * kLanes,
                     std::min<int64_t>(kChunks * kLanes, kv.value_dim - first_chunk * kLanes),
                     prefetch);
    for (int64_t i = 0; i < count; ++i) {
      const float* v = values.next();
      __m512 chunk[kChunks];
      for (int c = 0; c < kChunks; ++c) chunk[c] = _mm512_maskz_loadu_ps(masks[c], v + c * kLanes);
      for (int h = 0; h < kHeads; ++h) {
        const __m512 weight = _mm512_set1_ps(weights[h * padded + i] * weight_scale[h]);
        for (int c = 0; c < kChunks; ++c) acc[h][c] = _mm512_fmadd_ps(weight, chunk[c], acc[h][c]);
      }
    }
    for (int h = 0; h < kHeads; ++h)
      for (int c = 0; c < kChunks; ++c)
        _mm512_mask_storeu_ps(out + h * kv.value_dim + (first_chunk + c) * kLanes, masks[c],
                              acc[h][c]);
  }
};

}  // namespace

void attend_heads_avx512(const PagedKvLayer& kv, const AttentionQuery& query, int64_t head_begin,
                         int64_t head_end, int64_t group, float scale, int64_t sliding_window,
                         bool prefetch_kv, std::vector<float>& scores) {
  const auto [kv_head, first, count, heads, padded] =
      HeadsOfOneQuery(query, head_begin, head_end, group, sliding_window, kLanes, scores);
  // Scores, 16 keys at a time: each key row is read once for all heads.
  const int64_t key_chunks = (kv.key_dim + kLanes - 1) / kLanes;
  const __mmask16 key_tail = first_lanes(kv.key_dim - (key_chunks - 1) * kLanes);
  __m512 max_score[kMaxHeads];
  for (int64_t h = 0; h < heads; ++h) max_score[h] = _mm512_set1_ps(-INFINITY);
  const __m512 scale_v = _mm512_set1_ps(scale);
  KeyWalk key_rows(kv, query.block_table, kv_head, first, count, 0, kv.key_dim, prefetch_kv);
  for (int64_t i0 = 0; i0 < count; i0 += kLanes) {
    const int64_t keys = std::min(kLanes, count - i0);
    // Past the last key the last row stands in (its lanes are never used): every pass is 16.
    const float* rows[kLanes];
    for (int64_t j = 0; j < keys; ++j) rows[j] = key_rows.next();
    for (int64_t j = keys; j < kLanes; ++j) rows[j] = rows[keys - 1];
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = query.q + (head_begin + h) * kv.key_dim;
      __m512 partial[kLanes];
      for (int j = 0; j < kLanes; ++j) partial[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < key_chunks; ++c) {
        const __mmask16 mask = c + 1 == key_chunks ? key_tail : __mmask16{0xffff};
        const __m512 qc = _mm512_maskz_loadu_ps(mask, q + c * kLanes);
        for (int j = 0; j < kLanes; ++j)
          partial[j] =
              _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(mask, rows[j] + c * kLanes), partial[j]);
      }
      const __m512 s = _mm512_mul_ps(sum_lanes_of_16(partial), scale_v);
      _mm512_storeu_ps(scores.data() + h * padded + i0, s);
      max_score[h] = _mm512_mask_max_ps(max_score[h], first_lanes(keys), max_score[h], s);
    }
  }

  // Softmax weights: e^(s - max), their sum in double (lane by lane in key order, lanes then
  // added in order), and each weight times 1 / sum, as the portable path forms them.
  float weight_scale[kMaxHeads];
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 max_v = _mm512_set1_ps(_mm512_reduce_max_ps(max_score[h]));
    float* row = scores.data() + h * padded;
    __m512d sum_low = _mm512_setzero_pd(), sum_high = _mm512_setzero_pd();
    for (int64_t i0 = 0; i0 < count; i0 += kLanes) {
      const __mmask16 mask = first_lanes(count - i0);
      const __m512 p =
          _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i0), max_v)));
      _mm512_storeu_ps(row + i0, p);
      sum_low = _mm512_add_pd(sum_low, _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
      sum_high = _mm512_add_pd(sum_high, _mm512_cvtps_pd(_mm512_extractf32x8_ps(p, 1)));
    }
    alignas(64) double lanes[16];
    _mm512_store_pd(lanes, sum_low);
    _mm512_store_pd(lanes + 8, sum_high);
    double sum = 0.0;
    for (double lane : lanes) sum += lane;
    weight_scale[h] = static_cast<float>(1.0 / sum);
  }

  // out = Σ_i weight(i) v_i: up to 64 value columns of up to 4 heads in 16 registers at a time.
  const int64_t value_chunks = (kv.value_dim + kLanes - 1) / kLanes;
  for (int64_t h0 = 0; h0 < heads; h0 += 4) {
    for (int64_t c0 = 0; c0 < value_chunks; c0 += 4) {
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
        with_count<4>(value_chunks - c0, [&](auto chunk_count) {
          block.template run<decltype(head_count)::value, decltype(chunk_count)::value>();
        });
      });
    }
  }
}

}  // namespace moeline::kernels::detail
