#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/ops.h"

namespace moeline::kernels {
namespace {

void attend_one(const PagedKvLayer& kv, const AttentionQuery& query, int64_t head, int64_t group,
                float scale, int64_t sliding_window, std::vector<float>& scores) {
  const int64_t kv_head = head / group;
  const int64_t first =
      sliding_window > 0 ? std::max<int64_t>(0, query.position - sliding_window + 1) : 0;
  const int64_t count = query.position - first + 1;
  if (static_cast<int64_t>(scores.size()) < count) scores.resize(static_cast<size_t>(count));
  const float* q = query.q + head * kv.key_dim;
  float max_score = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pos = first + i;
    const float* k = kv.key(query.block_table[pos / kv.block_size], kv_head, pos % kv.block_size);
    scores[i] = dot(q, k, kv.key_dim) * scale;
    max_score = std::max(max_score, scores[i]);
  }
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    scores[i] = std::exp(scores[i] - max_score);
    sum += scores[i];
  }
  float* out = query.out + head * kv.value_dim;
  std::fill(out, out + kv.value_dim, 0.0f);
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pos = first + i;
    const float* v = kv.value(query.block_table[pos / kv.block_size], kv_head, pos % kv.block_size);
    axpy(scores[i] * inv_sum, v, out, kv.value_dim);
  }
}

}  // namespace

void paged_attention(ThreadPool& pool, const PagedKvLayer& kv,
                     std::span<const AttentionQuery> queries, int64_t heads, float scale,
                     int64_t sliding_window) {
  const int64_t group = heads / kv.kv_heads;
  const int64_t work = static_cast<int64_t>(queries.size()) * heads;
  // Items (query, head) first, first + stride, ...: strided, not contiguous, because causal
  // queries late in a prompt cost more than early ones.
  auto attend_items = [&](int64_t first, int64_t stride) {
    thread_local std::vector<float> scores;
    for (int64_t item = first; item < work; item += stride) {
      attend_one(kv, queries[static_cast<size_t>(item / heads)], item % heads, group, scale,
                 sliding_window, scores);
    }
  };
  int64_t keys = 0;
  for (const AttentionQuery& query : queries) keys += query.position + 1;
  if (keys * heads * (kv.key_dim + kv.value_dim) < (int64_t{1} << 17)) {
    attend_items(0, 1);  // a short decode step: cheaper on this thread than waking the pool
    return;
  }
  pool.run([&](int thread, int threads) { attend_items(thread, threads); });
}

}  // namespace moeline::kernels
