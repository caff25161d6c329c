// GLM-4.5 and GLM-4.6 (modeling_glm4_moe.py: GLM-4.5, GLM-4.5-Air, GLM-4.6):
// - attention: grouped-query, biases on q, k and v when attention_bias (none on o), an RMSNorm
//   over each head of q and k when use_qk_norm, and RoPE over only the first
//   head_dim * partial_rotary_factor dimensions of each head (rotate-half within them; default
//   factor 0.5), the others passed through;
// - experts: DeepSeek-V3's routing (sigmoid scores, chosen on score + e_score_correction_bias
//   within the topk_group best groups, weighted by the unbiased scores, renormalised when
//   norm_topk_prob, then times routed_scaling_factor), n_shared_experts always-on experts, and
//   the first first_k_dense_replace layers dense. The hub code masks the experts of dropped groups
//   with 0 where DeepSeek's masks them with -inf; the two choose alike unless fewer than top-k
//   kept experts score above 0, which sigmoid scores plus the released biases never do.
// - the checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the last
//   decoder layer (model.layers.{num_hidden_layers}...), which inference does not run: they are
//   left unread, as transformers leaves them.
#include <string>

#include "base/status.h"
#include "model/arch/arch.h"

namespace moeline::model::arch {

namespace {

// Qwen3-MoE's attention names (biases, per-head q/k norms) less the output bias, and DeepSeek's
// router-bias and shared-expert names: the same pairing for Hugging Face's names and GGUF's. (The
// tables read are constants, set before any code runs.)
TensorNames glm4_names(TensorNames qwen3, const TensorNames& deepseek) {
  qwen3.o_bias = "";
  qwen3.router_bias = deepseek.router_bias;
  qwen3.shared_gate = deepseek.shared_gate;
  qwen3.shared_up = deepseek.shared_up;
  qwen3.shared_down = deepseek.shared_down;
  return qwen3;
}

}  // namespace

const TensorNames kGlm4MoeNames = glm4_names(kQwen3MoeNames, kDeepseekNames);

// llama.cpp's glm4moe: its post-attention norm is post_attention_norm, not ffn_norm.
const TensorNames kGlm4MoeGgufNames = [] {
  TensorNames names = glm4_names(kQwen3MoeGgufNames, kDeepseekGgufNames);
  names.post_attention_norm = "blk.{L}.post_attention_norm.weight";
  return names;
}();

namespace {

// llama_expert_gating_func_type
constexpr int64_t kGatingSigmoid = 2;

}  // namespace

nlohmann::json gguf_config_glm4_moe(const GgufMetadata& m) {
  nlohmann::json config = gguf_common_config(m, "glm4_moe");
  // block_count counts the multi-token-prediction layers the file carries after the decoder's.
  const int64_t blocks = m.require_int("block_count");
  const int64_t next_token_layers = m.int_or("nextn_predict_layers", 0);
  if (next_token_layers < 0 || next_token_layers >= blocks)
    m.fail("nextn_predict_layers", "must be at least 0 and below block_count");
  config["num_hidden_layers"] = blocks - next_token_layers;
  const int64_t heads = m.require_int("attention.head_count");
  const int64_t head_dim =
      m.int_or("attention.key_length", heads > 0 ? m.require_int("embedding_length") / heads : 0);
  config["head_dim"] = head_dim;
  // The rotated width is the file's own integer (gguf_adjust_glm4_moe): a factor computed from it
  // and multiplied back could truncate one short.
  config["partial_rotary_factor"] = 1.0;
  if (!m.has("rope.freq_base")) config["rope_theta"] = 10000.0;
  // llama.cpp reads the biases and q/k norms when the file has them; so does moeline.
  config["attention_bias"] = m.has_tensor("blk.0.attn_q.bias");
  config["use_qk_norm"] = m.has_tensor("blk.0.attn_q_norm.weight");
  const int64_t gating = m.int_or("expert_gating_func", kGatingSigmoid);
  if (gating != kGatingSigmoid)
    m.fail("expert_gating_func",
           "is " + std::to_string(gating) + "; GLM-4.5 gates with 2 (sigmoid)");
  gguf_deepseek_moe_config(m, config);
  return config;
}

void gguf_adjust_glm4_moe(const GgufMetadata& m, ModelConfig& out) {
  const int64_t rotated = m.int_or("rope.dimension_count", out.head_dim);
  if (rotated < 2 || rotated > out.head_dim || rotated % 2 != 0)
    m.fail("rope.dimension_count", "is " + std::to_string(rotated) +
                                       "; RoPE needs an even number of dimensions, at least 2 "
                                       "and at most the head's " +
                                       std::to_string(out.head_dim));
  out.rotary_dim = rotated == out.head_dim ? 0 : rotated;
}

void parse_glm4_moe(const nlohmann::json& config, ModelConfig& out) {
  out.family = model::Family::kGlm4Moe;
  parse_common(config, out, {.partial_rotary_default = 0.5});
  out.rms_norm_eps = static_cast<float>(number_or(config, "rms_norm_eps", 1e-5));
  out.attention_bias = bool_or(config, "attention_bias", false);
  out.qk_norm = bool_or(config, "use_qk_norm", false);
  parse_deepseek_moe(config, out,
                     {.shared_experts = 1,
                      .first_dense = 1,
                      .n_group = 1,
                      .topk_group = 1,
                      .routed_scaling_factor = 1.0,
                      .v3_routing = true,
                      .renormalise_single_expert = true});
}

}  // namespace moeline::model::arch
