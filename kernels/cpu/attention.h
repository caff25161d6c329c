#pragma once
// Causal grouped-query attention over a paged KV cache. The cache of one layer is a set of blocks
// of `block_size` token slots laid out [block][kv_head][slot][key_dim] for keys (and likewise for
// values), so one head's keys within a block are contiguous. A query sees its own sequence's
// tokens up to its position (and, with a sliding window W, only the last W of them).
//
// Keys and values may differ in width, and values may be a prefix of each key row (values ==
// keys, value_stride == key_dim): multi-head latent attention's compressed cache, where every head
// attends over one shared row [latent | rope key] and reads the latent back as its value.

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
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
// Calls body(std::integral_constant<int, n>) for n = min(count, kMax), 1 <= n: the SIMD paths'
// register blocks of weighted values, sized at compile time.
template <int kMax, class Body>
void with_count(int64_t count, Body&& body) {
  const int64_t n = std::min<int64_t>(count, kMax);
  [&]<int... N>(std::integer_sequence<int, N...>) {
    ((n == N + 1 ? (body(std::integral_constant<int, N + 1>{}), true) : false) || ...);
  }
  (std::make_integer_sequence<int, kMax>{});
}

// The first key a query sees: 0, or with a sliding window of W only the last W up to its own.
inline int64_t first_visible_key(const AttentionQuery& query, int64_t sliding_window) {
  return sliding_window > 0 && query.position - sliding_window + 1 > 0
             ? query.position - sliding_window + 1
             : 0;
}

// One work item of the attention kernels: heads [head_begin, head_end) of one query, all of one KV
// head (`group` query heads per KV head), over the keys the query sees; the scores buffer holds a
// row per head, padded to whole vectors of `lanes`.
struct HeadsOfOneQuery {
  int64_t kv_head, first, count, heads, padded;
  HeadsOfOneQuery(const AttentionQuery& query, int64_t head_begin, int64_t head_end, int64_t group,
                  int64_t sliding_window, int64_t lanes, std::vector<float>& scores)
      : kv_head(head_begin / group),
        first(first_visible_key(query, sliding_window)),
        count(query.position - first + 1),
        heads(head_end - head_begin),
        padded((count + lanes - 1) / lanes * lanes) {
    if (static_cast<int64_t>(scores.size()) < heads * padded)
      scores.resize(static_cast<size_t>(heads * padded));
  }
};

// Cache positions p, p + 1, ... of one sequence as (block, slot), with a division only at the
// start: a decode step at depth walks thousands of positions per layer and KV head.
struct SlotCursor {
  const int32_t* block_table;
  int64_t block_size, index, slot;

  SlotCursor(const PagedKvLayer& kv, const int32_t* table, int64_t position)
      : block_table(table),
        block_size(kv.block_size),
        index(position / kv.block_size),
        slot(position % kv.block_size) {}
  __attribute__((always_inline)) void advance() {
    if (++slot == block_size) {
      slot = 0;
      ++index;
    }
  }
  int32_t block() const { return block_table[index]; }
};

// How far ahead a walk over a query's keys or values prefetches its rows. The cache is read block
// by block (16 rows of one KV head, 4 KiB on `mini`), the blocks scattered over the cache, and the
// hardware prefetchers start over at every block: without this, decode at depth 2048 read the
// keys and values at about 7 GB/s on an AMD EPYC (Zen 5).
constexpr int64_t kKvPrefetchBytes = 8192;

// The rows of one KV head's keys or values (`kRowOf`: &PagedKvLayer::key or ::value), from column
// `column` on, at positions first .. first + count - 1 in order; with `prefetch`, `floats` of each
// row are prefetched about kKvPrefetchBytes ahead of their use (at least 4 rows). A prompt's
// queries share their keys, which stay in cache from one query to the next: they walk without.
template <float* (PagedKvLayer::*kRowOf)(int32_t, int64_t, int64_t) const>
class KvRowWalk {
 public:
  KvRowWalk(const PagedKvLayer& kv, const int32_t* block_table, int64_t kv_head, int64_t first,
            int64_t count, int64_t column, int64_t floats, bool prefetch)
      : kv_(kv),
        kv_head_(kv_head),
        column_(column),
        floats_(floats),
        prefetches_left_(count - rows_ahead(floats, count, prefetch)),
        at_(kv, block_table, first),
        ahead_(kv, block_table, first + count - prefetches_left_) {}

  // The next position's row; first the prefetch of the row rows_ahead() positions further on.
  // Inlined: a call per key made the weighted-value loop spill and reload its 16 accumulators
  // around it (a 2048-token prompt's attention spent more on that than on its multiply-adds).
  __attribute__((always_inline)) const float* next() {
    if (prefetches_left_ > 0) {
      const auto* bytes = reinterpret_cast<const char*>(row(ahead_));
      for (int64_t at = 0; at < floats_ * static_cast<int64_t>(sizeof(float)); at += 64)
        __builtin_prefetch(bytes + at, 0, 3);
      ahead_.advance();
      --prefetches_left_;
    }
    const float* current = row(at_);
    at_.advance();
    return current;
  }

 private:
  static int64_t rows_ahead(int64_t floats, int64_t count, bool prefetch) {
    const int64_t bytes = floats * static_cast<int64_t>(sizeof(float));
    return prefetch ? std::min(count, std::max<int64_t>(4, kKvPrefetchBytes / bytes)) : count;
  }
  __attribute__((always_inline)) const float* row(const SlotCursor& cursor) const {
    return (kv_.*kRowOf)(cursor.block(), kv_head_, cursor.slot) + column_;
  }

  const PagedKvLayer& kv_;
  int64_t kv_head_, column_, floats_, prefetches_left_;
  SlotCursor at_, ahead_;
};

using KeyWalk = KvRowWalk<&PagedKvLayer::key>;
using ValueWalk = KvRowWalk<&PagedKvLayer::value>;

// One query's heads [head_begin, head_end) of one KV head, on AVX-512 (attention_avx512.cpp);
// `scores` is the calling thread's scratch; `prefetch_kv`: the query's keys and values are not
// read by the other queries of the call (KvRowWalk).
void attend_heads_avx512(const PagedKvLayer& kv, const AttentionQuery& query, int64_t head_begin,
                         int64_t head_end, int64_t group, float scale, int64_t sliding_window,
                         bool prefetch_kv, std::vector<float>& scores);
// The same on AVX2 (attention_avx2.cpp), 8 keys reduced at a time.
void attend_heads_avx2(const PagedKvLayer& kv, const AttentionQuery& query, int64_t head_begin,
                       int64_t head_end, int64_t group, float scale, int64_t sliding_window,
                       bool prefetch_kv, std::vector<float>& scores);
}  // namespace detail

}  // namespace moeline::kernels
