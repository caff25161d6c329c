#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/ops.h"

namespace moeline::kernels {
namespace {

// At most this many heads share one pass over the keys (a work item).
constexpr int64_t kMaxHeadsPerItem = 16;

// Heads [head_begin, head_end) of one query, all of one KV head: each key and value row is read
// once for all of them (for MLA every head shares one row of ~600 floats; read per head, a long
// context's rows would stream from L3 once per head). Per head the arithmetic is exactly that of
// attending alone: the same dot products, the same softmax, the same accumulation order.
void attend_heads(const PagedKvLayer& kv, const AttentionQuery& query, int64_t head_begin,
                  int64_t head_end, int64_t group, float scale, int64_t sliding_window,
                  bool prefetch_kv, std::vector<float>& scores) {
  const auto [kv_head, first, count, heads, padded] =
      detail::HeadsOfOneQuery(query, head_begin, head_end, group, sliding_window, 1, scores);
  float max_score[kMaxHeadsPerItem];
  std::fill(max_score, max_score + heads, -INFINITY);
  detail::KeyWalk keys(kv, query.block_table, kv_head, first, count, 0, kv.key_dim, prefetch_kv);
  for (int64_t i = 0; i < count; ++i) {
    const float* k = keys.next();
    float dots[kMaxHeadsPerItem];
    dot_rows(query.q + head_begin * kv.key_dim, kv.key_dim, heads, k, kv.key_dim, dots);
    for (int64_t h = 0; h < heads; ++h) {
      const float s = dots[h] * scale;
      scores[static_cast<size_t>(h * count + i)] = s;
      max_score[h] = std::max(max_score[h], s);
    }
  }
  float weight_scale[kMaxHeadsPerItem];
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores.data() + h * count;
    double sum = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      row[i] = std::exp(row[i] - max_score[h]);
      sum += row[i];
    }
    weight_scale[h] = static_cast<float>(1.0 / sum);
    float* out = query.out + (head_begin + h) * kv.value_dim;
    std::fill(out, out + kv.value_dim, 0.0f);
  }
  detail::ValueWalk values(kv, query.block_table, kv_head, first, count, 0, kv.value_dim,
                           prefetch_kv);
  for (int64_t i = 0; i < count; ++i) {
    const float* v = values.next();
    for (int64_t h = 0; h < heads; ++h)
      axpy(scores[static_cast<size_t>(h * count + i)] * weight_scale[h], v,
           query.out + (head_begin + h) * kv.value_dim, kv.value_dim);
  }
}

}  // namespace

void paged_attention(ThreadPool& pool, const PagedKvLayer& kv,
                     std::span<const AttentionQuery> queries, int64_t heads, float scale,
                     int64_t sliding_window) {
  const int64_t group = heads / kv.kv_heads;
  // Work items are (query, a chunk of one KV head's query heads). Whole groups when there are
  // enough items to keep every thread busy; smaller chunks otherwise (a decode step of one MLA
  // query has a single group of all heads). The chunking changes no result bits.
  const auto query_count = static_cast<int64_t>(queries.size());
  const int64_t groups = query_count * kv.kv_heads;
  const int64_t wanted_items = 2 * static_cast<int64_t>(pool.size());
  int64_t chunk =
      groups >= wanted_items ? group : (group * groups + wanted_items - 1) / wanted_items;
  chunk = std::clamp<int64_t>(chunk, 1, std::min(group, kMaxHeadsPerItem));
  const int64_t chunks_per_group = (group + chunk - 1) / chunk;
  const int64_t work = groups * chunks_per_group;
  // Items first, first + stride, ...: strided, not contiguous, because causal queries late in a
  // prompt cost more than early ones.
  // The AVX-512 and AVX2 paths reduce 16 or 8 dot products at once (attention_avx512.cpp,
  // attention_avx2.cpp); their bits differ from the portable loop's, so every query of a process
  // takes the same one.
  const Isa isa = active_isa();
  const auto attend = isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni ? detail::attend_heads_avx512
                      : isa == Isa::kAvx2                            ? detail::attend_heads_avx2
                                                                     : attend_heads;
  // A query whose neighbours in the call read other sequences' caches (a decode step) reads its
  // keys and values from memory and prefetches them; a prompt's queries share theirs.
  auto alone = [&](int64_t query) {
    const int32_t* table = queries[static_cast<size_t>(query)].block_table;
    return (query == 0 || queries[static_cast<size_t>(query - 1)].block_table != table) &&
           (query + 1 == query_count ||
            queries[static_cast<size_t>(query + 1)].block_table != table);
  };
  // Items in KV-head-major order: a thread runs one head's queries one after another, so that a
  // prompt's queries find that head's keys and values in cache (query-major, each query walked
  // every head's rows: 4 MiB a query at 2048 positions on `mini`, read from beyond the L2).
  auto attend_items = [&](int64_t first, int64_t stride) {
    thread_local std::vector<float> scores;
    for (int64_t item = first; item < work; item += stride) {
      const int64_t query = item % query_count;
      const int64_t within = item / query_count;
      const int64_t head_begin =
          (within / chunks_per_group) * group + (within % chunks_per_group) * chunk;
      const int64_t head_end =
          std::min(head_begin + chunk, (within / chunks_per_group + 1) * group);
      attend(kv, queries[static_cast<size_t>(query)], head_begin, head_end, group, scale,
             sliding_window, alone(query), scores);
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
