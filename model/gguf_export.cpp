#include "model/gguf_export.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <vector>

#include "kernels/cpu/quant.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/thread_pool.h"
#include "model/arch/arch.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace moeline::model {
namespace {

using kernels::DType;
using nlohmann::json;
namespace fs = std::filesystem;

// GGUF metadata value types.
enum ValueType : uint32_t { kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9 };
constexpr uint64_t kAlignment = 32;

class Bytes {
 public:
  template <typename T>
  void put(T value) {
    const auto* p = reinterpret_cast<const char*>(&value);
    data_.insert(data_.end(), p, p + sizeof(T));
  }
  void text(const std::string& s) {
    put<uint64_t>(s.size());
    data_.insert(data_.end(), s.begin(), s.end());
  }
  const std::vector<char>& data() const { return data_; }

 private:
  std::vector<char> data_;
};

// The header of a GGUF file: typed metadata, then the tensor table.
class GgufHeader {
 public:
  void u32(const std::string& key, uint64_t value) {
    scalar<uint32_t>(key, kU32, static_cast<uint32_t>(value));
  }
  void f32(const std::string& key, double value) {
    scalar<float>(key, kF32, static_cast<float>(value));
  }
  void boolean(const std::string& key, bool value) { scalar<uint8_t>(key, kBool, value ? 1 : 0); }
  void string(const std::string& key, const std::string& value) {
    begin(key, kString);
    metadata_.text(value);
  }
  void strings(const std::string& key, const std::vector<std::string>& values) {
    begin(key, kArray);
    metadata_.put<uint32_t>(kString);
    metadata_.put<uint64_t>(values.size());
    for (const std::string& v : values) metadata_.text(v);
  }
  template <typename T>
  void array(const std::string& key, ValueType element, const std::vector<T>& values) {
    begin(key, kArray);
    metadata_.put<uint32_t>(element);
    metadata_.put<uint64_t>(values.size());
    for (T v : values) metadata_.put<T>(v);
  }
  // A tensor of `dims` (a row's length first) stored as `dtype`; returns its byte count.
  uint64_t tensor(const std::string& name, DType dtype, const std::vector<int64_t>& dims) {
    int64_t elements = 1;
    for (int64_t d : dims) elements *= d;
    const uint64_t bytes = kernels::stored_bytes(dtype, elements);
    tensors_.text(name);
    tensors_.put<uint32_t>(static_cast<uint32_t>(dims.size()));
    for (int64_t d : dims) tensors_.put<uint64_t>(static_cast<uint64_t>(d));
    tensors_.put<uint32_t>(static_cast<uint32_t>(kernels::quant_type(dtype)));
    tensors_.put<uint64_t>(offset_);
    offset_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
    ++tensor_count_;
    return bytes;
  }
  void write(std::ofstream& out) const {
    Bytes head;
    head.put<uint32_t>(0x46554747);  // "GGUF"
    head.put<uint32_t>(3);
    head.put<uint64_t>(tensor_count_);
    head.put<uint64_t>(metadata_count_);
    out.write(head.data().data(), static_cast<std::streamsize>(head.data().size()));
    out.write(metadata_.data().data(), static_cast<std::streamsize>(metadata_.data().size()));
    out.write(tensors_.data().data(), static_cast<std::streamsize>(tensors_.data().size()));
    const uint64_t size = head.data().size() + metadata_.data().size() + tensors_.data().size();
    const std::vector<char> pad((kAlignment - size % kAlignment) % kAlignment, 0);
    out.write(pad.data(), static_cast<std::streamsize>(pad.size()));
  }

 private:
  template <typename T>
  void scalar(const std::string& key, ValueType type, T value) {
    begin(key, type);
    metadata_.put<T>(value);
  }
  void begin(const std::string& key, ValueType type) {
    metadata_.text(key);
    metadata_.put<uint32_t>(type);
    ++metadata_count_;
  }
  Bytes metadata_, tensors_;
  uint64_t metadata_count_ = 0, tensor_count_ = 0, offset_ = 0;
};

// A tensor to write: its GGUF name, shape (outermost first) and how to make its float values.
struct Planned {
  std::string name;
  std::vector<int64_t> shape;
  std::function<std::vector<float>()> values;
  DType dtype = DType::kF32;
};

// Where a planned tensor's float values come from: the checkpoint, whose FP8 weights are
// multiplied by their `_scale_inv` blocks. Copied into the plan's closures (the Planner is gone
// by the time they run; the checkpoint is not).
struct TensorSource {
  const Checkpoint* checkpoint = nullptr;
  int64_t fp8_block_rows = 0, fp8_block_cols = 0;

  std::vector<float> floats(const TensorInfo& tensor) const {
    std::vector<float> out(static_cast<size_t>(tensor.elements()));
    const DType dtype = supported_dtype(tensor);
    if (!kernels::has_block_scales(dtype)) {
      kernels::widen(tensor.data, dtype, tensor.elements(), out.data());
      return out;
    }
    const int64_t cols = tensor.shape.back(), rows = tensor.elements() / cols;
    const TensorInfo* scales = checkpoint->find(tensor.name + "_scale_inv");
    const int64_t column_blocks =
        fp8_block_cols > 0 ? (cols + fp8_block_cols - 1) / fp8_block_cols : 0;
    if (fp8_block_rows <= 0 || !scales || scales->dtype_name != "F32" ||
        scales->elements() != (rows + fp8_block_rows - 1) / fp8_block_rows * column_blocks)
      throw StatusError(tensor.file_name() + ": FP8 tensor '" + tensor.name +
                        "' has no F32 '_scale_inv' of config.json's weight_block_size");
    // The table copied out (safetensors does not align it), then each row widened by the
    // kernels' own rule for block-scaled weights.
    std::vector<float> table(static_cast<size_t>(scales->elements()));
    std::memcpy(table.data(), scales->data, table.size() * sizeof(float));
    kernels::MatrixView view{tensor.data, dtype, rows, cols};
    view.block_scales = table.data();
    view.scale_block_rows = static_cast<int32_t>(fp8_block_rows);
    view.scale_block_cols = static_cast<int32_t>(fp8_block_cols);
    for (int64_t r = 0; r < rows; ++r) kernels::widen_row(view, r, out.data() + r * cols);
    return out;
  }
};

// In each of `groups` consecutive groups of rows, the `count` rows from `first` reordered from
// rotate-half order (first halves, then second halves) to adjacent pairs, as
// convert_hf_to_gguf.py's LlamaModel.permute does to whole heads.
std::vector<float> permute_rotate_half(std::vector<float> w, int64_t cols, int64_t groups,
                                       int64_t first, int64_t count) {
  const int64_t group_rows = static_cast<int64_t>(w.size()) / cols / groups;
  const std::vector<float> in = w;
  const int64_t half = count / 2;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t pair = 0; pair < 2; ++pair) {
        const int64_t base = g * group_rows + first;
        const int64_t from = base + pair * half + i, to = base + 2 * i + pair;
        std::copy_n(in.begin() + from * cols, cols, w.begin() + to * cols);
      }
  return w;
}

bool use_more_bits(int64_t layer, int64_t layers) {
  return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

struct TypeChoice {
  std::string name;
  DType base = DType::kF32;
  bool mix = false;
  uint32_t file_type = 0;  // llama_ftype
};

std::optional<TypeChoice> type_choice(const std::string& name) {
  const std::map<std::string, TypeChoice> choices = {
      {"f32", {"f32", DType::kF32, false, 0}},
      {"f16", {"f16", DType::kF16, false, 1}},
      {"bf16", {"bf16", DType::kBF16, false, 32}},
      {"q8_0", {"q8_0", DType::kQ8_0, false, 7}},
      {"q4_0", {"q4_0", DType::kQ4_0, false, 2}},
      {"q4_k", {"q4_k", DType::kQ4_K, false, 15}},
      {"q5_k", {"q5_k", DType::kQ5_K, false, 17}},
      {"q6_k", {"q6_k", DType::kQ6_K, false, 18}},
      {"q4_k_m", {"q4_k_m", DType::kQ4_K, true, 15}},
      {"q5_k_m", {"q5_k_m", DType::kQ5_K, true, 17}}};
  const auto it = choices.find(name);
  if (it == choices.end()) return std::nullopt;
  return it->second;
}

// llama.cpp's choice of type per tensor (llama-quant.cpp) for the K-quant mixes; the base type
// everywhere for the others.
class TypePolicy {
 public:
  TypePolicy(TypeChoice choice, int64_t layers, int64_t experts)
      : choice_(std::move(choice)), layers_(layers), experts_(experts) {}

  DType of(const std::string& name, const std::vector<int64_t>& shape) {
    if (shape.size() < 2 || !name.ends_with(".weight") ||
        name.find("ffn_gate_inp") != std::string::npos || name.find("_norm") != std::string::npos)
      return DType::kF32;
    DType type = choice_.base;
    if (choice_.mix) {
      const int64_t layer = name.starts_with("blk.") ? std::stoll(name.substr(4)) : 0;
      const auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
      if (name == "output.weight") {
        type = DType::kQ6_K;
      } else if (has("attn_v.") || has("attn_kv_b.")) {
        type = experts_ == 8 ? DType::kQ8_0
                             : (use_more_bits(value_matrices_, layers_) ? DType::kQ6_K : type);
        ++value_matrices_;
      } else if (has("attn_k.") && experts_ == 8) {
        type = DType::kQ8_0;
      } else if (has("attn_output.") && experts_ == 8) {
        type = DType::kQ5_K;
      } else if (has("ffn_down") && use_more_bits(layer, layers_)) {
        type = DType::kQ6_K;
      }
    }
    const int64_t row = shape.back();
    for (DType candidate : {type, DType::kQ8_0, DType::kF16})
      if (row % kernels::dtype_block(candidate).elements == 0) return candidate;
    return DType::kF32;
  }

 private:
  TypeChoice choice_;
  int64_t layers_, experts_;
  int64_t value_matrices_ = 0;
};

using Names = arch::TensorNames;
using Field = std::string_view Names::*;
// The per-layer tensors that map one to one (experts and kv_b_proj are reshaped).
constexpr Field kLayerFields[] = {&Names::input_norm, &Names::post_attention_norm,
                                  &Names::q_proj,     &Names::k_proj,
                                  &Names::v_proj,     &Names::o_proj,
                                  &Names::q_bias,     &Names::k_bias,
                                  &Names::v_bias,     &Names::o_bias,
                                  &Names::q_norm,     &Names::k_norm,
                                  &Names::router,     &Names::router_bias,
                                  &Names::q_a_proj,   &Names::q_a_norm,
                                  &Names::q_b_proj,   &Names::kv_a_proj,
                                  &Names::kv_a_norm,  &Names::shared_gate,
                                  &Names::shared_up,  &Names::shared_down,
                                  &Names::dense_gate, &Names::dense_up,
                                  &Names::dense_down};

class Planner {
 public:
  Planner(const Checkpoint& checkpoint, const ModelConfig& config, const arch::Family& family)
      : checkpoint_(checkpoint),
        c_(config),
        hf_(*family.names),
        gguf_(*family.gguf_names),
        source_{&checkpoint, config.fp8_block_rows, config.fp8_block_cols} {}

  std::vector<Planned> plan() {
    one_to_one("token_embd.weight", std::string(hf_.embed_tokens));
    for (int64_t l = 0; l < c_.num_layers; ++l) layer(l);
    one_to_one("output_norm.weight", std::string(hf_.final_norm));
    if (!c_.tie_word_embeddings) one_to_one("output.weight", std::string(hf_.lm_head));
    return std::move(plan_);
  }

 private:
  const TensorInfo& need(const std::string& name) const {
    const TensorInfo* tensor = checkpoint_.find(name);
    if (!tensor) throw StatusError(checkpoint_.describe() + ": tensor '" + name + "' is missing");
    return *tensor;
  }

  void one_to_one(const std::string& gguf, const std::string& hf,
                  std::function<std::vector<float>(std::vector<float>)> transform = nullptr) {
    const TensorInfo* tensor = &need(hf);
    plan_.push_back({gguf, tensor->shape, [tensor, transform, source = source_] {
                       std::vector<float> values = source.floats(*tensor);
                       return transform ? transform(std::move(values)) : values;
                     }});
  }

  void layer(int64_t l) {
    const bool llama_layout = c_.family == Family::kMixtral;
    for (Field field : kLayerFields) {
      if ((gguf_.*field).empty() || (hf_.*field).empty()) continue;
      std::string hf = arch::tensor_name(hf_.*field, l);
      if (field == &Names::router && !checkpoint_.find(hf) && !hf_.router_alternative.empty())
        hf = arch::tensor_name(hf_.router_alternative, l);
      if (!checkpoint_.find(hf)) continue;
      const std::string gguf = arch::tensor_name(gguf_.*field, l);
      const bool query = field == &Names::q_proj || field == &Names::q_bias;
      const bool key = field == &Names::k_proj || field == &Names::k_bias;
      const TensorInfo& tensor = need(hf);
      const int64_t cols = tensor.shape.size() > 1 ? tensor.shape[1] : 1;
      // DeepSeek checkpoints with rope_interleave false keep their rope dimensions in
      // rotate-half order: llama.cpp's deepseek2 rotates adjacent pairs.
      const bool deepseek_rope = c_.mla && !c_.rope_interleaved;
      // The closures run after the planner is gone: they capture values only.
      const int64_t rope = c_.qk_rope_head_dim, qk = c_.qk_nope_head_dim + rope;
      const int64_t heads_all = c_.num_heads, lora = c_.kv_lora_rank;
      if (llama_layout && (query || key)) {
        const int64_t heads = query ? c_.num_heads : c_.num_kv_heads;
        const int64_t head_rows = c_.head_dim;
        one_to_one(gguf, hf, [=](std::vector<float> w) {
          return permute_rotate_half(std::move(w), cols, heads, 0, head_rows);
        });
      } else if (deepseek_rope && (field == &Names::q_proj || field == &Names::q_b_proj)) {
        one_to_one(gguf, hf, [=](std::vector<float> w) {
          return permute_rotate_half(std::move(w), cols, heads_all, qk - rope, rope);
        });
      } else if (deepseek_rope && field == &Names::kv_a_proj) {
        one_to_one(gguf, hf, [=](std::vector<float> w) {
          return permute_rotate_half(std::move(w), cols, 1, lora, rope);
        });
      } else {
        one_to_one(gguf, hf);
      }
    }
    if (c_.mla) split_kv_b(l);
    if (c_.layer_is_moe[static_cast<size_t>(l)]) experts(l);
    if (c_.shared_expert_gate && c_.layer_is_moe[static_cast<size_t>(l)]) {
      // [1, hidden] in the checkpoint, a vector in llama.cpp's files.
      const TensorInfo* gate = &need(arch::tensor_name(hf_.shared_expert_gate, l));
      const TensorSource source = source_;
      plan_.push_back({arch::tensor_name(gguf_.shared_expert_gate, l), {c_.hidden_size}, [=] {
                         return source.floats(*gate);
                       }});
    }
  }

  // kv_b_proj [heads * (nope + v), kv_lora] -> attn_k_b [heads, kv_lora, nope] (each head's key
  // rows transposed) and attn_v_b [heads, v, kv_lora].
  void split_kv_b(int64_t l) {
    const TensorInfo* kv_b = &need(arch::tensor_name(hf_.kv_b_proj, l));
    const int64_t heads = c_.num_heads, nope = c_.qk_nope_head_dim, vd = c_.v_head_dim;
    const int64_t lora = c_.kv_lora_rank;
    const TensorSource source = source_;
    plan_.push_back({arch::tensor_name(gguf_.kv_b_key_t, l), {heads, lora, nope}, [=] {
                       const std::vector<float> w = source.floats(*kv_b);
                       std::vector<float> out(static_cast<size_t>(heads * lora * nope));
                       for (int64_t h = 0; h < heads; ++h)
                         for (int64_t d = 0; d < nope; ++d)
                           for (int64_t c = 0; c < lora; ++c)
                             out[static_cast<size_t>((h * lora + c) * nope + d)] =
                                 w[static_cast<size_t>((h * (nope + vd) + d) * lora + c)];
                       return out;
                     }});
    plan_.push_back({arch::tensor_name(gguf_.kv_b_value, l), {heads, vd, lora}, [=] {
                       const std::vector<float> w = source.floats(*kv_b);
                       std::vector<float> out;
                       out.reserve(static_cast<size_t>(heads * vd * lora));
                       for (int64_t h = 0; h < heads; ++h)
                         out.insert(out.end(), w.begin() + (h * (nope + vd) + nope) * lora,
                                    w.begin() + (h * (nope + vd) + nope + vd) * lora);
                       return out;
                     }});
  }

  // The experts of a layer stacked per matrix: [experts, inter, hidden] gate and up,
  // [experts, hidden, inter] down, from per-expert tensors or the fused gate_up layout.
  void experts(int64_t l) {
    const int64_t E = c_.num_experts, inter = c_.expert_intermediate_size, H = c_.hidden_size;
    const Field parts[] = {&Names::stacked_gate, &Names::stacked_up, &Names::stacked_down};
    const Field single[] = {&Names::expert_gate, &Names::expert_up, &Names::expert_down};
    const bool fused =
        !hf_.fused_gate_up.empty() && checkpoint_.find(arch::tensor_name(hf_.fused_gate_up, l));
    const TensorSource source = source_;
    for (int m = 0; m < 3; ++m) {
      const std::vector<int64_t> shape =
          m < 2 ? std::vector<int64_t>{E, inter, H} : std::vector<int64_t>{E, H, inter};
      std::vector<const TensorInfo*> sources;
      if (fused) {
        sources.push_back(&need(arch::tensor_name(m < 2 ? hf_.fused_gate_up : hf_.fused_down, l)));
      } else {
        for (int64_t e = 0; e < E; ++e)
          sources.push_back(&need(arch::tensor_name(hf_.*single[m], l, e)));
      }
      plan_.push_back({arch::tensor_name(gguf_.*parts[m], l), shape, [=] {
                         std::vector<float> out;
                         out.reserve(static_cast<size_t>(E * inter * H));
                         if (!fused) {
                           for (const TensorInfo* t : sources) {
                             const std::vector<float> w = source.floats(*t);
                             out.insert(out.end(), w.begin(), w.end());
                           }
                           return out;
                         }
                         const std::vector<float> w = source.floats(*sources[0]);
                         if (m == 2) return w;
                         // gate_up [E, 2 * inter, H]: gate rows first, then up rows.
                         for (int64_t e = 0; e < E; ++e) {
                           const auto begin = w.begin() + (e * 2 * inter + m * inter) * H;
                           out.insert(out.end(), begin, begin + inter * H);
                         }
                         return out;
                       }});
    }
  }

  const Checkpoint& checkpoint_;
  const ModelConfig& c_;
  const Names& hf_;
  const Names& gguf_;
  TensorSource source_;
  std::vector<Planned> plan_;
};

void architecture_keys(GgufHeader& h, const ModelConfig& c, const json& raw,
                       const std::string& arch) {
  auto key = [&](const char* name) { return arch + "." + name; };
  h.u32(key("context_length"), c.max_position_embeddings > 0 ? c.max_position_embeddings : 4096);
  h.u32(key("embedding_length"), c.hidden_size);
  h.u32(key("block_count"), c.num_layers);
  h.u32(key("attention.head_count"), c.num_heads);
  h.f32(key("attention.layer_norm_rms_epsilon"), c.rms_norm_eps);
  h.f32(key("rope.freq_base"), c.rope_theta);
  h.u32(key("expert_count"), c.num_experts);
  h.u32(key("expert_used_count"), c.experts_per_token);
  h.u32(key("vocab_size"), c.vocab_size);
  const auto no_window = [&] {
    if (c.sliding_window > 0)
      throw StatusError("sliding-window attention cannot be written as GGUF (llama.cpp's " + arch +
                        " has none)");
  };
  if (c.family == Family::kMixtral) {
    no_window();
    h.u32(key("attention.head_count_kv"), c.num_kv_heads);
    h.u32(key("attention.key_length"), c.head_dim);
    h.u32(key("attention.value_length"), c.head_dim);
    h.u32(key("rope.dimension_count"), c.head_dim);
    h.u32(key("feed_forward_length"), c.expert_intermediate_size);
    return;
  }
  if (c.family == Family::kOlmoe) {
    // llama.cpp's olmoe sizes both q/k norms {n_embd} (multi-head attention only), has no biases,
    // no clamp and no renormalisation.
    const auto refuse = [&](const std::string& what) {
      throw StatusError("an OLMoE with " + what +
                        " cannot be written as GGUF (llama.cpp's olmoe "
                        "has no such setting)");
    };
    if (c.num_kv_heads != c.num_heads) refuse("grouped-query attention");
    if (c.attention_bias) refuse("attention biases");
    if (c.clip_qkv > 0) refuse("clip_qkv");
    if (c.norm_topk_prob) refuse("norm_topk_prob true");
    h.u32(key("attention.head_count_kv"), c.num_kv_heads);
    h.u32(key("feed_forward_length"), c.expert_intermediate_size);
    return;
  }
  if (c.family == Family::kQwen2Moe || c.family == Family::kQwen3Moe) {
    const bool qwen2 = c.family == Family::kQwen2Moe;
    no_window();
    if (std::find(c.layer_is_moe.begin(), c.layer_is_moe.end(), false) != c.layer_is_moe.end())
      throw StatusError(std::string("a ") + (qwen2 ? "Qwen2" : "Qwen3") +
                        "-MoE with dense layers cannot be written as GGUF (llama.cpp's " + arch +
                        " has experts in every layer)");
    if (qwen2 && c.norm_topk_prob)
      throw StatusError(
          "a Qwen2-MoE with norm_topk_prob true cannot be written as GGUF (llama.cpp's "
          "qwen2moe never renormalises the chosen experts' weights)");
    h.u32(key("attention.head_count_kv"), c.num_kv_heads);
    h.u32(key("attention.key_length"), c.head_dim);
    h.u32(key("attention.value_length"), c.head_dim);
    h.u32(key("feed_forward_length"), c.dense_intermediate_size);
    h.u32(key("expert_feed_forward_length"), c.expert_intermediate_size);
    if (qwen2) {
      h.u32(key("expert_shared_feed_forward_length"), c.shared_intermediate_size);
    } else {
      h.boolean(key("expert_weights_norm"), c.norm_topk_prob);
    }
    return;
  }
  // DeepSeekMoE's keys (DeepSeek-V2/V3, GLM-4.5): leading dense layers, shared experts, the gate.
  const auto deepseek_moe_keys = [&] {
    int64_t leading_dense = 0;
    while (leading_dense < c.num_layers && !c.layer_is_moe[static_cast<size_t>(leading_dense)])
      ++leading_dense;
    for (int64_t l = leading_dense; l < c.num_layers; ++l)
      if (!c.layer_is_moe[static_cast<size_t>(l)])
        throw StatusError(
            "dense layers after the first MoE layer (moe_layer_freq > 1) cannot be "
            "written as GGUF (llama.cpp's " +
            arch + " has leading dense layers only)");
    h.u32(key("feed_forward_length"), c.dense_intermediate_size);
    h.u32(key("expert_feed_forward_length"), c.expert_intermediate_size);
    h.u32(key("expert_shared_count"), c.shared_intermediate_size / c.expert_intermediate_size);
    h.u32(key("leading_dense_block_count"), leading_dense);
    // llama.cpp scales whenever the key is set; moeline's config scales renormalised weights
    // only for V3 and GLM: write the factor where it applies.
    const bool scaled = !c.norm_topk_prob || c.scale_normalised_weights;
    h.f32(key("expert_weights_scale"), scaled ? c.routed_scaling_factor : 1.0);
    h.boolean(key("expert_weights_norm"), c.norm_topk_prob);
    h.u32(key("expert_gating_func"), c.router_scoring == RouterScoring::kSigmoid ? 2 : 1);
    if (c.group_limit != GroupLimit::kNone && c.n_group > 1) {
      h.u32(key("expert_group_count"), c.n_group);
      h.u32(key("expert_group_used_count"), c.topk_group);
    }
  };
  if (c.family == Family::kGlm4Moe) {
    // Grouped-query attention with RoPE over rope.dimension_count leading dimensions of each
    // head (rotate-half: llama.cpp's glm4moe is NEOX); no multi-token-prediction layer written.
    no_window();
    h.u32(key("attention.head_count_kv"), c.num_kv_heads);
    h.u32(key("attention.key_length"), c.head_dim);
    h.u32(key("attention.value_length"), c.head_dim);
    h.u32(key("rope.dimension_count"), c.rotary_dim > 0 ? c.rotary_dim : c.head_dim);
    h.u32(key("nextn_predict_layers"), 0);
    deepseek_moe_keys();
    return;
  }
  // DeepSeek-V2/V3: MLA in its absorbed form, as llama.cpp writes it since 2025-04.
  h.u32(key("attention.head_count_kv"), 1);
  h.u32(key("attention.key_length"), c.kv_lora_rank + c.qk_rope_head_dim);
  h.u32(key("attention.value_length"), c.kv_lora_rank);
  h.u32(key("attention.key_length_mla"), c.qk_nope_head_dim + c.qk_rope_head_dim);
  h.u32(key("attention.value_length_mla"), c.v_head_dim);
  if (c.q_lora_rank > 0) h.u32(key("attention.q_lora_rank"), c.q_lora_rank);
  h.u32(key("attention.kv_lora_rank"), c.kv_lora_rank);
  h.u32(key("rope.dimension_count"), c.qk_rope_head_dim);
  deepseek_moe_keys();
  if (c.rope_yarn_factor > 0) {
    const json& scaling = raw.contains("rope_scaling") && raw["rope_scaling"].is_object()
                              ? raw["rope_scaling"]
                              : raw.value("rope_parameters", json::object());
    const double mscale = scaling.value("mscale", 1.0), all = scaling.value("mscale_all_dim", 0.0);
    if (std::abs(mscale - all) > 1e-9)
      throw StatusError(
          "YaRN with mscale != mscale_all_dim cannot be written as GGUF (llama.cpp "
          "keeps one of them)");
    h.string(key("rope.scaling.type"), "yarn");
    h.f32(key("rope.scaling.factor"), c.rope_yarn_factor);
    h.u32(key("rope.scaling.original_context_length"), c.rope_original_max_positions);
    h.f32(key("rope.scaling.yarn_log_multiplier"), 0.1 * all);
  }
}

// tokenizer.ggml.* from tokenizer.json (and tokenizer_config.json), as llama.cpp's converter.
void tokenizer_keys(GgufHeader& h, const fs::path& dir) {
  std::ifstream in(dir / "tokenizer.json");
  if (!in) throw StatusError((dir / "tokenizer.json").string() + ": cannot open");
  const json doc = json::parse(in, nullptr, false);
  if (!doc.is_object() || !doc.contains("model"))
    throw StatusError("tokenizer.json: not a tokenizer");
  const json& model = doc["model"];
  std::map<std::string, int64_t> vocab = model.value("vocab", json::object());
  std::map<std::string, bool> added;  // content -> special
  for (const json& t : doc.value("added_tokens", json::array())) {
    vocab[t.value("content", "")] = t.value("id", 0);
    added[t.value("content", "")] = t.value("special", false);
  }
  int64_t size = 0;
  for (const auto& [text, id] : vocab) size = std::max(size, id + 1);
  std::vector<std::string> tokens(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i)
    tokens[static_cast<size_t>(i)] = "[PAD" + std::to_string(i) + "]";
  for (const auto& [text, id] : vocab) tokens[static_cast<size_t>(id)] = text;
  const bool byte_level = !model.value("byte_fallback", false);
  const std::string unk = model.contains("unk_token") && model["unk_token"].is_string()
                              ? model["unk_token"].get<std::string>()
                              : "";
  std::vector<int32_t> types;
  for (const std::string& t : tokens) {
    if (added.count(t)) {
      types.push_back(added[t] ? 3 : 4);  // control, user-defined
    } else if (!byte_level && t == unk) {
      types.push_back(2);
    } else if (!byte_level && t.size() == 6 && t.starts_with("<0x") && t.back() == '>') {
      types.push_back(6);
    } else {
      types.push_back(1);
    }
  }
  std::vector<std::string> merges;
  for (const json& m : model.value("merges", json::array()))
    merges.push_back(m.is_string() ? m.get<std::string>()
                                   : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  h.string("tokenizer.ggml.model", byte_level ? "gpt2" : "llama");
  h.string("tokenizer.ggml.pre", byte_level ? "qwen2" : "default");
  h.strings("tokenizer.ggml.tokens", tokens);
  h.array<int32_t>("tokenizer.ggml.token_type", kI32, types);
  if (byte_level) {
    h.strings("tokenizer.ggml.merges", merges);
  } else {
    // SentencePiece scores: a piece made by an earlier merge scores higher.
    std::map<std::string, size_t> rank;
    for (size_t r = 0; r < merges.size(); ++r) {
      std::string merged = merges[r];
      merged.erase(std::remove(merged.begin(), merged.end(), ' '), merged.end());
      rank.emplace(merged, r);
    }
    std::vector<float> scores;
    for (const std::string& t : tokens)
      scores.push_back(rank.count(t) ? -static_cast<float>(rank[t]) : -1e9f);
    h.array<float>("tokenizer.ggml.scores", kF32, scores);
  }
  std::ifstream config_in(dir / "tokenizer_config.json");
  const json config = config_in ? json::parse(config_in, nullptr, false) : json::object();
  auto token_id = [&](const char* key) -> std::optional<int64_t> {
    if (!config.is_object() || !config.contains(key)) return std::nullopt;
    const json& v = config[key];
    const std::string text = v.is_string()   ? v.get<std::string>()
                             : v.is_object() ? v.value("content", "")
                                             : "";
    const auto it = vocab.find(text);
    return it == vocab.end() ? std::nullopt : std::optional<int64_t>(it->second);
  };
  if (!unk.empty() && vocab.count(unk)) h.u32("tokenizer.ggml.unknown_token_id", vocab[unk]);
  for (const auto& [key, gguf] : {std::pair{"bos_token", "tokenizer.ggml.bos_token_id"},
                                  {"eos_token", "tokenizer.ggml.eos_token_id"},
                                  {"pad_token", "tokenizer.ggml.padding_token_id"}})
    if (const auto id = token_id(key)) h.u32(gguf, static_cast<uint64_t>(*id));
  h.boolean("tokenizer.ggml.add_bos_token",
            config.is_object() && config.value("add_bos_token", false));
  // A chat_template.jinja beside it wins over tokenizer_config.json's, as in transformers.
  if (std::ifstream jinja(dir / "chat_template.jinja"); jinja) {
    h.string("tokenizer.chat_template",
             std::string(std::istreambuf_iterator<char>(jinja), std::istreambuf_iterator<char>()));
  } else if (config.is_object() && config.contains("chat_template") &&
             config["chat_template"].is_string()) {
    h.string("tokenizer.chat_template", config["chat_template"].get<std::string>());
  }
}

}  // namespace

const char* gguf_export_types() {
  return "f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k, q4_k_m, q5_k_m";
}

Expected<GgufExportReport> export_gguf(const fs::path& checkpoint_dir, const fs::path& out,
                                       const std::string& type, const Progress& progress) {
  try {
    const auto choice = type_choice(type);
    if (!choice)
      return Error{"--type '" + type + "' is not one of " + std::string(gguf_export_types())};
    const ModelConfig config = ModelConfig::load(checkpoint_dir);
    const arch::Family& family = *arch::find_family(config.model_type);
    std::ifstream raw_in(checkpoint_dir / "config.json");
    const json raw = json::parse(raw_in, nullptr, false);
    const Checkpoint checkpoint = Checkpoint::open(checkpoint_dir);

    GgufHeader header;
    const std::string arch(family.gguf_architecture);
    header.string("general.architecture", arch);
    header.string("general.name", fs::absolute(checkpoint_dir).filename().string());
    header.u32("general.file_type", choice->file_type);
    header.u32("general.quantization_version", 2);
    architecture_keys(header, config, raw, arch);
    tokenizer_keys(header, checkpoint_dir);

    std::vector<Planned> plan = Planner(checkpoint, config, family).plan();
    TypePolicy policy(*choice, config.num_layers, config.num_experts);
    GgufExportReport report;
    std::set<std::string> types;
    for (Planned& tensor : plan) {
      tensor.dtype = policy.of(tensor.name, tensor.shape);
      types.insert(std::string(kernels::dtype_name(tensor.dtype)));
      header.tensor(tensor.name, tensor.dtype,
                    std::vector<int64_t>(tensor.shape.rbegin(), tensor.shape.rend()));
    }
    for (const auto& [name, info] : checkpoint.tensors()) report.source_bytes += info.bytes;

    const fs::path partial = out.string() + ".partial";
    std::ofstream file(partial, std::ios::binary | std::ios::trunc);
    if (!file) return Error{out.string() + ": cannot write", StatusCode::kIoError};
    header.write(file);
    // Rows are quantized independently (each block's scale search sees only its block), so they
    // are spread over every core; the file does not depend on the thread count.
    kernels::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    std::vector<char> quantized;
    for (const Planned& tensor : plan) {
      const std::vector<float> values = tensor.values();
      const int64_t row = tensor.shape.back();
      const int64_t rows = static_cast<int64_t>(values.size()) / row;
      const size_t row_bytes = kernels::stored_bytes(tensor.dtype, row);
      quantized.resize(row_bytes * static_cast<size_t>(rows));
      pool.run([&](int thread, int threads) {
        const auto [begin, end] = kernels::ThreadPool::split(rows, thread, threads);
        for (int64_t r = begin; r < end; ++r)
          kernels::quantize_row(tensor.dtype, values.data() + r * row, row,
                                quantized.data() + static_cast<size_t>(r) * row_bytes);
      });
      file.write(quantized.data(), static_cast<std::streamsize>(quantized.size()));
      const size_t bytes = quantized.size();
      const std::vector<char> pad((kAlignment - bytes % kAlignment) % kAlignment, 0);
      file.write(pad.data(), static_cast<std::streamsize>(pad.size()));
      ++report.tensors;
      if (progress) progress(report.tensors, static_cast<int64_t>(plan.size()));
    }
    file.close();
    if (!file) return Error{out.string() + ": write failed (disk full?)", StatusCode::kIoError};
    fs::rename(partial, out);
    report.bytes = fs::file_size(out);
    for (const std::string& t : types) report.types += (report.types.empty() ? "" : "+") + t;
    return report;
  } catch (const StatusError& e) {
    return e.error();
  } catch (const std::exception& e) {
    return Error{checkpoint_dir.string() + ": " + e.what()};
  }
}

}  // namespace moeline::model
