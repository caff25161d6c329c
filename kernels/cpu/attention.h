#pragma once
// Causal grouped-query attention over a paged KV cache. The cache of one layer is a set of blocks
// of `block_size` token slots laid out [block][kv_head][slot][key_dim] for keys (and likewise for
// values), so one head's keys within a block are contiguous. A query sees its own sequence's
// tokens up to its position (and, with a sliding window W, only the last W of them).
//
// Keys and values may differ in width, and values may be a prefix of each key row (values ==
// keys, value_stride == key_dim): multi-head latent attention's compressed cache, where every head
// attends over one shared row [latent | rope key] and reads the latent back as its value.

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/thread_pool.h"

namespace moeline::kernels {

struct PagedKvLayer {
  float* keys = nullptr;
  float* values = nullptr;
  int64_t block_size = 16;
  int64_t kv_heads = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  int64_t value_stride = 0;  // floats from one value row to the next

  float* key(int32_t block, int64_t head, int64_t slot) const {
    return keys + (block * kv_heads * block_size + head * block_size + slot) * key_dim;
  }
  float* value(int32_t block, int64_t head, int64_t slot) const {
    return values + (block * kv_heads * block_size + head * block_size + slot) * value_stride;
  }
};

struct AttentionQuery {
  const float* q = nullptr;  // [heads, key_dim]
  float* out = nullptr;      // [heads, value_dim]
  const int32_t* block_table = nullptr;
  int64_t position = 0;  // the query token's position; keys 0..position are in the cache
};

void paged_attention(ThreadPool& pool, const PagedKvLayer& kv,
                     std::span<const AttentionQuery> queries, int64_t heads, float scale,
                     int64_t sliding_window);

namespace detail {
// The first key a query sees: 0, or with a sliding window of W only the last W up to its own.
inline int64_t first_visible_key(const AttentionQuery& query, int64_t sliding_window) {
  return sliding_window > 0 && query.position - sliding_window + 1 > 0
             ? query.position - sliding_window + 1
             : 0;
}

// One query's heads [head_begin, head_end) of one KV head, on AVX-512 (attention_avx512.cpp);
// `scores` is the calling thread's scratch.
void attend_heads_avx512(const PagedKvLayer& kv, const AttentionQuery& query, int64_t head_begin,
                         int64_t head_end, int64_t group, float scale, int64_t sliding_window,
                         std::vector<float>& scores);
}  // namespace detail

}  // namespace moeline::kernels
