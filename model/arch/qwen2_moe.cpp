// Qwen2-MoE (modeling_qwen2_moe.py: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biases
// on q, k and v, none on o; no q/k norm), a softmax router whose top-k is renormalised only when
// norm_topk_prob, and one shared expert per MoE layer scaled per token by sigmoid(x ·
// shared_expert_gate). Dense layers as Qwen3-MoE chooses them.
#include <algorithm>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/arch/arch.h"

namespace moeline::model::arch {

// Qwen3-MoE's names (constants, so set before any code runs) less the q/k norms and the output
// bias, plus the shared expert and its gate.
const TensorNames kQwen2MoeNames = [] {
  TensorNames names = kQwen3MoeNames;
  names.o_bias = names.q_norm = names.k_norm = "";
  names.shared_gate = "model.layers.{L}.mlp.shared_expert.gate_proj.weight";
  names.shared_up = "model.layers.{L}.mlp.shared_expert.up_proj.weight";
  names.shared_down = "model.layers.{L}.mlp.shared_expert.down_proj.weight";
  names.shared_expert_gate = "model.layers.{L}.mlp.shared_expert_gate.weight";
  return names;
}();

const TensorNames kQwen2MoeGgufNames = [] {
  TensorNames names = kQwen3MoeGgufNames;
  names.o_bias = names.q_norm = names.k_norm = "";
  names.shared_gate = "blk.{L}.ffn_gate_shexp.weight";
  names.shared_up = "blk.{L}.ffn_up_shexp.weight";
  names.shared_down = "blk.{L}.ffn_down_shexp.weight";
  names.shared_expert_gate = "blk.{L}.ffn_gate_inp_shexp.weight";
  return names;
}();

nlohmann::json gguf_config_qwen2_moe(const GgufMetadata& m) {
  nlohmann::json config = gguf_qwen_moe_config(m, "qwen2_moe");
  // llama.cpp's qwen2moe: the shared expert's width when written, else feed_forward_length; the
  // chosen experts' weights are never renormalised (whatever expert_weights_norm might say).
  config["shared_expert_intermediate_size"] =
      m.int_or("expert_shared_feed_forward_length", m.int_or("feed_forward_length", 0));
  config["norm_topk_prob"] = false;
  config["qkv_bias"] = true;
  return config;
}

namespace {

// Qwen2-MoE slides its window only in the layers that layer_types says, or by default those from
// max_window_layers on; moeline runs one attention kind for every layer.
int64_t uniform_sliding_window(const nlohmann::json& config, int64_t num_layers) {
  if (!bool_or(config, "use_sliding_window", false)) return 0;
  const int64_t window = int_or(config, "sliding_window", 0);
  if (window <= 0) return 0;
  int64_t sliding_layers = 0;
  if (config.contains("layer_types") && config["layer_types"].is_array()) {
    for (const auto& kind : config["layer_types"])
      if (kind.is_string() && kind.get<std::string>() == "sliding_attention") ++sliding_layers;
  } else {
    const int64_t first = std::max<int64_t>(0, int_or(config, "max_window_layers", 28));
    sliding_layers = std::max<int64_t>(0, num_layers - std::min(first, num_layers));
  }
  if (sliding_layers == 0) return 0;
  if (sliding_layers == num_layers) return window;
  throw StatusError("config.json: use_sliding_window with a window in " +
                    std::to_string(sliding_layers) + " of " + std::to_string(num_layers) +
                    " layers (max_window_layers, layer_types) is not supported: moeline slides "
                    "the window in every layer or in none");
}

}  // namespace

void parse_qwen2_moe(const nlohmann::json& config, ModelConfig& out) {
  out.family = model::Family::kQwen2Moe;
  parse_common(config, out);
  out.attention_bias = bool_or(config, "qkv_bias", true);
  out.shared_intermediate_size = require_int(config, "shared_expert_intermediate_size");
  if (out.shared_intermediate_size <= 0)
    throw StatusError("config.json: shared_expert_intermediate_size must be positive");
  out.shared_expert_gate = true;
  out.sliding_window = uniform_sliding_window(config, out.num_layers);
  parse_qwen_moe_layers(config, out);
}

}  // namespace moeline::model::arch
