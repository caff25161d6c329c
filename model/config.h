#pragma once
// The hyper-parameters of a checkpoint, read from its config.json by the family's parser
// (model/arch/<family>.cpp). Everything the forward pass needs is here, already resolved: e.g.
// head_dim is the configured value when present, not hidden_size / heads.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace moeline::model {

enum class Family { kMixtral, kQwen3Moe };

struct ModelConfig {
  Family family = Family::kMixtral;
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rope_theta = 10000.0;
  float rms_norm_eps = 1e-5f;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool qk_norm = false;        // Qwen3: RMSNorm over each head of q and k before RoPE
  int64_t sliding_window = 0;  // 0: full causal attention

  // Mixture of experts.
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t expert_intermediate_size = 0;
  bool norm_topk_prob = true;           // renormalise the chosen experts' weights to sum to 1
  int64_t dense_intermediate_size = 0;  // Qwen3 layers that use a dense MLP instead
  std::vector<bool> layer_is_moe;

  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;

  // Parses dir/config.json (and generation_config.json for stop tokens). Throws ModelError naming
  // the file and the key at fault.
  static ModelConfig load(const std::filesystem::path& dir);
  std::string summary() const;
};

// The MoE layer indices in order (dense layers have no router).
std::vector<int64_t> moe_layer_indices(const ModelConfig& config);
// How many layers a forward must run to see the first `k` MoE layers' routers.
int64_t layers_through_moe(const ModelConfig& config, int k);

}  // namespace moeline::model
