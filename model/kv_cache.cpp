#include "model/kv_cache.h"

#include <xxhash.h>

#include <algorithm>

#include "kernels/cpu/dtype.h"

namespace moeline::model {

BlockPool::BlockPool(int32_t blocks) : ref_counts_(static_cast<size_t>(blocks), 0) {
  free_list_.reserve(static_cast<size_t>(blocks));
  // Lowest ids on top, so a fresh pool hands out 0, 1, 2, ...
  for (int32_t block = blocks - 1; block >= 0; --block) free_list_.push_back(block);
}

std::optional<int32_t> BlockPool::allocate() {
  if (free_list_.empty()) return std::nullopt;
  const int32_t block = free_list_.back();
  free_list_.pop_back();
  ref_counts_[static_cast<size_t>(block)] = 1;
  return block;
}

void BlockPool::retain(int32_t block) {
  ++ref_counts_[static_cast<size_t>(block)];
}

void BlockPool::release(int32_t block) {
  int32_t& count = ref_counts_[static_cast<size_t>(block)];
  if (count > 0 && --count == 0) free_list_.push_back(block);
}

KvCache::KvCache(const ModelConfig& config, int32_t blocks)
    : layers_(config.num_layers),
      shape_(kv_shape(config)),
      values_in_keys_(config.mla),
      latent_value_width_(config.kv_lora_rank),
      pool_(blocks) {
  storage_.resize(static_cast<size_t>(layers_) * (key_part() + value_part()));
}

size_t KvCache::key_part() const {
  return static_cast<size_t>(pool_.capacity() * kBlockTokens * shape_.kv_heads * shape_.key_dim);
}

size_t KvCache::value_part() const {
  return static_cast<size_t>(pool_.capacity() * kBlockTokens * shape_.kv_heads * shape_.value_dim);
}

kernels::PagedKvLayer KvCache::layer(int64_t index) {
  float* base = storage_.data() + static_cast<size_t>(index) * (key_part() + value_part());
  kernels::PagedKvLayer kv{.keys = base,
                           .values = base + key_part(),
                           .block_size = kBlockTokens,
                           .kv_heads = shape_.kv_heads,
                           .key_dim = shape_.key_dim,
                           .value_dim = shape_.value_dim,
                           .value_stride = shape_.value_dim};
  if (values_in_keys_) {
    kv.values = base;
    kv.value_dim = latent_value_width_;
    kv.value_stride = shape_.key_dim;
  }
  return kv;
}

size_t KvCache::bytes_per_token(const ModelConfig& config) {
  const KvShape shape = kv_shape(config);
  return static_cast<size_t>(config.num_layers * shape.kv_heads *
                             (shape.key_dim + shape.value_dim)) *
         sizeof(float);
}

size_t KvCache::naive_bytes_per_token(const ModelConfig& config) {
  if (!config.mla) return bytes_per_token(config);
  return static_cast<size_t>(
             config.num_layers * config.num_heads *
             (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)) *
         sizeof(float);
}

size_t KvCache::block_bytes() const {
  return static_cast<size_t>(layers_ * kBlockTokens * shape_.kv_heads *
                             (shape_.key_dim + shape_.value_dim)) *
         sizeof(float);
}

void KvCache::export_blocks(std::span<const int32_t> blocks, uint8_t* out) const {
  for (size_t b = 0; b < blocks.size(); ++b) export_block(blocks[b], out + b * block_bytes());
}

std::vector<uint8_t> KvCache::export_blocks(std::span<const int32_t> blocks) const {
  std::vector<uint8_t> kv(blocks.size() * block_bytes());
  export_blocks(blocks, kv.data());
  return kv;
}

void KvCache::export_block(int32_t block, void* out) const {
  const int64_t key_floats = kBlockTokens * shape_.kv_heads * shape_.key_dim;
  const int64_t value_floats = kBlockTokens * shape_.kv_heads * shape_.value_dim;
  auto* dst = static_cast<float*>(out);
  for (int64_t layer = 0; layer < layers_; ++layer) {
    const float* base = storage_.data() + static_cast<size_t>(layer) * (key_part() + value_part());
    dst = std::copy_n(base + block * key_floats, key_floats, dst);
    dst = std::copy_n(base + key_part() + block * value_floats, value_floats, dst);
  }
}

void KvCache::import_block(int32_t block, const void* in) {
  const int64_t key_floats = kBlockTokens * shape_.kv_heads * shape_.key_dim;
  const int64_t value_floats = kBlockTokens * shape_.kv_heads * shape_.value_dim;
  const auto* src = static_cast<const float*>(in);
  for (int64_t layer = 0; layer < layers_; ++layer) {
    float* base = storage_.data() + static_cast<size_t>(layer) * (key_part() + value_part());
    std::copy_n(src, key_floats, base + block * key_floats);
    src += key_floats;
    std::copy_n(src, value_floats, base + key_part() + block * value_floats);
    src += value_floats;
  }
}

void KvCache::import_blocks(std::span<const int32_t> blocks, const uint8_t* in) {
  for (size_t b = 0; b < blocks.size(); ++b) import_block(blocks[b], in + b * block_bytes());
}

uint64_t block_key(uint64_t parent_key, std::span<const int32_t> tokens, uint64_t model_id,
                   uint64_t cache_namespace) {
  // The chain, model and tenant become the seed of the hash over the block's tokens.
  const uint64_t context[3] = {parent_key, model_id, cache_namespace};
  return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(),
                              XXH3_64bits(context, sizeof context));
}

uint64_t namespace_id(std::string_view cache_namespace) {
  return XXH3_64bits(cache_namespace.data(), cache_namespace.size());
}

bool Sequence::reserve(BlockPool& pool, int64_t more) {
  const int64_t needed_blocks = (length() + more + kBlockTokens - 1) / kBlockTokens;
  const int64_t missing = needed_blocks - static_cast<int64_t>(block_table_.size());
  if (missing <= 0) return true;
  if (missing > pool.free_blocks()) return false;
  for (int64_t i = 0; i < missing; ++i) block_table_.push_back(*pool.allocate());
  return true;
}

void Sequence::share_block(BlockPool& pool, int32_t block) {
  pool.retain(block);
  block_table_.push_back(block);
}

void Sequence::commit(std::span<const int32_t> tokens) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  const size_t full_blocks = tokens_.size() / kBlockTokens;
  while (block_keys_.size() < full_blocks) {
    const size_t index = block_keys_.size();
    const uint64_t parent = index == 0 ? 0 : block_keys_.back();
    block_keys_.push_back(block_key(parent,
                                    std::span(tokens_).subspan(index * kBlockTokens, kBlockTokens),
                                    model_id_, namespace_));
  }
}

void Sequence::release(BlockPool& pool) {
  for (int32_t block : block_table_) pool.release(block);
  block_table_.clear();
  tokens_.clear();
  block_keys_.clear();
}

}  // namespace moeline::model
