// DeepSeek-V2 and V3 (the modeling_deepseek.py shipped with the checkpoints; DeepSeek-V3's
// inference/model.py where the two differ, noted below):
// - Multi-head latent attention: q through an optional low-rank bottleneck (q_lora_rank; none in
//   V2-Lite); one latent of kv_lora_rank plus one shared rope key per token, expanded per head by
//   kv_b_proj. The latent norms use epsilon 1e-6 whatever rms_norm_eps says. Rope dims are
//   interleaved pairs (rope_interleave, default true). YaRN scales the frequencies, cos/sin (mscale
//   / mscale_all_dim) and the softmax scale (mscale_all_dim²).
// - DeepSeekMoE: the first first_k_dense_replace layers (and those off moe_layer_freq) are dense;
//   MoE layers add n_shared_experts' worth of always-on experts. V2 scores with softmax and may
//   limit the top-k to the topk_group groups with the best expert; V3 scores with sigmoid, chooses
//   on score + e_score_correction_bias within the groups with the best top-two sums, and weights by
//   the unbiased scores. Experts of dropped groups are never chosen (inference/model.py and the
//   current hub code mask them with -inf; the first hub release used 0.0).
#include <cmath>
#include <string>

#include "base/status.h"
#include "model/arch/arch.h"

namespace moeline::model::arch {

const TensorNames kDeepseekNames = {
    .embed_tokens = "model.embed_tokens.weight",
    .final_norm = "model.norm.weight",
    .lm_head = "lm_head.weight",
    .input_norm = "model.layers.{L}.input_layernorm.weight",
    .post_attention_norm = "model.layers.{L}.post_attention_layernorm.weight",
    .q_proj = "model.layers.{L}.self_attn.q_proj.weight",
    .k_proj = "",
    .v_proj = "",
    .o_proj = "model.layers.{L}.self_attn.o_proj.weight",
    .q_bias = "",
    .k_bias = "",
    .v_bias = "",
    .o_bias = "",
    .q_norm = "",
    .k_norm = "",
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
    .q_a_proj = "model.layers.{L}.self_attn.q_a_proj.weight",
    .q_a_norm = "model.layers.{L}.self_attn.q_a_layernorm.weight",
    .q_b_proj = "model.layers.{L}.self_attn.q_b_proj.weight",
    .kv_a_proj = "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
    .kv_a_norm = "model.layers.{L}.self_attn.kv_a_layernorm.weight",
    .kv_b_proj = "model.layers.{L}.self_attn.kv_b_proj.weight",
    .router_bias = "model.layers.{L}.mlp.gate.e_score_correction_bias",
    .shared_gate = "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
    .shared_up = "model.layers.{L}.mlp.shared_experts.up_proj.weight",
    .shared_down = "model.layers.{L}.mlp.shared_experts.down_proj.weight",
};

// llama.cpp's `deepseek2` (DeepSeek-V2 and V3). Files converted since MLA's absorbed form landed
// split kv_b_proj into attn_k_b and attn_v_b; older ones keep attn_kv_b.
const TensorNames kDeepseekGgufNames = {
    .embed_tokens = "token_embd.weight",
    .final_norm = "output_norm.weight",
    .lm_head = "output.weight",
    .input_norm = "blk.{L}.attn_norm.weight",
    .post_attention_norm = "blk.{L}.ffn_norm.weight",
    .q_proj = "blk.{L}.attn_q.weight",
    .k_proj = "",
    .v_proj = "",
    .o_proj = "blk.{L}.attn_output.weight",
    .q_bias = "",
    .k_bias = "",
    .v_bias = "",
    .o_bias = "",
    .q_norm = "",
    .k_norm = "",
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
    .q_a_proj = "blk.{L}.attn_q_a.weight",
    .q_a_norm = "blk.{L}.attn_q_a_norm.weight",
    .q_b_proj = "blk.{L}.attn_q_b.weight",
    .kv_a_proj = "blk.{L}.attn_kv_a_mqa.weight",
    .kv_a_norm = "blk.{L}.attn_kv_a_norm.weight",
    .kv_b_proj = "blk.{L}.attn_kv_b.weight",
    .kv_b_key_t = "blk.{L}.attn_k_b.weight",
    .kv_b_value = "blk.{L}.attn_v_b.weight",
    .router_bias = "blk.{L}.exp_probs_b.bias",
    .shared_gate = "blk.{L}.ffn_gate_shexp.weight",
    .shared_up = "blk.{L}.ffn_up_shexp.weight",
    .shared_down = "blk.{L}.ffn_down_shexp.weight",
};

namespace {

using nlohmann::json;

// llama_expert_gating_func_type
constexpr int64_t kGatingSoftmax = 1, kGatingSigmoid = 2;

[[noreturn]] void bad(const std::string& key, const std::string& why) {
  throw StatusError("config.json: \"" + key + "\" " + why);
}

std::string string_or(const json& config, const char* key, const std::string& fallback) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return fallback;
  if (!it->is_string()) bad(key, "must be a string");
  return it->get<std::string>();
}

double yarn_mscale(double factor, double mscale) {
  return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

// rope_scaling (the hub's key) or rope_parameters (transformers 5): null / default, or YaRN.
void parse_rope(const json& config, ModelConfig& out) {
  out.rope_theta = number_or(config, "rope_theta", 10000.0);
  const json* scaling = nullptr;
  std::string key = "rope_scaling";
  for (const char* candidate : {"rope_scaling", "rope_parameters"}) {
    const auto it = config.find(candidate);
    if (it != config.end() && !it->is_null()) {
      scaling = &*it;
      key = candidate;
      break;
    }
  }
  out.rope_interleaved = bool_or(config, "rope_interleave", true);
  const int64_t qk_head_dim = out.qk_nope_head_dim + out.qk_rope_head_dim;
  out.softmax_scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim));
  if (!scaling) return;
  if (!scaling->is_object()) bad(key, "must be an object");
  out.rope_theta = number_or(*scaling, "rope_theta", out.rope_theta);
  std::string type = string_or(*scaling, "rope_type", string_or(*scaling, "type", "default"));
  if (type == "default") return;
  if (type != "yarn")
    bad(key, "has type \"" + type + "\"; DeepSeek models support only null, default or yarn");
  const double factor = number_or(*scaling, "factor", 0.0);
  if (!(factor >= 1.0)) bad(key, "needs a YaRN \"factor\" >= 1");
  out.rope_yarn_factor = factor;
  out.rope_original_max_positions = int_or(*scaling, "original_max_position_embeddings", 4096);
  out.rope_beta_fast = number_or(*scaling, "beta_fast", 32.0);
  out.rope_beta_slow = number_or(*scaling, "beta_slow", 1.0);
  if (out.rope_original_max_positions <= 0) bad(key, "has original_max_position_embeddings <= 0");
  const double mscale = number_or(*scaling, "mscale", 1.0);
  const double mscale_all_dim = number_or(*scaling, "mscale_all_dim", 0.0);
  out.rope_attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim);
  if (mscale_all_dim != 0.0) {
    const double m = yarn_mscale(factor, mscale_all_dim);
    out.softmax_scale *= m * m;
  }
}

void parse_deepseek(const json& config, ModelConfig& out, bool v3) {
  out.family = v3 ? model::Family::kDeepseekV3 : model::Family::kDeepseekV2;
  out.mla = true;
  out.q_lora_rank = int_or(config, "q_lora_rank", 0);
  out.kv_lora_rank = require_int(config, "kv_lora_rank");
  out.qk_nope_head_dim = require_int(config, "qk_nope_head_dim");
  out.qk_rope_head_dim = require_int(config, "qk_rope_head_dim");
  out.v_head_dim = require_int(config, "v_head_dim");
  parse_common(config, out, {.rope_scaling_parsed = true});
  for (const char* key : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
    if (require_int(config, key) <= 0) bad(key, "must be positive");
  if (out.q_lora_rank < 0) bad("q_lora_rank", "must be positive or null");
  if (out.qk_rope_head_dim % 2 != 0) bad("qk_rope_head_dim", "must be even for RoPE");
  // Every head reads the one latent: there are no KV heads of their own.
  out.head_dim = out.qk_nope_head_dim + out.qk_rope_head_dim;
  out.num_kv_heads = out.num_heads;
  if (bool_or(config, "attention_bias", false))
    bad("attention_bias", "is true; biased DeepSeek attention projections are not supported");
  parse_rope(config, out);
  parse_deepseek_moe(config, out,
                     v3 ? DeepseekMoeDefaults{.shared_experts = 1,
                                              .first_dense = 3,
                                              .n_group = 8,
                                              .topk_group = 4,
                                              .routed_scaling_factor = 2.5,
                                              .v3_routing = true}
                        : DeepseekMoeDefaults{});
}

}  // namespace

void parse_deepseek_moe(const json& config, ModelConfig& out, const DeepseekMoeDefaults& defaults) {
  const bool v3 = defaults.v3_routing;
  out.num_experts = require_int(config, "n_routed_experts");
  out.experts_per_token = require_int(config, "num_experts_per_tok");
  out.expert_intermediate_size = require_int(config, "moe_intermediate_size");
  out.dense_intermediate_size = int_or(config, "intermediate_size", 0);
  out.shared_intermediate_size =
      out.expert_intermediate_size * int_or(config, "n_shared_experts", defaults.shared_experts);
  if (out.shared_intermediate_size < 0) bad("n_shared_experts", "must not be negative");

  const std::string scoring = string_or(config, "scoring_func", v3 ? "sigmoid" : "softmax");
  if (scoring == "softmax") {
    out.router_scoring = RouterScoring::kSoftmax;
  } else if (scoring == "sigmoid") {
    out.router_scoring = RouterScoring::kSigmoid;
  } else {
    bad("scoring_func", "is \"" + scoring + "\"; supported: softmax, sigmoid");
  }
  const std::string method = string_or(config, "topk_method", v3 ? "noaux_tc" : "greedy");
  if (method == "greedy" || method == "gready") {  // "gready": the hub V2 config's spelling
    out.group_limit = GroupLimit::kNone;
  } else if (method == "group_limited_greedy") {
    out.group_limit = GroupLimit::kGroupMax;
  } else if (method == "noaux_tc") {
    out.group_limit = GroupLimit::kGroupTopTwo;
    out.router_correction_bias = true;
  } else {
    bad("topk_method", "is \"" + method + "\"; supported: greedy, group_limited_greedy, noaux_tc");
  }
  out.n_group = int_or(config, "n_group", defaults.n_group);
  out.topk_group = int_or(config, "topk_group", defaults.topk_group);
  if (out.n_group <= 0 || out.num_experts % out.n_group != 0)
    bad("n_group", "must divide n_routed_experts");
  if (out.topk_group <= 0 || out.topk_group > out.n_group)
    bad("topk_group", "must be between 1 and n_group");
  const int64_t group_size = out.num_experts / out.n_group;
  // One group of one expert too: the score of a group is the sum of its best two.
  if (out.group_limit == GroupLimit::kGroupTopTwo && group_size < 2)
    bad("n_group",
        "leaves groups of one expert (n_routed_experts / n_group), which noaux_tc's top-two "
        "group score needs two of");
  if (out.group_limit != GroupLimit::kNone && out.experts_per_token > group_size * out.topk_group)
    bad("num_experts_per_tok", "exceeds the experts of the topk_group groups kept");
  // The hub gates renormalise only when choosing more than one expert; V3 then always scales.
  out.norm_topk_prob = bool_or(config, "norm_topk_prob", v3) &&
                       (out.experts_per_token > 1 || defaults.renormalise_single_expert);
  out.routed_scaling_factor =
      number_or(config, "routed_scaling_factor", defaults.routed_scaling_factor);
  out.scale_normalised_weights = v3;

  const int64_t first_dense = int_or(config, "first_k_dense_replace", defaults.first_dense);
  const int64_t frequency = int_or(config, "moe_layer_freq", 1);
  if (frequency < 1) bad("moe_layer_freq", "must be >= 1");
  out.layer_is_moe.resize(static_cast<size_t>(out.num_layers));
  bool any_dense = false;
  for (int64_t layer = 0; layer < out.num_layers; ++layer) {
    const bool moe = layer >= first_dense && layer % frequency == 0;
    out.layer_is_moe[static_cast<size_t>(layer)] = moe;
    any_dense = any_dense || !moe;
  }
  if (any_dense && out.dense_intermediate_size <= 0)
    bad("intermediate_size", "is needed for the dense MLP layers");
}

void gguf_deepseek_moe_config(const GgufMetadata& m, json& config) {
  config["n_routed_experts"] = m.require_int("expert_count");
  config["num_experts_per_tok"] = m.require_int("expert_used_count");
  config["moe_intermediate_size"] = m.require_int("expert_feed_forward_length");
  config["intermediate_size"] = m.int_or("feed_forward_length", 0);
  config["n_shared_experts"] = m.int_or("expert_shared_count", 0);
  config["first_k_dense_replace"] = m.int_or("leading_dense_block_count", 0);
  config["routed_scaling_factor"] = m.number_or("expert_weights_scale", 1.0);
  config["norm_topk_prob"] = m.bool_or("expert_weights_norm", false);
  const int64_t groups = m.int_or("expert_group_count", 1);
  config["n_group"] = groups;
  config["topk_group"] = m.int_or("expert_group_used_count", groups);
}

json gguf_config_deepseek(const GgufMetadata& m) {
  const int64_t gating = m.int_or("expert_gating_func", kGatingSoftmax);
  if (gating != kGatingSoftmax && gating != kGatingSigmoid)
    m.fail("expert_gating_func",
           "is " + std::to_string(gating) + "; supported: 1 (softmax), 2 (sigmoid)");
  const bool v3 = gating == kGatingSigmoid;
  json config = gguf_common_config(m, v3 ? "deepseek_v3" : "deepseek_v2");
  config["q_lora_rank"] = m.int_or("attention.q_lora_rank", 0);
  config["kv_lora_rank"] = m.require_int("attention.kv_lora_rank");
  const int64_t rope = m.require_int("rope.dimension_count");
  // The absorbed form's files give the per-head sizes as key_length_mla / value_length_mla (their
  // key_length is the latent's); older files give them as key_length / value_length.
  const int64_t qk = m.has("attention.key_length_mla") ? m.require_int("attention.key_length_mla")
                                                       : m.require_int("attention.key_length");
  config["qk_rope_head_dim"] = rope;
  config["qk_nope_head_dim"] = qk - rope;
  config["v_head_dim"] = m.has("attention.value_length_mla")
                             ? m.require_int("attention.value_length_mla")
                             : m.require_int("attention.value_length");
  gguf_deepseek_moe_config(m, config);
  config["scoring_func"] = v3 ? "sigmoid" : "softmax";
  config["topk_method"] =
      v3 ? "noaux_tc" : (config["n_group"] > 1 ? "group_limited_greedy" : "greedy");
  if (config.contains("rope_scaling") && config["rope_scaling"]["type"] == "yarn") {
    // llama.cpp keeps 0.1 * mscale_all_dim as yarn_log_multiplier and assumes mscale equals it.
    const double mscale = m.number_or("rope.scaling.yarn_log_multiplier", 0.0) / 0.1;
    config["rope_scaling"]["mscale"] = mscale;
    config["rope_scaling"]["mscale_all_dim"] = mscale;
  }
  return config;
}

void parse_deepseek_v2(const json& config, ModelConfig& out) {
  parse_deepseek(config, out, false);
}
void parse_deepseek_v3(const json& config, ModelConfig& out) {
  parse_deepseek(config, out, true);
}

}  // namespace moeline::model::arch
