// Qwen3-MoE (modeling_qwen3_moe.py): per-head RMSNorm of q and k before RoPE; softmax router,
// top-k, renormalised only when norm_topk_prob; dense MLP layers where mlp_only_layers or
// decoder_sparse_step say so; sliding window only when use_sliding_window is true.
#include "model/arch/arch.h"

#include <algorithm>

#include "base/status.h"

namespace moeline::model::arch {

const TensorNames kQwen3MoeNames = {
    .embed_tokens = "model.embed_tokens.weight",
    .final_norm = "model.norm.weight",
    .lm_head = "lm_head.weight",
    .input_norm = "model.layers.{L}.input_layernorm.weight",
    .post_attention_norm = "model.layers.{L}.post_attention_layernorm.weight",
    .q_proj = "model.layers.{L}.self_attn.q_proj.weight",
    .k_proj = "model.layers.{L}.self_attn.k_proj.weight",
    .v_proj = "model.layers.{L}.self_attn.v_proj.weight",
    .o_proj = "model.layers.{L}.self_attn.o_proj.weight",
    .q_bias = "model.layers.{L}.self_attn.q_proj.bias",
    .k_bias = "model.layers.{L}.self_attn.k_proj.bias",
    .v_bias = "model.layers.{L}.self_attn.v_proj.bias",
    .o_bias = "model.layers.{L}.self_attn.o_proj.bias",
    .q_norm = "model.layers.{L}.self_attn.q_norm.weight",
    .k_norm = "model.layers.{L}.self_attn.k_norm.weight",
    .router = "model.layers.{L}.mlp.gate.weight",
    .router_alternative = "",
    .expert_gate = "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    .expert_up = "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    .expert_down = "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
    .fused_gate_up = "model.layers.{L}.mlp.experts.gate_up_proj",
    .fused_down = "model.layers.{L}.mlp.experts.down_proj",
    .dense_gate = "model.layers.{L}.mlp.gate_proj.weight",
    .dense_up = "model.layers.{L}.mlp.up_proj.weight",
    .dense_down = "model.layers.{L}.mlp.down_proj.weight",
};

const TensorNames kQwen3MoeGgufNames = {
    .embed_tokens = "token_embd.weight",
    .final_norm = "output_norm.weight",
    .lm_head = "output.weight",
    .input_norm = "blk.{L}.attn_norm.weight",
    .post_attention_norm = "blk.{L}.ffn_norm.weight",
    .q_proj = "blk.{L}.attn_q.weight",
    .k_proj = "blk.{L}.attn_k.weight",
    .v_proj = "blk.{L}.attn_v.weight",
    .o_proj = "blk.{L}.attn_output.weight",
    .q_bias = "blk.{L}.attn_q.bias",
    .k_bias = "blk.{L}.attn_k.bias",
    .v_bias = "blk.{L}.attn_v.bias",
    .o_bias = "blk.{L}.attn_output.bias",
    .q_norm = "blk.{L}.attn_q_norm.weight",
    .k_norm = "blk.{L}.attn_k_norm.weight",
    .router = "blk.{L}.ffn_gate_inp.weight",
    .router_alternative = "",
    .expert_gate = "",
    .expert_up = "",
    .expert_down = "",
    .fused_gate_up = "",
    .fused_down = "",
    .stacked_gate = "blk.{L}.ffn_gate_exps.weight",
    .stacked_up = "blk.{L}.ffn_up_exps.weight",
    .stacked_down = "blk.{L}.ffn_down_exps.weight",
    .dense_gate = "blk.{L}.ffn_gate.weight",
    .dense_up = "blk.{L}.ffn_up.weight",
    .dense_down = "blk.{L}.ffn_down.weight",
};

nlohmann::json gguf_qwen_moe_config(const GgufMetadata& m, std::string_view model_type) {
  nlohmann::json config = gguf_common_config(m, model_type);
  const int64_t heads = m.require_int("attention.head_count");
  config["head_dim"] =
      m.int_or("attention.key_length", heads > 0 ? m.require_int("embedding_length") / heads : 0);
  config["num_experts"] = m.require_int("expert_count");
  config["num_experts_per_tok"] = m.require_int("expert_used_count");
  config["moe_intermediate_size"] = m.require_int("expert_feed_forward_length");
  config["intermediate_size"] = m.int_or("feed_forward_length", 0);
  if (!m.has("rope.freq_base")) config["rope_theta"] = 10000.0;
  return config;
}

nlohmann::json gguf_config_qwen3_moe(const GgufMetadata& m) {
  nlohmann::json config = gguf_qwen_moe_config(m, "qwen3_moe");
  // llama.cpp renormalises Qwen3-MoE's chosen experts always (the released models' setting).
  config["norm_topk_prob"] = m.bool_or("expert_weights_norm", true);
  return config;
}

void parse_qwen3_moe(const nlohmann::json& config, ModelConfig& out) {
  out.family = model::Family::kQwen3Moe;
  parse_common(config, out);
  out.qk_norm = true;
  out.attention_bias = bool_or(config, "attention_bias", false);
  out.sliding_window =
      bool_or(config, "use_sliding_window", false) ? int_or(config, "sliding_window", 0) : 0;
  parse_qwen_moe_layers(config, out);
}

void parse_qwen_moe_layers(const nlohmann::json& config, ModelConfig& out) {
  out.num_experts = require_int(config, "num_experts");
  out.experts_per_token = require_int(config, "num_experts_per_tok");
  out.expert_intermediate_size = require_int(config, "moe_intermediate_size");
  out.dense_intermediate_size = int_or(config, "intermediate_size", 0);
  out.norm_topk_prob = bool_or(config, "norm_topk_prob", false);
  const int64_t sparse_step = int_or(config, "decoder_sparse_step", 1);
  if (sparse_step < 1) throw StatusError("config.json: decoder_sparse_step must be >= 1");
  std::vector<int64_t> mlp_only;
  if (config.contains("mlp_only_layers") && !config["mlp_only_layers"].is_null()) {
    try {
      mlp_only = config["mlp_only_layers"].get<std::vector<int64_t>>();
    } catch (const nlohmann::json::exception&) {
      throw StatusError("config.json: mlp_only_layers must be a list of layer indices");
    }
  }
  out.layer_is_moe.resize(static_cast<size_t>(out.num_layers));
  for (int64_t layer = 0; layer < out.num_layers; ++layer) {
    const bool dense_listed = std::find(mlp_only.begin(), mlp_only.end(), layer) != mlp_only.end();
    out.layer_is_moe[static_cast<size_t>(layer)] =
        !dense_listed && out.num_experts > 0 && (layer + 1) % sparse_step == 0;
  }
  const bool any_dense =
      std::find(out.layer_is_moe.begin(), out.layer_is_moe.end(), false) != out.layer_is_moe.end();
  if (any_dense && out.dense_intermediate_size <= 0)
    throw StatusError("config.json: intermediate_size is needed for the dense MLP layers");
}

}  // namespace moeline::model::arch
