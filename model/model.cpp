#include "model/model.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "model/arch/arch.h"

namespace moeline::model {
namespace {

using kernels::MatrixView;
using kernels::VectorView;

// Resolves tensor names against the checkpoint, checking dtype and exact shape. A missing tensor is
// reported once every name has been tried, so the message can list the checkpoint's tensors that
// nothing asked for — usually the misnamed one.
class TensorBinder {
 public:
  // `derived`: where copies made at load live (FP8 scale tables the file does not align).
  TensorBinder(const Checkpoint& checkpoint, const ModelConfig& config,
               std::vector<std::vector<std::byte>>& derived)
      : checkpoint_(checkpoint), config_(config), derived_(derived) {}

  MatrixView matrix(const std::string& name, int64_t rows, int64_t cols) {
    const TensorInfo* tensor = find(name, {rows, cols});
    if (!tensor) return MatrixView{};
    MatrixView view{tensor->data, supported_dtype(*tensor), rows, cols};
    if (kernels::has_block_scales(view.dtype)) bind_block_scales(*tensor, view);
    return view;
  }
  // A stacked [count, rows, cols] tensor, viewed as [count * rows, cols].
  MatrixView stacked(const std::string& name, int64_t count, int64_t rows, int64_t cols) {
    const TensorInfo* tensor = find(name, {count, rows, cols});
    if (!tensor) return MatrixView{};
    const kernels::DType dtype = supported_dtype(*tensor);
    if (kernels::has_block_scales(dtype))
      throw StatusError(tensor->file_name() + ": tensor '" + name + "' is " + tensor->dtype_name +
                        " with stacked experts; FP8 is supported for one matrix per tensor");
    return MatrixView{tensor->data, dtype, count * rows, cols};
  }
  // A [1, size] weight, stored as such or 1-D (llama.cpp writes a one-row matrix as a vector).
  MatrixView row(const std::string& name, int64_t size) {
    const TensorInfo* stored = checkpoint_.find(name);
    if (stored && stored->shape.size() == 1) {
      const TensorInfo* tensor = find(name, {size});
      return MatrixView{tensor->data, supported_dtype(*tensor), 1, size};
    }
    return matrix(name, 1, size);
  }
  bool has(const std::string& name) const { return checkpoint_.find(name) != nullptr; }
  VectorView vector(const std::string& name, int64_t size) {
    const TensorInfo* tensor = find(name, {size});
    if (!tensor) return VectorView{};
    const kernels::DType dtype = supported_dtype(*tensor);
    if (kernels::widened_before_use(dtype))
      throw StatusError(tensor->file_name() + ": tensor '" + name + "' is " + tensor->dtype_name +
                        "; norms and biases must be F32, F16 or BF16");
    return VectorView{tensor->data, dtype, size};
  }

  // Throws for the first missing tensor, naming the unused ones.
  void finish() const {
    if (missing_.empty()) return;
    std::string message = checkpoint_.describe() + ": tensor '" + missing_ + "' (shape " +
                          missing_shape_ + ") is missing";
    std::string unused;
    int listed = 0;
    for (const auto& [name, info] : checkpoint_.tensors()) {
      if (used_.count(name)) continue;
      if (listed++ < 5) unused += (unused.empty() ? "'" : ", '") + name + "'";
    }
    if (listed > 5) unused += " and " + std::to_string(listed - 5) + " more";
    if (!unused.empty()) message += "; tensors in the checkpoint that nothing uses: " + unused;
    throw StatusError(message);
  }

 private:
  // An FP8 weight's `<name>_scale_inv`: F32, one entry per block of config's weight_block_size.
  void bind_block_scales(const TensorInfo& tensor, MatrixView& view) {
    const int64_t block_rows = config_.fp8_block_rows, block_cols = config_.fp8_block_cols;
    if (block_rows <= 0)
      throw StatusError(tensor.file_name() + ": tensor '" + tensor.name + "' is " +
                        tensor.dtype_name +
                        " but config.json has no quantization_config with weight_block_size");
    const std::string scale_name = tensor.name + "_scale_inv";
    const TensorInfo* scales = find(scale_name, {(view.rows + block_rows - 1) / block_rows,
                                                 (view.cols + block_cols - 1) / block_cols});
    if (!scales) return;  // reported by finish()
    if (scales->dtype_name != "F32")
      throw StatusError(scales->file_name() + ": tensor '" + scale_name + "' is " +
                        scales->dtype_name + "; FP8 block scales must be F32");
    const void* table = scales->data;
    if (reinterpret_cast<uintptr_t>(table) % alignof(float) != 0) {
      // safetensors does not align tensors: an FP8 weight of an odd size leaves the next F32
      // table misaligned, so it is copied (it is 1/16,000 of its weight).
      derived_.emplace_back(static_cast<const std::byte*>(table),
                            static_cast<const std::byte*>(table) + scales->bytes);
      table = derived_.back().data();
    }
    view.block_scales = static_cast<const float*>(table);
    view.scale_block_rows = static_cast<int32_t>(block_rows);
    view.scale_block_cols = static_cast<int32_t>(block_cols);
  }

  const TensorInfo* find(const std::string& name, const std::vector<int64_t>& shape) {
    TensorInfo expected;
    expected.shape = shape;
    const TensorInfo* tensor = checkpoint_.find(name);
    if (!tensor) {
      if (missing_.empty()) {
        missing_ = name;
        missing_shape_ = expected.shape_string();
      }
      return nullptr;
    }
    used_.insert(name);
    if (tensor->shape != shape) {
      throw StatusError(tensor->file_name() + ": tensor '" + name + "' has shape " +
                        tensor->shape_string() + ", expected " + expected.shape_string() +
                        " from config.json");
    }
    return tensor;
  }

  const Checkpoint& checkpoint_;
  const ModelConfig& config_;
  std::vector<std::vector<std::byte>>& derived_;
  std::set<std::string> used_;
  std::string missing_, missing_shape_;
};

// Per head, the transpose of kv_b_proj's K rows: [heads][nope][kv_lora] -> [heads][kv_lora][nope],
// element by element in the stored dtype (no rounding). A quantized or FP8 kv_b_proj (a GGUF from
// before the split, DeepSeek's FP8 release) is widened first: its transpose is F32.
std::vector<std::byte> transpose_key_rows(const MatrixView& kv_b, int64_t heads, int64_t nope,
                                          int64_t value_dim) {
  if (kernels::widened_before_use(kv_b.dtype)) {
    std::vector<std::byte> widened(static_cast<size_t>(kv_b.rows * kv_b.cols) * sizeof(float));
    for (int64_t r = 0; r < kv_b.rows; ++r)
      kernels::widen_row(kv_b, r, reinterpret_cast<float*>(widened.data()) + r * kv_b.cols);
    return transpose_key_rows(
        MatrixView{widened.data(), kernels::DType::kF32, kv_b.rows, kv_b.cols}, heads, nope,
        value_dim);
  }
  const int64_t kv_lora = kv_b.cols;
  const size_t elem = kernels::dtype_size(kv_b.dtype);
  std::vector<std::byte> out(static_cast<size_t>(heads * kv_lora * nope) * elem);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < nope; ++d) {
      const std::byte* row = kv_b.row(h * (nope + value_dim) + d);
      for (int64_t c = 0; c < kv_lora; ++c)
        std::memcpy(out.data() + static_cast<size_t>((h * kv_lora + c) * nope + d) * elem,
                    row + static_cast<size_t>(c) * elem, elem);
    }
  return out;
}

}  // namespace

Expected<std::unique_ptr<Model>> Model::load(const std::filesystem::path& dir,
                                             const Progress& progress) {
  try {
    std::unique_ptr<Model> model(new Model());
    model->dir_ = dir;
    if (std::filesystem::is_regular_file(dir)) {
      model->gguf_ = std::make_shared<const GgufFile>(GgufFile::open(dir));
      model->config_ = ModelConfig::from_gguf(*model->gguf_);
      model->checkpoint_ = Checkpoint::from_gguf(*model->gguf_);
      model->load_weights(*arch::find_family(model->config_.model_type)->gguf_names, progress);
      model->model_id_ = model_id_of(model->gguf_->metadata().dump(), model->checkpoint_);
      return model;
    }
    model->config_ = ModelConfig::load(dir);
    model->checkpoint_ = Checkpoint::open(dir);
    model->load_weights(*arch::find_family(model->config_.model_type)->names, progress);
    model->model_id_ = model_id_of(dir, model->checkpoint_);
    return model;
  } catch (const StatusError& e) {
    return e.error();
  } catch (const std::exception& e) {
    return Error{dir.string() + ": " + e.what()};
  }
}

void Model::load_weights(const arch::TensorNames& names, const Progress& progress) {
  const ModelConfig& c = config_;
  TensorBinder bind(checkpoint_, config_, derived_);
  const int64_t q_width = c.num_heads * c.head_dim;
  const int64_t kv_width = c.num_kv_heads * c.head_dim;

  embed_tokens_ = bind.matrix(std::string(names.embed_tokens), c.vocab_size, c.hidden_size);
  final_norm_ = bind.vector(std::string(names.final_norm), c.hidden_size);
  lm_head_ = c.tie_word_embeddings
                 ? embed_tokens_
                 : bind.matrix(std::string(names.lm_head), c.vocab_size, c.hidden_size);

  layers_.resize(static_cast<size_t>(c.num_layers));
  experts_.resize(static_cast<size_t>(c.num_layers));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (progress) progress(l, c.num_layers);
    auto name = [l](std::string_view pattern, int64_t expert = -1) {
      return arch::tensor_name(pattern, l, expert);
    };
    LayerWeights& layer = layers_[static_cast<size_t>(l)];
    layer.input_norm = bind.vector(name(names.input_norm), c.hidden_size);
    layer.post_attention_norm = bind.vector(name(names.post_attention_norm), c.hidden_size);
    if (c.mla) {
      const int64_t heads = c.num_heads, rope = c.qk_rope_head_dim, nope = c.qk_nope_head_dim;
      const int64_t qk = nope + rope, kv_lora = c.kv_lora_rank, vd = c.v_head_dim;
      if (c.q_lora_rank > 0) {
        layer.q_a_proj = bind.matrix(name(names.q_a_proj), c.q_lora_rank, c.hidden_size);
        layer.q_a_norm = bind.vector(name(names.q_a_norm), c.q_lora_rank);
        layer.q_b_proj = bind.matrix(name(names.q_b_proj), heads * qk, c.q_lora_rank);
      } else {
        layer.q_proj = bind.matrix(name(names.q_proj), heads * qk, c.hidden_size);
      }
      layer.kv_a_proj = bind.matrix(name(names.kv_a_proj), kv_lora + rope, c.hidden_size);
      layer.kv_a_norm = bind.vector(name(names.kv_a_norm), kv_lora);
      layer.o_proj = bind.matrix(name(names.o_proj), c.hidden_size, heads * vd);
      layer.value_head_rows = vd;
      layer.kv_b_split = !names.kv_b_key_t.empty() && !bind.has(name(names.kv_b_proj)) &&
                         bind.has(name(names.kv_b_key_t));
      if (layer.kv_b_split) {
        layer.kv_b_key_t = bind.stacked(name(names.kv_b_key_t), heads, kv_lora, nope);
        layer.kv_b_value = bind.stacked(name(names.kv_b_value), heads, vd, kv_lora);
        layer.value_head_stride = vd;
      } else {
        layer.kv_b_proj = bind.matrix(name(names.kv_b_proj), heads * (nope + vd), kv_lora);
        if (layer.kv_b_proj.data) {
          derived_.push_back(transpose_key_rows(layer.kv_b_proj, heads, nope, vd));
          const kernels::DType key_dtype = kernels::widened_before_use(layer.kv_b_proj.dtype)
                                               ? kernels::DType::kF32
                                               : layer.kv_b_proj.dtype;
          layer.kv_b_key_t = MatrixView{derived_.back().data(), key_dtype, heads * kv_lora, nope};
          layer.kv_b_value = layer.kv_b_proj.row_range(nope, heads * (nope + vd) - nope);
          layer.value_head_stride = nope + vd;
        }
      }
    } else {
      layer.q_proj = bind.matrix(name(names.q_proj), q_width, c.hidden_size);
      layer.k_proj = bind.matrix(name(names.k_proj), kv_width, c.hidden_size);
      layer.v_proj = bind.matrix(name(names.v_proj), kv_width, c.hidden_size);
      layer.o_proj = bind.matrix(name(names.o_proj), c.hidden_size, q_width);
    }
    if (c.attention_bias) {
      layer.q_bias = bind.vector(name(names.q_bias), q_width);
      layer.k_bias = bind.vector(name(names.k_bias), kv_width);
      layer.v_bias = bind.vector(name(names.v_bias), kv_width);
      layer.o_bias = bind.vector(name(names.o_bias), c.hidden_size);
    }
    if (c.qk_norm) {
      layer.q_norm = bind.vector(name(names.q_norm), c.qk_norm_whole ? q_width : c.head_dim);
      layer.k_norm = bind.vector(name(names.k_norm), c.qk_norm_whole ? kv_width : c.head_dim);
    }
    layer.is_moe = c.layer_is_moe[static_cast<size_t>(l)];
    if (!layer.is_moe) {
      const int64_t inter = c.dense_intermediate_size;
      layer.dense_gate = bind.matrix(name(names.dense_gate), inter, c.hidden_size);
      layer.dense_up = bind.matrix(name(names.dense_up), inter, c.hidden_size);
      layer.dense_down = bind.matrix(name(names.dense_down), c.hidden_size, inter);
      continue;
    }
    const bool alternative_router = !names.router_alternative.empty() &&
                                    !bind.has(name(names.router)) &&
                                    bind.has(name(names.router_alternative));
    layer.router = bind.matrix(name(alternative_router ? names.router_alternative : names.router),
                               c.num_experts, c.hidden_size);
    if (c.router_correction_bias)
      layer.router_bias = bind.vector(name(names.router_bias), c.num_experts);
    if (c.shared_intermediate_size > 0) {
      const int64_t shared = c.shared_intermediate_size;
      layer.shared_gate = bind.matrix(name(names.shared_gate), shared, c.hidden_size);
      layer.shared_up = bind.matrix(name(names.shared_up), shared, c.hidden_size);
      layer.shared_down = bind.matrix(name(names.shared_down), c.hidden_size, shared);
      if (c.shared_expert_gate)
        layer.shared_expert_gate = bind.row(name(names.shared_expert_gate), c.hidden_size);
    }
    auto& experts = experts_[static_cast<size_t>(l)];
    const int64_t inter = c.expert_intermediate_size;
    const int64_t H = c.hidden_size;
    if (!names.stacked_gate.empty() &&
        (names.expert_gate.empty() || bind.has(name(names.stacked_gate)))) {
      const MatrixView gate = bind.stacked(name(names.stacked_gate), c.num_experts, inter, H);
      const MatrixView up = bind.stacked(name(names.stacked_up), c.num_experts, inter, H);
      const MatrixView down = bind.stacked(name(names.stacked_down), c.num_experts, H, inter);
      if (!gate.data || !up.data || !down.data) continue;  // reported by bind.finish()
      for (int64_t e = 0; e < c.num_experts; ++e)
        experts.push_back(offload::ExpertWeights{gate.row_range(e * inter, inter),
                                                 up.row_range(e * inter, inter),
                                                 down.row_range(e * H, H)});
      continue;
    }
    if (!names.fused_gate_up.empty() && bind.has(name(names.fused_gate_up))) {
      const MatrixView gate_up =
          bind.stacked(name(names.fused_gate_up), c.num_experts, 2 * inter, H);
      const MatrixView down = bind.stacked(name(names.fused_down), c.num_experts, H, inter);
      if (!gate_up.data || !down.data) continue;  // reported by bind.finish()
      for (int64_t e = 0; e < c.num_experts; ++e) {
        experts.push_back(offload::ExpertWeights{gate_up.row_range(e * 2 * inter, inter),
                                                 gate_up.row_range(e * 2 * inter + inter, inter),
                                                 down.row_range(e * H, H)});
      }
      continue;
    }
    for (int64_t e = 0; e < c.num_experts; ++e) {
      experts.push_back(offload::ExpertWeights{bind.matrix(name(names.expert_gate, e), inter, H),
                                               bind.matrix(name(names.expert_up, e), inter, H),
                                               bind.matrix(name(names.expert_down, e), H, inter)});
    }
  }
  bind.finish();
  if (progress) progress(c.num_layers, c.num_layers);
}

offload::ExpertCatalog Model::expert_catalog() const {
  offload::ExpertCatalog catalog;
  catalog.files = checkpoint_.file_paths();
  catalog.layers = static_cast<int>(config_.num_layers);
  catalog.experts_per_layer = static_cast<int>(std::max<int64_t>(0, config_.num_experts));
  catalog.model_id = model_id_;
  catalog.experts.resize(static_cast<size_t>(catalog.layers) *
                         static_cast<size_t>(catalog.experts_per_layer));
  for (size_t l = 0; l < experts_.size(); ++l)
    for (size_t e = 0; e < experts_[l].size(); ++e) {
      offload::ExpertCatalog::Expert& out =
          catalog.experts[l * static_cast<size_t>(catalog.experts_per_layer) + e];
      out.shape = experts_[l][e];
      const kernels::MatrixView* parts[] = {&out.shape.gate, &out.shape.up, &out.shape.down};
      for (size_t m = 0; m < 3; ++m) {
        const auto where = checkpoint_.locate(parts[m]->data);
        if (!where) throw std::logic_error("an expert view lies outside the checkpoint");
        out.ranges[m] = offload::FileRange{static_cast<uint32_t>(where->file), where->offset,
                                           parts[m]->bytes()};
      }
    }
  return catalog;
}

void Model::release_expert_mappings() const {
  // Whole pages inside the expert matrices, merged where they touch (one madvise per run).
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& layer : experts_)
    for (const offload::ExpertWeights& e : layer)
      for (const kernels::MatrixView* m : {&e.gate, &e.up, &e.down}) {
        const auto begin = reinterpret_cast<uintptr_t>(m->data);
        ranges.emplace_back(begin, begin + m->bytes());
      }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  for (const auto& [begin, end] : merged) {
    const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
    if (last <= first) continue;
    void* at = reinterpret_cast<void*>(first);
    const size_t length = last - first;
    ::madvise(at, length, MADV_NOHUGEPAGE);
    ::madvise(at, length, MADV_RANDOM);
    ::madvise(at, length, MADV_DONTNEED);
  }
}

size_t Model::bytes_touched_per_token() const {
  const ModelConfig& c = config_;
  size_t bytes = embed_tokens_.bytes() / static_cast<size_t>(c.vocab_size) + lm_head_.bytes();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& layer = layers_[static_cast<size_t>(l)];
    bytes += layer.q_proj.bytes() + layer.k_proj.bytes() + layer.v_proj.bytes() +
             layer.o_proj.bytes() + layer.q_a_proj.bytes() + layer.q_b_proj.bytes() +
             layer.kv_a_proj.bytes() +
             (layer.kv_b_split ? layer.kv_b_key_t.bytes() + layer.kv_b_value.bytes()
                               : layer.kv_b_proj.bytes());
    if (layer.is_moe) {
      bytes +=
          layer.router.bytes() + layer.shared_gate.bytes() + layer.shared_up.bytes() +
          layer.shared_down.bytes() + layer.shared_expert_gate.bytes() +
          static_cast<size_t>(c.experts_per_token) * experts_[static_cast<size_t>(l)][0].bytes();
    } else {
      bytes += layer.dense_gate.bytes() + layer.dense_up.bytes() + layer.dense_down.bytes();
    }
  }
  return bytes;
}

bool Model::has_quantized_weights() const {
  for (const auto& [name, tensor] : checkpoint_.tensors())
    for (kernels::DType quantized : kernels::kQuantizedTypes)
      if (tensor.dtype_name == kernels::dtype_name(quantized)) return true;
  return false;
}

std::string Model::dtype_summary() const {
  std::set<std::string> dtypes;
  for (const auto& [name, tensor] : checkpoint_.tensors()) dtypes.insert(tensor.dtype_name);
  std::string out;
  for (const auto& dtype : dtypes) out += (out.empty() ? "" : "+") + dtype;
  return out;
}

}  // namespace moeline::model
