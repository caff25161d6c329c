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
  std::string_view dense_gate, dense_up, dense_down;
  // Multi-head latent attention (empty for the other families).
  std::string_view q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj;
  std::string_view router_bias;
  std::string_view shared_gate, shared_up, shared_down;
};

struct Family {
  std::string_view model_type;
  void (*parse)(const nlohmann::json& config, ModelConfig& out);
  const TensorNames* names;
};

// The families this build supports; nullptr when model_type is not one of them.
const Family* find_family(std::string_view model_type);
std::string supported_model_types();

std::string tensor_name(std::string_view pattern, int64_t layer, int64_t expert = -1);

// Helpers shared by the family parsers; they throw ModelError naming config.json and the key.
int64_t require_int(const nlohmann::json& config, const char* key);
int64_t int_or(const nlohmann::json& config, const char* key, int64_t fallback);
double number_or(const nlohmann::json& config, const char* key, double fallback);
bool bool_or(const nlohmann::json& config, const char* key, bool fallback);
// rope_parameters.rope_theta (transformers 5), else the top-level rope_theta, else `fallback`.
double rope_theta_or(const nlohmann::json& config, double fallback);
// The keys every family shares. RoPE scaling is refused unless `rope_scaling_parsed` (the family
// reads it itself).
void parse_common(const nlohmann::json& config, ModelConfig& out, bool rope_scaling_parsed = false);

void parse_mixtral(const nlohmann::json& config, ModelConfig& out);
void parse_qwen3_moe(const nlohmann::json& config, ModelConfig& out);
void parse_deepseek_v2(const nlohmann::json& config, ModelConfig& out);
void parse_deepseek_v3(const nlohmann::json& config, ModelConfig& out);
extern const TensorNames kMixtralNames;
extern const TensorNames kQwen3MoeNames;
extern const TensorNames kDeepseekNames;

}  // namespace moeline::model::arch
