#pragma once
// Causal grouped-query attention over a paged KV cache. The cache of one layer is a set of blocks
// of `block_size` token slots laid out [block][kv_head][slot][head_dim], so one head's keys within
// a block are contiguous. A query sees its own sequence's tokens up to its position (and, with a
// sliding window W, only the last W of them).

#include <cstdint>
#include <span>

#include "kernels/cpu/thread_pool.h"

namespace moeline::kernels {

struct PagedKvLayer {
  float* keys = nullptr;
  float* values = nullptr;
  int64_t block_size = 16;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;

  int64_t block_floats() const { return block_size * kv_heads * head_dim; }
  float* key(int32_t block, int64_t head, int64_t slot) const {
    return keys + block * block_floats() + (head * block_size + slot) * head_dim;
  }
  float* value(int32_t block, int64_t head, int64_t slot) const {
    return values + block * block_floats() + (head * block_size + slot) * head_dim;
  }
};

struct AttentionQuery {
  const float* q = nullptr;  // [heads, head_dim]
  float* out = nullptr;      // [heads, head_dim]
  const int32_t* block_table = nullptr;
  int64_t position = 0;  // the query token's position; keys 0..position are in the cache
};

void paged_attention(ThreadPool& pool, const PagedKvLayer& kv,
                     std::span<const AttentionQuery> queries, int64_t heads, float scale,
                     int64_t sliding_window);

}  // namespace moeline::kernels
