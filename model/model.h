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

#include "base/progress.h"
#include "base/status.h"
#include "kernels/cpu/dtype.h"
#include "model/config.h"
#include "model/gguf.h"
#include "model/model_info.h"
#include "model/safetensors.h"
#include "offload/expert_pool.h"
#include "offload/expert_provider.h"

namespace moeline::model {
namespace arch {
struct TensorNames;
}

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
  // The value rows of kv_b_proj, head after head: head h's [v_head_dim, kv_lora] rows start
  // value_head_stride rows after head h-1's (nope + v inside kv_b_proj, v in a GGUF's split
  // attn_v_b). kv_b_split: the key and value parts came as their own tensors (no kv_b_proj).
  kernels::MatrixView kv_b_value;
  int64_t value_head_stride = 0, value_head_rows = 0;
  bool kv_b_split = false;
  kernels::MatrixView value_up(int64_t head) const {
    return kv_b_value.row_range(head * value_head_stride, value_head_rows);
  }
  kernels::VectorView router_bias;                          // [experts], V3's correction bias
  kernels::MatrixView shared_gate, shared_up, shared_down;  // shared experts, when configured
  kernels::MatrixView shared_expert_gate;                   // [1, hidden], Qwen2-MoE's
};

class Model {
 public:
  // A Hugging Face checkpoint folder (config.json, safetensors), or a GGUF file. `progress`, when
  // given, hears the layers bound so far (`moeline run` on a terminal, a stage's /readyz).
  static Expected<std::unique_ptr<Model>> load(const std::filesystem::path& path,
                                               const Progress& progress = {});

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
  // What load() was given: the checkpoint folder, or the GGUF file.
  const std::filesystem::path& dir() const { return dir_; }
  // The GGUF file the model was loaded from (its metadata holds the tokenizer and chat
  // template); nullptr for a safetensors checkpoint.
  const GgufFile* gguf() const { return gguf_.get(); }
  // Whether any weight is block-quantized (what the CUDA engine cannot run yet).
  bool has_quantized_weights() const;
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
  void load_weights(const arch::TensorNames& names, const Progress& progress);

  std::filesystem::path dir_;
  ModelConfig config_;
  Checkpoint checkpoint_;
  std::shared_ptr<const GgufFile> gguf_;
  std::vector<LayerWeights> layers_;
  std::vector<std::vector<std::byte>> derived_;  // weights computed at load (kv_b_key_t)
  std::vector<std::vector<offload::ExpertWeights>> experts_;
  kernels::MatrixView embed_tokens_, lm_head_;
  kernels::VectorView final_norm_;
  uint64_t model_id_ = 0;
};

}  // namespace moeline::model
