#pragma once
// The paged KV cache. Memory is a pool of fixed blocks of kBlockTokens token slots shared by all
// layers (block b of every layer belongs to the same tokens). A Sequence owns a block table that
// maps its positions onto blocks, and the hash-chained key of every full block:
//   key(block i) = XXH3(key(block i-1), tokens of block i, model id, cache namespace)
// so equal keys mean equal token prefixes of the same model and tenant — the basis of prefix reuse.
//
// BlockPool allocation and release are O(1) (a free list); blocks are reference counted so that
// a later prefix cache can share them. Not thread-safe: one scheduler owns a pool.

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kernels/cpu/attention.h"
#include "model/config.h"

namespace moeline::model {

inline constexpr int64_t kBlockTokens = 16;

class BlockPool {
 public:
  explicit BlockPool(int32_t blocks);
  std::optional<int32_t> allocate();
  void retain(int32_t block);
  void release(int32_t block);
  int32_t capacity() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t free_blocks() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t ref_count(int32_t block) const { return ref_counts_[static_cast<size_t>(block)]; }

 private:
  std::vector<int32_t> free_list_;
  std::vector<int32_t> ref_counts_;
};

class KvCache {
 public:
  KvCache(const ModelConfig& config, int32_t blocks);
  kernels::PagedKvLayer layer(int64_t index);
  BlockPool& pool() { return pool_; }
  size_t bytes() const { return storage_.size() * sizeof(float); }
  // What the cache holds per token; and what a cache of full per-head keys and values would
  // (MLA's compressed cache against the naive form; equal for the other families).
  static size_t bytes_per_token(const ModelConfig& config);
  static size_t naive_bytes_per_token(const ModelConfig& config);
  // One block of every layer, keys then values per layer, keys [kv_head][slot][key_dim] and values
  // [kv_head][slot][value_dim] F32 (no values for MLA): the unit KV moves in between processes.
  size_t block_bytes() const;
  void export_block(int32_t block, void* out) const;
  // `blocks` one after another, as export_block writes each: a sequence's KV as the store holds
  // it. `out` has blocks.size() * block_bytes() bytes.
  void export_blocks(std::span<const int32_t> blocks, uint8_t* out) const;
  std::vector<uint8_t> export_blocks(std::span<const int32_t> blocks) const;
  void import_block(int32_t block, const void* in);
  // `blocks` from `in`, laid out as export_blocks writes them.
  void import_blocks(std::span<const int32_t> blocks, const uint8_t* in);
  int64_t layers() const { return layers_; }
  int64_t kv_heads() const { return shape_.kv_heads; }
  int64_t key_dim() const { return shape_.key_dim; }
  int64_t value_dim() const { return shape_.value_dim; }
  // MLA: each latent row is key and (its first value_width() floats) value.
  bool values_in_keys() const { return values_in_keys_; }

 private:
  size_t key_part() const;    // floats of one layer's keys (all blocks)
  size_t value_part() const;  // floats of one layer's values (all blocks)

  int64_t layers_;
  KvShape shape_;
  bool values_in_keys_;
  int64_t latent_value_width_;
  std::vector<float> storage_;  // [layer][keys|values][block][kv_head][slot][key|value dim]
  BlockPool pool_;
};

uint64_t block_key(uint64_t parent_key, std::span<const int32_t> tokens, uint64_t model_id,
                   uint64_t cache_namespace);
uint64_t namespace_id(std::string_view cache_namespace);

class Sequence {
 public:
  Sequence(uint64_t id, uint64_t model_id, uint64_t cache_namespace)
      : id_(id), model_id_(model_id), namespace_(cache_namespace) {}

  uint64_t id() const { return id_; }
  // Tokens whose K and V are in the cache; the next token goes to position length().
  int64_t length() const { return static_cast<int64_t>(tokens_.size()); }
  std::span<const int32_t> tokens() const { return tokens_; }
  const std::vector<int32_t>& block_table() const { return block_table_; }
  const std::vector<uint64_t>& block_keys() const { return block_keys_; }

  // Makes room for `more` tokens; false (and nothing allocated) when the pool is too small.
  bool reserve(BlockPool& pool, int64_t more);
  // Appends an already filled block to an empty sequence's table (taking a reference): a reused
  // prefix, possibly shared by several sequences. The prefix's tokens are then commit()ted.
  void share_block(BlockPool& pool, int32_t block);
  // Records tokens whose KV has just been written, and keys every block they complete.
  void commit(std::span<const int32_t> tokens);
  void release(BlockPool& pool);

 private:
  uint64_t id_, model_id_, namespace_;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> block_table_;
  std::vector<uint64_t> block_keys_;
};

}  // namespace moeline::model
