#pragma once
// One file per model family (llama.cpp style): how its config.json maps onto ModelConfig and the
// Hugging Face tensor names of its checkpoint, declared once in a name table.

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "model/config.h"

namespace moeline::model::arch {

// Tensor names with {L} for the layer and {E} for the expert.
struct TensorNames {
  std::string_view embed_tokens;
  std::string_view final_norm;
  std::string_view lm_head;
  std::string_view input_norm;
  std::string_view post_attention_norm;
  std::string_view q_proj, k_proj, v_proj, o_proj;
  std::string_view q_bias, k_bias, v_bias, o_bias;
  std::string_view q_norm, k_norm;
  std::string_view router;
  // Checkpoints written by newer transformers versions name the router differently (empty: none).
  std::string_view router_alternative;
  std::string_view expert_gate, expert_up, expert_down;
  // The stacked layout of the same experts: gate_up [experts, 2 * intermediate, hidden] (gate rows
  // first, then up rows, per expert) and down [experts, hidden, intermediate].
  std::string_view fused_gate_up, fused_down;
  // Experts stacked one tensor per matrix, [experts, intermediate, hidden] for gate and up and
  // [experts, hidden, intermediate] for down (GGUF's ffn_*_exps).
  std::string_view stacked_gate, stacked_up, stacked_down;
  std::string_view dense_gate, dense_up, dense_down;
  // Multi-head latent attention (empty for the other families).
  std::string_view q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj;
  // kv_b_proj split per head as the absorbed attention uses it (GGUF's attn_k_b, attn_v_b):
  // [heads, kv_lora, nope] (the key rows, transposed) and [heads, v_head_dim, kv_lora].
  std::string_view kv_b_key_t, kv_b_value;
  std::string_view router_bias;
  std::string_view shared_gate, shared_up, shared_down;
  // Qwen2-MoE's scalar gate on the shared expert: [1, hidden] (a GGUF's is 1-D, [hidden]).
  std::string_view shared_expert_gate;
};

// A GGUF file's metadata, read through the keys of one architecture ("{arch}.block_count").
// Every failure throws StatusError naming the file and the key.
class GgufMetadata {
 public:
  GgufMetadata(const nlohmann::json& metadata, std::string architecture, std::string file_name,
               const GgufFile* gguf = nullptr)
      : metadata_(metadata),
        architecture_(std::move(architecture)),
        file_(std::move(file_name)),
        gguf_(gguf) {}

  const std::string& architecture() const { return architecture_; }
  // `key` under the architecture's prefix ("block_count" -> "llama.block_count").
  bool has(const std::string& key) const;
  int64_t require_int(const std::string& key) const;
  int64_t int_or(const std::string& key, int64_t fallback) const;
  double number_or(const std::string& key, double fallback) const;
  bool bool_or(const std::string& key, bool fallback) const;
  std::string string_or(const std::string& key, const std::string& fallback) const;
  // A key without the architecture prefix ("tokenizer.ggml.tokens"); null when absent.
  const nlohmann::json& global(const std::string& key) const;
  // Whether the file holds a tensor of this name (what llama.cpp decides some settings by, such as
  // whether a GLM-4.5 file has attention biases); false when read without the file.
  bool has_tensor(const std::string& name) const;
  [[noreturn]] void fail(const std::string& key, const std::string& why) const;

 private:
  const nlohmann::json& at(const std::string& key) const;
  const nlohmann::json& metadata_;
  std::string architecture_, file_;
  const GgufFile* gguf_;
};

struct Family {
  std::string_view model_type;
  void (*parse)(const nlohmann::json& config, ModelConfig& out);
  const TensorNames* names;
  // llama.cpp's architecture name for the family's GGUF files ("" for none), the config.json the
  // file's metadata amounts to (what `parse` then reads), and the GGUF tensor names. A family whose
  // files need it sets rope_interleaved etc. itself afterwards (gguf_adjust, may be null).
  std::string_view gguf_architecture;
  nlohmann::json (*gguf_config)(const GgufMetadata& metadata);
  void (*gguf_adjust)(const GgufMetadata& metadata, ModelConfig& out);
  const TensorNames* gguf_names;
};

// The families this build supports; nullptr when model_type is not one of them.
const Family* find_family(std::string_view model_type);
std::string supported_model_types();
// The family of a GGUF architecture; nullptr when none serves it.
const Family* find_gguf_family(std::string_view architecture);
std::string supported_gguf_architectures();

std::string tensor_name(std::string_view pattern, int64_t layer, int64_t expert = -1);

// Helpers shared by the family parsers; they throw StatusError naming config.json and the key.
int64_t require_int(const nlohmann::json& config, const char* key);
int64_t int_or(const nlohmann::json& config, const char* key, int64_t fallback);
double number_or(const nlohmann::json& config, const char* key, double fallback);
bool bool_or(const nlohmann::json& config, const char* key, bool fallback);
// rope_parameters.rope_theta (transformers 5), else the top-level rope_theta, else `fallback`.
double rope_theta_or(const nlohmann::json& config, double fallback);
// What parse_common leaves to the family.
struct CommonKeys {
  bool rope_scaling_parsed = false;  // the family reads rope_scaling itself (else only default)
  // The family's partial_rotary_factor when config.json gives none; 0 for a family that rotates
  // whole heads, whose config may then only say 1.
  double partial_rotary_default = 0;
};
// The keys every family shares.
void parse_common(const nlohmann::json& config, ModelConfig& out, const CommonKeys& keys = {});

void parse_mixtral(const nlohmann::json& config, ModelConfig& out);
void parse_olmoe(const nlohmann::json& config, ModelConfig& out);
void parse_qwen2_moe(const nlohmann::json& config, ModelConfig& out);
void parse_qwen3_moe(const nlohmann::json& config, ModelConfig& out);
// The Qwen families' experts and their choice of dense and MoE layers (mlp_only_layers,
// decoder_sparse_step), and the config.json keys a Qwen GGUF's metadata amounts to.
void parse_qwen_moe_layers(const nlohmann::json& config, ModelConfig& out);
nlohmann::json gguf_qwen_moe_config(const GgufMetadata& metadata, std::string_view model_type);
void parse_deepseek_v2(const nlohmann::json& config, ModelConfig& out);
void parse_deepseek_v3(const nlohmann::json& config, ModelConfig& out);
// DeepSeekMoE's keys (n_routed_experts, n_shared_experts, first_k_dense_replace, the groups, the
// scoring, norm_topk_prob, routed_scaling_factor), with the defaults of the family that reads them:
// DeepSeek-V2's by default; v3_routing chooses sigmoid, noaux_tc and scaled normalised weights.
struct DeepseekMoeDefaults {
  int64_t shared_experts = 0, first_dense = 0, n_group = 1, topk_group = 1;
  double routed_scaling_factor = 1.0;
  bool v3_routing = false;
  // DeepSeek's hub code renormalises only a choice of several experts; GLM's one of any size.
  bool renormalise_single_expert = false;
};
void parse_deepseek_moe(const nlohmann::json& config, ModelConfig& out,
                        const DeepseekMoeDefaults& defaults);
void parse_glm4_moe(const nlohmann::json& config, ModelConfig& out);
nlohmann::json gguf_config_mixtral(const GgufMetadata& metadata);
void gguf_adjust_mixtral(const GgufMetadata& metadata, ModelConfig& out);
nlohmann::json gguf_config_olmoe(const GgufMetadata& metadata);
nlohmann::json gguf_config_qwen2_moe(const GgufMetadata& metadata);
nlohmann::json gguf_config_qwen3_moe(const GgufMetadata& metadata);
nlohmann::json gguf_config_deepseek(const GgufMetadata& metadata);
// The DeepSeekMoE keys of a deepseek2 or glm4moe file (expert counts and widths, shared experts,
// leading dense layers, the weights' scale and norm, the groups) as config.json's.
void gguf_deepseek_moe_config(const GgufMetadata& metadata, nlohmann::json& config);
nlohmann::json gguf_config_glm4_moe(const GgufMetadata& metadata);
void gguf_adjust_glm4_moe(const GgufMetadata& metadata, ModelConfig& out);
// The config.json keys every family shares, from the GGUF keys every llama.cpp architecture has.
nlohmann::json gguf_common_config(const GgufMetadata& metadata, std::string_view model_type);
extern const TensorNames kMixtralNames;
extern const TensorNames kQwen2MoeNames;
extern const TensorNames kQwen3MoeNames;
extern const TensorNames kDeepseekNames;
extern const TensorNames kGlm4MoeNames;
extern const TensorNames kMixtralGgufNames;
extern const TensorNames kQwen2MoeGgufNames;
extern const TensorNames kQwen3MoeGgufNames;
extern const TensorNames kDeepseekGgufNames;
extern const TensorNames kGlm4MoeGgufNames;

}  // namespace moeline::model::arch
