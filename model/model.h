#pragma once
// A loaded checkpoint: its config, the mapped safetensors and typed views of every tensor the
// forward pass reads, each checked for presence, dtype and exact shape at load time. Expert
// weights are handed to an offload::ExpertProvider (the resident one here) rather than kept by
// the model, so the forward pass reaches them only through the provider.
//
// Owns the mapping; views stay valid for the Model's lifetime. Immutable after load, so it may be
// shared by threads.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/status.h"
#include "offload/expert_pool.h"
#include "offload/expert_provider.h"

namespace moeline::model {

struct LayerWeights {
  kernels::VectorView input_norm, post_attention_norm;
  kernels::MatrixView q_proj, k_proj, v_proj, o_proj;
  kernels::VectorView q_bias, k_bias, v_bias, o_bias;  // empty unless attention_bias
  kernels::VectorView q_norm, k_norm;                  // empty unless qk_norm
  bool is_moe = true;
  kernels::MatrixView router;                            // [experts, hidden]
  kernels::MatrixView dense_gate, dense_up, dense_down;  // dense MLP layers only

  // Multi-head latent attention (config.mla); q_proj is used when q_lora_rank is 0.
  kernels::MatrixView q_a_proj, q_b_proj;  // [q_lora, hidden], [heads * qk, q_lora]
  kernels::VectorView q_a_norm, kv_a_norm;
  kernels::MatrixView kv_a_proj;  // [kv_lora + rope, hidden]
  kernels::MatrixView kv_b_proj;  // [heads * (nope + v), kv_lora]: per head, K rows then V rows
  // kv_b_proj's K rows of every head, transposed: [heads * kv_lora, nope]. Rows h * kv_lora ...
  // map a head's query (nope part) into the latent space (the absorbed key up-projection).
  kernels::MatrixView kv_b_key_t;
  kernels::VectorView router_bias;                          // [experts], V3's correction bias
  kernels::MatrixView shared_gate, shared_up, shared_down;  // shared experts, when configured
};

class Model {
 public:
  static Expected<std::unique_ptr<Model>> load(const std::filesystem::path& dir);

  const ModelConfig& config() const { return config_; }
  const LayerWeights& layer(int64_t index) const { return layers_[static_cast<size_t>(index)]; }
  const kernels::MatrixView& embed_tokens() const { return embed_tokens_; }
  const kernels::MatrixView& lm_head() const { return lm_head_; }
  const kernels::VectorView& final_norm() const { return final_norm_; }
  // Every expert's views, by layer; what an ExpertProvider serves.
  const std::vector<std::vector<offload::ExpertWeights>>& experts() const { return experts_; }
  // The experts' shapes and where their bytes lie in the checkpoint's files: what a tiered
  // expert pool reads them from (offload::ExpertPool).
  offload::ExpertCatalog expert_catalog() const;
  // For a process whose experts come from a pool: drops this process's mapping of the expert
  // bytes of the checkpoint and keeps them out of it (no huge pages or readahead over them), so
  // the pool holds the node's only copy. The views stay valid; touching them faults them back in.
  void release_expert_mappings() const;
  const std::filesystem::path& dir() const { return dir_; }
  // Identifies the weights and config (hash of config.json and the tensor headers): part of every
  // KV block key, so caches of different models never mix.
  uint64_t model_id() const { return model_id_; }
  size_t mapped_bytes() const { return checkpoint_.mapped_bytes(); }
  // Bytes of weights one decoded token reads: attention, the router, top-k experts per MoE layer
  // (dense MLP otherwise), one embedding row and the LM head.
  size_t bytes_touched_per_token() const;
  std::string dtype_summary() const;

 private:
  Model() = default;
  void load_weights();

  std::filesystem::path dir_;
  ModelConfig config_;
  Checkpoint checkpoint_;
  std::vector<LayerWeights> layers_;
  std::vector<std::vector<std::byte>> derived_;  // weights computed at load (kv_b_key_t)
  std::vector<std::vector<offload::ExpertWeights>> experts_;
  kernels::MatrixView embed_tokens_, lm_head_;
  kernels::VectorView final_norm_;
  uint64_t model_id_ = 0;
};

}  // namespace moeline::model
