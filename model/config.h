#pragma once
// The hyper-parameters of a checkpoint, read from its config.json by the family's parser
// (model/arch/<family>.cpp). Everything the forward pass needs is here, already resolved: e.g.
// head_dim is the configured value when present, not hidden_size / heads.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/rope.h"

namespace moeline::model {

class GgufFile;

enum class Family { kMixtral, kOlmoe, kQwen2Moe, kQwen3Moe, kDeepseekV2, kDeepseekV3, kGlm4Moe };

// How a router turns its logits into scores, and which experts its top-k may pick from.
enum class RouterScoring { kSoftmax, kSigmoid };
enum class GroupLimit {
  kNone,
  kGroupMax,     // DeepSeek-V2 group_limited_greedy: a group scores its best expert
  kGroupTopTwo,  // DeepSeek-V3 noaux_tc: a group scores the sum of its best two
};

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
  bool qk_norm_whole = false;  // OLMoE: over the whole projection (all heads at once) instead
  float clip_qkv = 0;          // OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] (0: none)
  int64_t sliding_window = 0;  // 0: full causal attention
  // GLM-4.5 (partial_rotary_factor): RoPE turns only the first rotary_dim dimensions of each
  // head, the rest pass through; 0: all of head_dim.
  int64_t rotary_dim = 0;
  // Resolved at load: 1/sqrt(the query-key width) unless the family sets it (DeepSeek's YaRN
  // multiplies it by mscale²).
  double softmax_scale = 0.0;

  // RoPE beyond the plain θ table. YaRN (rope_yarn_factor > 0) blends interpolated and original
  // frequencies and scales cos/sin by rope_attention_factor; interleaved pairs (2i, 2i+1) are
  // DeepSeek's layout, rotate-half (i, i + d/2) everyone else's.
  double rope_yarn_factor = 0.0;
  int64_t rope_original_max_positions = 0;
  double rope_beta_fast = 32.0, rope_beta_slow = 1.0;
  double rope_attention_factor = 1.0;
  bool rope_interleaved = false;

  // Multi-head latent attention (DeepSeek-V2/V3). q from q_proj, or through a rank-q_lora_rank
  // bottleneck when q_lora_rank > 0; keys and values from a kv_lora_rank latent shared by all
  // heads plus one qk_rope_head_dim rope key. head_dim is then qk_nope_head_dim +
  // qk_rope_head_dim (the query-key width).
  bool mla = false;
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;

  // Mixture of experts.
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t expert_intermediate_size = 0;
  bool norm_topk_prob = true;           // renormalise the chosen experts' weights to sum to 1
  int64_t dense_intermediate_size = 0;  // Qwen3 layers that use a dense MLP instead
  std::vector<bool> layer_is_moe;
  RouterScoring router_scoring = RouterScoring::kSoftmax;
  GroupLimit group_limit = GroupLimit::kNone;
  int64_t n_group = 1, topk_group = 1;
  // The routed experts' weights are multiplied by routed_scaling_factor when they are not
  // renormalised, and also when they are if scale_normalised_weights (DeepSeek-V3).
  double routed_scaling_factor = 1.0;
  bool scale_normalised_weights = false;
  // DeepSeek-V3: a per-expert bias added to the scores for choosing experts only.
  bool router_correction_bias = false;
  // Shared experts (DeepSeek, Qwen2-MoE): one always-used SwiGLU of this width per MoE layer (0:
  // none), added to the routed experts' output with weight 1, or with weight sigmoid(x · g) when
  // shared_expert_gate (Qwen2-MoE's per-layer [1, hidden] shared_expert_gate).
  int64_t shared_intermediate_size = 0;
  bool shared_expert_gate = false;

  // FP8 checkpoints (config.json's quantization_config, quant_method "fp8", fmt "e4m3"): the
  // [rows, columns] of the blocks that share one `weight_scale_inv` entry; {0, 0} when the
  // checkpoint is not FP8. Activations stay F32 whatever activation_scheme says: more accurate
  // than the release's FP8 activations, and the same arithmetic as the other weight types.
  int64_t fp8_block_rows = 0, fp8_block_cols = 0;

  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;

  // Parses dir/config.json (and generation_config.json for stop tokens), or, when `dir` is a
  // file, the GGUF's metadata (from_gguf). Throws StatusError naming the file and the key at fault.
  static ModelConfig load(const std::filesystem::path& dir);
  // The config a GGUF file's metadata describes (llama.cpp's keys, read through the family's
  // config.json parser). Throws StatusError naming the file and the key.
  static ModelConfig from_gguf(const GgufFile& gguf);
  std::string summary() const;
};

// What one token leaves in the KV cache per layer: kv_heads rows of key_dim floats and as many of
// value_dim (0 for MLA, whose single row [latent | rope key] is both key and, in its latent part,
// value).
struct KvShape {
  int64_t kv_heads = 0, key_dim = 0, value_dim = 0;
};
KvShape kv_shape(const ModelConfig& config);
// The rotation of the attention's rope dimensions (all of head_dim, or MLA's qk_rope_head_dim).
kernels::Rope make_rope(const ModelConfig& config);
// The per-pair RoPE frequencies and layout of the attention's rotated dimensions.
// The MoE layer indices in order (dense layers have no router).
std::vector<int64_t> moe_layer_indices(const ModelConfig& config);
// How many layers a forward must run to see the first `k` MoE layers' routers.
int64_t layers_through_moe(const ModelConfig& config, int k);

}  // namespace moeline::model
