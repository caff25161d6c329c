// Mixtral (modeling_mixtral.py): softmax router over all experts, top-k, weights always
// renormalised; sliding window attention when sliding_window is set.
#include "model/arch/arch.h"

namespace moeline::model::arch {

using nlohmann::json;

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

// llama.cpp's `llama` architecture with experts.
const TensorNames kMixtralGgufNames = {
    .embed_tokens = "token_embd.weight",
    .final_norm = "output_norm.weight",
    .lm_head = "output.weight",
    .input_norm = "blk.{L}.attn_norm.weight",
    .post_attention_norm = "blk.{L}.ffn_norm.weight",
    .q_proj = "blk.{L}.attn_q.weight",
    .k_proj = "blk.{L}.attn_k.weight",
    .v_proj = "blk.{L}.attn_v.weight",
    .o_proj = "blk.{L}.attn_output.weight",
    .q_bias = "",
    .k_bias = "",
    .v_bias = "",
    .o_bias = "",
    .q_norm = "",
    .k_norm = "",
    .router = "blk.{L}.ffn_gate_inp.weight",
    .router_alternative = "",
    // Files converted before the experts were stacked (llama.cpp still reads them).
    .expert_gate = "blk.{L}.ffn_gate.{E}.weight",
    .expert_up = "blk.{L}.ffn_up.{E}.weight",
    .expert_down = "blk.{L}.ffn_down.{E}.weight",
    .fused_gate_up = "",
    .fused_down = "",
    .stacked_gate = "blk.{L}.ffn_gate_exps.weight",
    .stacked_up = "blk.{L}.ffn_up_exps.weight",
    .stacked_down = "blk.{L}.ffn_down_exps.weight",
    .dense_gate = "",
    .dense_up = "",
    .dense_down = "",
};

json gguf_config_mixtral(const GgufMetadata& m) {
  json config = gguf_common_config(m, "mixtral");
  const int64_t hidden = m.require_int("embedding_length");
  const int64_t heads = m.require_int("attention.head_count");
  if (m.has("attention.key_length"))
    config["head_dim"] = m.require_int("attention.key_length");
  else if (heads > 0)
    config["head_dim"] = hidden / heads;
  config["num_local_experts"] = m.require_int("expert_count");
  config["num_experts_per_tok"] = m.require_int("expert_used_count");
  config["intermediate_size"] =
      m.int_or("expert_feed_forward_length", m.require_int("feed_forward_length"));
  if (!m.has("rope.freq_base")) config["rope_theta"] = 10000.0;  // llama.cpp's default for llama
  return config;
}

void gguf_adjust_mixtral(const GgufMetadata&, ModelConfig& out) {
  // convert_hf_to_gguf.py permutes the rows of attn_q and attn_k of every head from the Hugging
  // Face rotate-half layout into llama.cpp's pairs: the same rotation, on adjacent pairs.
  out.rope_interleaved = true;
}

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
