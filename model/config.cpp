#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/status.h"
#include "model/arch/arch.h"
#include "model/gguf.h"

namespace moeline::model {
namespace arch {

namespace {
using nlohmann::json;

[[noreturn]] void bad_key(const char* key, const std::string& why) {
  throw StatusError(std::string("config.json: \"") + key + "\" " + why);
}

const json* present(const json& config, const char* key) {
  auto it = config.find(key);
  return it == config.end() || it->is_null() ? nullptr : &*it;
}
}  // namespace

int64_t require_int(const json& config, const char* key) {
  const json* value = present(config, key);
  if (!value) bad_key(key, "is missing");
  if (!value->is_number_integer()) bad_key(key, "must be an integer");
  return value->get<int64_t>();
}

int64_t int_or(const json& config, const char* key, int64_t fallback) {
  return present(config, key) ? require_int(config, key) : fallback;
}

double number_or(const json& config, const char* key, double fallback) {
  const json* value = present(config, key);
  if (!value) return fallback;
  if (!value->is_number()) bad_key(key, "must be a number");
  return value->get<double>();
}

bool bool_or(const json& config, const char* key, bool fallback) {
  const json* value = present(config, key);
  if (!value) return fallback;
  if (!value->is_boolean()) bad_key(key, "must be true or false");
  return value->get<bool>();
}

double rope_theta_or(const json& config, double fallback) {
  // transformers 5 writes RoPE settings as "rope_parameters": {"rope_type": ..., "rope_theta": ...}
  // and may leave out the top-level rope_theta; older files have only the top-level key.
  const json* parameters = present(config, "rope_parameters");
  if (!parameters) return number_or(config, "rope_theta", fallback);
  if (!parameters->is_object()) bad_key("rope_parameters", "must be an object");
  for (const auto& [key, value] : parameters->items())
    if (value.is_object())
      bad_key("rope_parameters",
              "has per-layer-type settings ('" + key + "'), which these model families do not use");
  const json* type = present(*parameters, "rope_type");
  if (type && *type != "default")
    bad_key("rope_parameters", "has rope_type " + type->dump() + "; only \"default\" is supported");
  if (const json* theta = present(*parameters, "rope_theta")) {
    if (!theta->is_number()) bad_key("rope_parameters", "has a rope_theta that is not a number");
    return theta->get<double>();
  }
  return number_or(config, "rope_theta", fallback);
}

void parse_quantization(const json& quantization, ModelConfig& out);

namespace {

// partial_rotary_factor: top-level (transformers 4) or in rope_parameters (transformers 5).
const json* partial_rotary_factor(const json& config) {
  const json* parameters = present(config, "rope_parameters");
  if (const json* inner = parameters && parameters->is_object()
                              ? present(*parameters, "partial_rotary_factor")
                              : nullptr)
    return inner;
  return present(config, "partial_rotary_factor");
}

// How many dimensions of each head RoPE turns: int(head_dim * factor), as transformers sizes its
// frequency table; 0 (all of them) when the factor is 1.
int64_t parse_rotary_dim(const json& config, int64_t head_dim, double family_default) {
  const json* given = partial_rotary_factor(config);
  if (given && !given->is_number()) bad_key("partial_rotary_factor", "must be a number");
  const double factor = given ? given->get<double>() : family_default > 0 ? family_default : 1.0;
  if (factor == 1.0) return 0;
  if (family_default == 0)
    bad_key(
        "partial_rotary_factor",
        "is " + given->dump() + "; this model family rotates whole heads (only 1 is supported)");
  if (!(factor > 0 && factor < 1)) bad_key("partial_rotary_factor", "must be in (0, 1]");
  const auto dim = static_cast<int64_t>(static_cast<double>(head_dim) * factor);
  if (dim < 2 || dim % 2 != 0)
    bad_key("partial_rotary_factor", "leaves " + std::to_string(dim) + " of head_dim " +
                                         std::to_string(head_dim) +
                                         " rotated; RoPE needs an even number, at least 2");
  return dim;
}

}  // namespace

void parse_common(const json& config, ModelConfig& out, const CommonKeys& keys) {
  const bool rope_scaling_parsed = keys.rope_scaling_parsed;
  out.vocab_size = require_int(config, "vocab_size");
  out.hidden_size = require_int(config, "hidden_size");
  out.num_layers = require_int(config, "num_hidden_layers");
  out.num_heads = require_int(config, "num_attention_heads");
  out.num_kv_heads = int_or(config, "num_key_value_heads", out.num_heads);
  if (out.num_heads <= 0) bad_key("num_attention_heads", "must be positive");
  out.head_dim = int_or(config, "head_dim", 0);
  if (out.head_dim == 0) {
    if (out.hidden_size % out.num_heads != 0)
      bad_key("hidden_size", "is not a multiple of num_attention_heads and head_dim is not set");
    out.head_dim = out.hidden_size / out.num_heads;
  }
  out.rotary_dim = parse_rotary_dim(config, out.head_dim, keys.partial_rotary_default);
  out.max_position_embeddings = int_or(config, "max_position_embeddings", 0);
  if (!rope_scaling_parsed) out.rope_theta = rope_theta_or(config, 10000.0);
  out.rms_norm_eps = static_cast<float>(number_or(config, "rms_norm_eps", 1e-6));
  out.tie_word_embeddings = bool_or(config, "tie_word_embeddings", false);
  if (const json* act = present(config, "hidden_act"); act && *act != "silu")
    bad_key("hidden_act", "is " + act->dump() + "; only \"silu\" is supported");
  if (const json* scaling = present(config, "rope_scaling"); scaling && !rope_scaling_parsed) {
    const json* type = scaling->is_object() ? present(*scaling, "rope_type") : nullptr;
    if (!type && scaling->is_object()) type = present(*scaling, "type");
    if (!type || *type != "default")
      bad_key("rope_scaling", "is " + scaling->dump() + "; only null or \"default\" is supported");
  }
  if (const json* bos = present(config, "bos_token_id"); bos && bos->is_number_integer())
    out.bos_token_id = bos->get<int64_t>();
  if (const json* quantization = present(config, "quantization_config"))
    parse_quantization(*quantization, out);
}

// The one quantization a Hugging Face checkpoint may declare here: block-scaled FP8 as DeepSeek-V3
// and Qwen3's FP8 releases store it. Any other method (GPTQ, AWQ, bitsandbytes...) would be read
// as garbage, so it is refused by name.
void parse_quantization(const json& quantization, ModelConfig& out) {
  if (!quantization.is_object()) bad_key("quantization_config", "must be an object");
  const json* method = present(quantization, "quant_method");
  if (!method || *method != "fp8")
    bad_key("quantization_config",
            "has quant_method " + (method ? method->dump() : std::string("(none)")) +
                "; only \"fp8\" (block-scaled float8_e4m3fn weights) is supported; convert "
                "other quantizations to GGUF or BF16");
  if (const json* format = present(quantization, "fmt"); format && *format != "e4m3")
    bad_key("quantization_config", "has fmt " + format->dump() + "; only \"e4m3\" is supported");
  const json* block = present(quantization, "weight_block_size");
  if (!block || !block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0].get<int64_t>() <= 0 ||
      (*block)[1].get<int64_t>() <= 0 || (*block)[0].get<int64_t>() > (1 << 20) ||
      (*block)[1].get<int64_t>() > (1 << 20))
    bad_key("quantization_config",
            "needs weight_block_size [rows, columns] of positive integers (per-tensor FP8 scales "
            "are not supported)");
  out.fp8_block_rows = (*block)[0].get<int64_t>();
  out.fp8_block_cols = (*block)[1].get<int64_t>();
}

}  // namespace arch

namespace {

using nlohmann::json;

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw StatusError(path.string() + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw StatusError(path.filename().string() + ": not valid JSON: " + e.what());
  }
}

std::vector<int64_t> token_ids(const json& value) {
  if (value.is_number_integer()) return {value.get<int64_t>()};
  std::vector<int64_t> ids;
  if (value.is_array())
    for (const json& id : value)
      if (id.is_number_integer()) ids.push_back(id.get<int64_t>());
  return ids;
}

void validate(const ModelConfig& c) {
  auto positive = [](int64_t value, const char* what) {
    if (value <= 0) throw StatusError(std::string("config.json: ") + what + " must be positive");
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.num_layers, "num_hidden_layers");
  positive(c.num_kv_heads, "num_key_value_heads");
  positive(c.head_dim, "head_dim");
  positive(c.num_experts, "the number of experts");
  positive(c.experts_per_token, "num_experts_per_tok");
  positive(c.expert_intermediate_size, "the expert intermediate size");
  // Bounds far above any published model, checked before anything is sized from them: a
  // config.json is input, and `num_hidden_layers: 2147483648` must be an error, not an allocation.
  auto at_most = [](int64_t value, int64_t limit, const char* what) {
    if (value > limit)
      throw StatusError(std::string("config.json: ") + what + " " + std::to_string(value) +
                        " exceeds the limit of " + std::to_string(limit));
  };
  at_most(c.vocab_size, int64_t{1} << 22, "vocab_size");
  at_most(c.hidden_size, int64_t{1} << 17, "hidden_size");
  at_most(c.num_layers, 4096, "num_hidden_layers");
  at_most(c.num_heads, 4096, "num_attention_heads");
  at_most(c.num_kv_heads, 4096, "num_key_value_heads");
  at_most(c.head_dim, 8192, "head_dim");
  at_most(c.num_experts, 65536, "the number of experts");
  at_most(c.expert_intermediate_size, int64_t{1} << 20, "the expert intermediate size");
  at_most(c.shared_intermediate_size, int64_t{1} << 20, "the shared expert intermediate size");
  at_most(c.max_position_embeddings, int64_t{1} << 24, "max_position_embeddings");
  if (c.mla) {
    at_most(c.kv_lora_rank, 65536, "kv_lora_rank");
    at_most(c.q_lora_rank, 65536, "q_lora_rank");
    at_most(c.qk_rope_head_dim, 8192, "qk_rope_head_dim");
    at_most(c.qk_nope_head_dim, 8192, "qk_nope_head_dim");
    at_most(c.v_head_dim, 8192, "v_head_dim");
  }
  if (c.num_heads % c.num_kv_heads != 0)
    throw StatusError("config.json: num_attention_heads must be a multiple of num_key_value_heads");
  if (!c.mla && c.head_dim % 2 != 0)
    throw StatusError("config.json: head_dim must be even for RoPE");
  if (c.experts_per_token > c.num_experts)
    throw StatusError("config.json: num_experts_per_tok exceeds the number of experts");
  if (c.sliding_window < 0) throw StatusError("config.json: sliding_window must be positive");
  if (c.rotary_dim < 0 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0)
    throw StatusError("config.json: partial_rotary_factor gives " + std::to_string(c.rotary_dim) +
                      " rotated dimensions of head_dim " + std::to_string(c.head_dim) +
                      "; RoPE needs an even number, at most head_dim");
}

}  // namespace

namespace {

// What both sources share once the family's parser has read its config.json.
void finish(ModelConfig& out) {
  validate(out);
  if (out.softmax_scale <= 0)
    out.softmax_scale = 1.0 / std::sqrt(static_cast<double>(out.head_dim));
}

}  // namespace

ModelConfig ModelConfig::load(const std::filesystem::path& dir) {
  if (std::error_code ec; std::filesystem::is_regular_file(dir, ec))
    return from_gguf(GgufFile::open(dir));
  const auto config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path))
    throw StatusError(dir.string() + ": no config.json (is this a Hugging Face model folder?)");
  const json config = read_json(config_path);
  if (!config.is_object()) throw StatusError("config.json: not a JSON object");
  const auto type = config.find("model_type");
  if (type == config.end() || !type->is_string())
    throw StatusError("config.json: \"model_type\" is missing");
  const arch::Family* family = arch::find_family(type->get<std::string>());
  if (!family)
    throw StatusError("config.json: model_type \"" + type->get<std::string>() +
                      "\" is not supported (supported: " + arch::supported_model_types() + ")");
  ModelConfig out;
  out.model_type = type->get<std::string>();
  family->parse(config, out);
  finish(out);

  if (config.contains("eos_token_id")) out.eos_token_ids = token_ids(config["eos_token_id"]);
  const auto generation_path = dir / "generation_config.json";
  if (std::filesystem::exists(generation_path)) {
    const json generation = read_json(generation_path);
    if (generation.contains("eos_token_id"))
      out.eos_token_ids = token_ids(generation["eos_token_id"]);
  }
  return out;
}

ModelConfig ModelConfig::from_gguf(const GgufFile& gguf) {
  const std::string file = gguf.path().filename().string();
  const json& architecture = gguf.value("general.architecture");
  if (!architecture.is_string())
    throw StatusError(file + ": GGUF metadata 'general.architecture' is missing");
  const std::string name = architecture.get<std::string>();
  const arch::Family* family = arch::find_gguf_family(name);
  if (!family)
    throw StatusError(file + ": GGUF architecture \"" + name + "\" is not supported (supported: " +
                      arch::supported_gguf_architectures() + ")");
  const arch::GgufMetadata metadata(gguf.metadata(), name, file, &gguf);
  const json config = family->gguf_config(metadata);
  ModelConfig out;
  out.model_type = config.at("model_type").get<std::string>();
  try {
    arch::find_family(out.model_type)->parse(config, out);
    finish(out);
  } catch (const StatusError& e) {
    // The family's parser speaks of config.json keys: say which file they were read from.
    throw StatusError(file + " (GGUF metadata read as " + e.what() + ")");
  }
  if (family->gguf_adjust) family->gguf_adjust(metadata, out);
  // An untied model has its own output matrix; a GGUF of a tied one leaves it out.
  out.tie_word_embeddings = gguf.find("output.weight") == nullptr;
  // Generation stops at the end of the text and at the end of a turn (chat models).
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id"}) {
    const json& id = metadata.global(key);
    if (id.is_number_integer() && std::find(out.eos_token_ids.begin(), out.eos_token_ids.end(),
                                            id.get<int64_t>()) == out.eos_token_ids.end())
      out.eos_token_ids.push_back(id.get<int64_t>());
  }
  return out;
}

std::string ModelConfig::summary() const {
  std::ostringstream out;
  out << "model_type=" << model_type << " layers=" << num_layers << " hidden=" << hidden_size
      << " heads=" << num_heads;
  if (mla) {
    out << " q_lora_rank=" << q_lora_rank << " kv_lora_rank=" << kv_lora_rank
        << " qk_nope=" << qk_nope_head_dim << " qk_rope=" << qk_rope_head_dim
        << " v_head_dim=" << v_head_dim;
  } else {
    out << " kv_heads=" << num_kv_heads << " head_dim=" << head_dim;
  }
  out << " experts=" << num_experts << " top_k=" << experts_per_token
      << " expert_intermediate=" << expert_intermediate_size;
  if (shared_intermediate_size > 0) out << " shared_intermediate=" << shared_intermediate_size;
  out << " vocab=" << vocab_size;
  if (fp8_block_rows > 0) out << " fp8_blocks=" << fp8_block_rows << "x" << fp8_block_cols;
  return out.str();
}

KvShape kv_shape(const ModelConfig& config) {
  if (config.mla) return {1, config.kv_lora_rank + config.qk_rope_head_dim, 0};
  return {config.num_kv_heads, config.head_dim, config.head_dim};
}

kernels::Rope make_rope(const ModelConfig& config) {
  const int64_t dim = config.mla              ? config.qk_rope_head_dim
                      : config.rotary_dim > 0 ? config.rotary_dim
                                              : config.head_dim;
  if (config.rope_yarn_factor <= 0 && !config.rope_interleaved)
    return kernels::Rope(dim, config.rope_theta);
  // YaRN (DeepseekV3YarnRotaryEmbedding): dimensions that rotate more than beta_fast times over
  // the original context keep their frequency, those under beta_slow are divided by the factor,
  // and a linear ramp blends the ones between.
  const double base = config.rope_theta;
  std::vector<double> inv_freq(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i)
    inv_freq[static_cast<size_t>(i)] = 1.0 / std::pow(base, static_cast<double>(2 * i) / dim);
  if (config.rope_yarn_factor > 0) {
    const auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) *
             std::log(static_cast<double>(config.rope_original_max_positions) /
                      (rotations * 2 * M_PI)) /
             (2 * std::log(base));
    };
    const double low = std::max(std::floor(correction_dim(config.rope_beta_fast)), 0.0);
    double high =
        std::min(std::ceil(correction_dim(config.rope_beta_slow)), static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      double& f = inv_freq[static_cast<size_t>(i)];
      f = f / config.rope_yarn_factor * ramp + f * (1.0 - ramp);
    }
  }
  return kernels::Rope(std::move(inv_freq), config.rope_attention_factor, config.rope_interleaved);
}

namespace arch {

namespace {
// deepseek2 files are V2 or V3 by their metadata; the first family of an architecture reads them.
constexpr Family kFamilies[] = {
    {"mixtral", &parse_mixtral, &kMixtralNames, "llama", &gguf_config_mixtral, &gguf_adjust_mixtral,
     &kMixtralGgufNames},
    {"olmoe", &parse_olmoe, &kQwen3MoeNames, "olmoe", &gguf_config_olmoe, nullptr,
     &kQwen3MoeGgufNames},
    {"qwen2_moe", &parse_qwen2_moe, &kQwen2MoeNames, "qwen2moe", &gguf_config_qwen2_moe, nullptr,
     &kQwen2MoeGgufNames},
    {"qwen3_moe", &parse_qwen3_moe, &kQwen3MoeNames, "qwen3moe", &gguf_config_qwen3_moe, nullptr,
     &kQwen3MoeGgufNames},
    {"deepseek_v2", &parse_deepseek_v2, &kDeepseekNames, "deepseek2", &gguf_config_deepseek,
     nullptr, &kDeepseekGgufNames},
    {"deepseek_v3", &parse_deepseek_v3, &kDeepseekNames, "deepseek2", &gguf_config_deepseek,
     nullptr, &kDeepseekGgufNames},
    {"glm4_moe", &parse_glm4_moe, &kGlm4MoeNames, "glm4moe", &gguf_config_glm4_moe,
     &gguf_adjust_glm4_moe, &kGlm4MoeGgufNames},
};
}  // namespace

const Family* find_gguf_family(std::string_view architecture) {
  for (const Family& family : kFamilies)
    if (!family.gguf_architecture.empty() && family.gguf_architecture == architecture)
      return &family;
  return nullptr;
}

std::string supported_gguf_architectures() {
  std::string names;
  for (const Family& family : kFamilies) {
    const std::string name(family.gguf_architecture);
    if (name.empty() || names.find(name) != std::string::npos) continue;
    names += (names.empty() ? "" : ", ") + name;
  }
  return names;
}

const Family* find_family(std::string_view model_type) {
  for (const Family& family : kFamilies)
    if (family.model_type == model_type) return &family;
  return nullptr;
}

std::string supported_model_types() {
  std::string names;
  for (const Family& family : kFamilies)
    names += (names.empty() ? "" : ", ") + std::string(family.model_type);
  return names;
}

std::string tensor_name(std::string_view pattern, int64_t layer, int64_t expert) {
  std::string name(pattern);
  auto replace = [&name](std::string_view key, int64_t value) {
    for (size_t at = name.find(key); at != std::string::npos; at = name.find(key))
      name.replace(at, key.size(), std::to_string(value));
  };
  replace("{L}", layer);
  if (expert >= 0) replace("{E}", expert);
  return name;
}

}  // namespace arch
std::vector<int64_t> moe_layer_indices(const ModelConfig& config) {
  std::vector<int64_t> layers;
  for (int64_t l = 0; l < config.num_layers; ++l)
    if (config.layer_is_moe[static_cast<size_t>(l)]) layers.push_back(l);
  return layers;
}

int64_t layers_through_moe(const ModelConfig& config, int k) {
  const std::vector<int64_t> moe = moe_layer_indices(config);
  const size_t used = std::min(moe.size(), static_cast<size_t>(std::max(k, 0)));
  return used == 0 ? 0 : moe[used - 1] + 1;
}

}  // namespace moeline::model
