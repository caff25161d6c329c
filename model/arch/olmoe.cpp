// OLMoE (modeling_olmoe.py: OLMoE-1B-7B): Llama's attention with an RMSNorm over the whole q and
// k projections (all heads at once, before RoPE) and, when clip_qkv is set, q, k and v clamped to
// [-clip_qkv, clip_qkv]; a softmax router over every layer's experts, renormalised only when
// norm_topk_prob. Its checkpoints use Qwen3-MoE's tensor names (mlp.gate, mlp.experts.{E}.*,
// self_attn.q_norm / k_norm), with the norms as wide as the projections; so do llama.cpp's
// `olmoe` files (rotate-half RoPE, as the checkpoint: the converter does not permute q and k).
#include "base/status.h"
#include "model/arch/arch.h"

namespace moeline::model::arch {

nlohmann::json gguf_config_olmoe(const GgufMetadata& m) {
  nlohmann::json config = gguf_common_config(m, "olmoe");
  config["num_experts"] = m.require_int("expert_count");
  config["num_experts_per_tok"] = m.require_int("expert_used_count");
  // llama.cpp's olmoe: experts feed_forward_length wide, never renormalised, no clamp.
  config["intermediate_size"] = m.require_int("feed_forward_length");
  config["norm_topk_prob"] = false;
  const double scale = m.number_or("expert_weights_scale", 0.0);
  if (scale != 0.0 && scale != 1.0)
    m.fail("expert_weights_scale",
           "is " + std::to_string(scale) + "; OLMoE does not scale its experts");
  if (!m.has("rope.freq_base")) config["rope_theta"] = 10000.0;
  return config;
}

void parse_olmoe(const nlohmann::json& config, ModelConfig& out) {
  out.family = model::Family::kOlmoe;
  parse_common(config, out);
  // OlmoeConfig's own defaults, which differ from the shared ones.
  out.rms_norm_eps = static_cast<float>(number_or(config, "rms_norm_eps", 1e-5));
  out.qk_norm = true;
  out.qk_norm_whole = true;
  out.attention_bias = bool_or(config, "attention_bias", false);
  out.num_experts = require_int(config, "num_experts");
  out.experts_per_token = require_int(config, "num_experts_per_tok");
  out.expert_intermediate_size = require_int(config, "intermediate_size");
  out.norm_topk_prob = bool_or(config, "norm_topk_prob", false);
  const double clip = number_or(config, "clip_qkv", 0.0);
  if (clip < 0) throw StatusError("config.json: clip_qkv must be positive or null");
  out.clip_qkv = static_cast<float>(clip);
  out.layer_is_moe.assign(static_cast<size_t>(out.num_layers), true);
}

}  // namespace moeline::model::arch
