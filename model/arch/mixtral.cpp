// Mixtral (modeling_mixtral.py): softmax router over all experts, top-k, weights always
// renormalised; sliding window attention when sliding_window is set.
#include "model/arch/arch.h"

namespace moeline::model::arch {

const TensorNames kMixtralNames = {
    .embed_tokens = "model.embed_tokens.weight",
    .final_norm = "model.norm.weight",
    .lm_head = "lm_head.weight",
    .input_norm = "model.layers.{L}.input_layernorm.weight",
    .post_attention_norm = "model.layers.{L}.post_attention_layernorm.weight",
    .q_proj = "model.layers.{L}.self_attn.q_proj.weight",
    .k_proj = "model.layers.{L}.self_attn.k_proj.weight",
    .v_proj = "model.layers.{L}.self_attn.v_proj.weight",
    .o_proj = "model.layers.{L}.self_attn.o_proj.weight",
    .q_bias = "",
    .k_bias = "",
    .v_bias = "",
    .o_bias = "",
    .q_norm = "",
    .k_norm = "",
    .router = "model.layers.{L}.block_sparse_moe.gate.weight",
    .router_alternative = "model.layers.{L}.mlp.gate.weight",
    .expert_gate = "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
    .expert_up = "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
    .expert_down = "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",
    .fused_gate_up = "model.layers.{L}.mlp.experts.gate_up_proj",
    .fused_down = "model.layers.{L}.mlp.experts.down_proj",
    .dense_gate = "",
    .dense_up = "",
    .dense_down = "",
};

void parse_mixtral(const nlohmann::json& config, ModelConfig& out) {
  out.family = model::Family::kMixtral;
  parse_common(config, out);
  // MixtralConfig's own defaults, which differ from the shared ones.
  out.rope_theta = rope_theta_or(config, 1e6);
  out.rms_norm_eps = static_cast<float>(number_or(config, "rms_norm_eps", 1e-5));
  out.num_experts = require_int(config, "num_local_experts");
  out.experts_per_token = require_int(config, "num_experts_per_tok");
  out.expert_intermediate_size = require_int(config, "intermediate_size");
  out.norm_topk_prob = true;
  out.sliding_window = int_or(config, "sliding_window", 0);
  out.layer_is_moe.assign(static_cast<size_t>(out.num_layers), true);
}

}  // namespace moeline::model::arch
