// GGUF metadata, read as the config.json it stands for: each family turns llama.cpp's keys
// ("{arch}.block_count", ...) into the Hugging Face keys its config parser reads, so a GGUF model
// goes through the same defaults and checks as the checkpoint it was converted from.
#include <string>

#include "base/status.h"
#include "model/arch/arch.h"
#include "model/gguf.h"

namespace moeline::model::arch {

using nlohmann::json;

const json& GgufMetadata::global(const std::string& key) const {
  static const json kNull;
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? kNull : *it;
}

bool GgufMetadata::has_tensor(const std::string& name) const {
  return gguf_ && gguf_->find(name) != nullptr;
}

const json& GgufMetadata::at(const std::string& key) const {
  return global(architecture_ + "." + key);
}

void GgufMetadata::fail(const std::string& key, const std::string& why) const {
  const std::string full = key.find('.') == 0 ? key.substr(1) : architecture_ + "." + key;
  throw StatusError(file_ + ": GGUF metadata '" + full + "' " + why);
}

bool GgufMetadata::has(const std::string& key) const {
  return !at(key).is_null();
}

int64_t GgufMetadata::require_int(const std::string& key) const {
  const json& value = at(key);
  if (value.is_null()) fail(key, "is missing");
  if (!value.is_number_integer()) fail(key, "must be an integer");
  if (value.is_number_unsigned() && value.get<uint64_t>() > (uint64_t{1} << 62))
    fail(key, "is out of range");
  return value.get<int64_t>();
}

int64_t GgufMetadata::int_or(const std::string& key, int64_t fallback) const {
  return has(key) ? require_int(key) : fallback;
}

double GgufMetadata::number_or(const std::string& key, double fallback) const {
  const json& value = at(key);
  if (value.is_null()) return fallback;
  if (!value.is_number()) fail(key, "must be a number");
  return value.get<double>();
}

bool GgufMetadata::bool_or(const std::string& key, bool fallback) const {
  const json& value = at(key);
  if (value.is_null()) return fallback;
  if (!value.is_boolean()) fail(key, "must be true or false");
  return value.get<bool>();
}

std::string GgufMetadata::string_or(const std::string& key, const std::string& fallback) const {
  const json& value = at(key);
  if (value.is_null()) return fallback;
  if (!value.is_string()) fail(key, "must be a string");
  return value.get<std::string>();
}

json gguf_common_config(const GgufMetadata& m, std::string_view model_type) {
  json config = json::object();
  config["model_type"] = std::string(model_type);
  config["hidden_size"] = m.require_int("embedding_length");
  config["num_hidden_layers"] = m.require_int("block_count");
  const int64_t heads = m.require_int("attention.head_count");
  config["num_attention_heads"] = heads;
  config["num_key_value_heads"] = m.int_or("attention.head_count_kv", heads);
  config["max_position_embeddings"] = m.int_or("context_length", 4096);
  config["rms_norm_eps"] = m.number_or("attention.layer_norm_rms_epsilon", 1e-5);
  if (m.has("rope.freq_base")) config["rope_theta"] = m.number_or("rope.freq_base", 10000.0);
  // The vocabulary's size: the architecture's key when written, else the embedded token list.
  const json& tokens = m.global("tokenizer.ggml.tokens");
  if (m.has("vocab_size")) {
    config["vocab_size"] = m.require_int("vocab_size");
  } else if (tokens.is_array()) {
    config["vocab_size"] = static_cast<int64_t>(tokens.size());
  } else {
    m.fail("vocab_size", "is missing and there is no tokenizer.ggml.tokens to count");
  }
  const std::string scaling = m.string_or("rope.scaling.type", "none");
  if (scaling != "none") {
    // Handed to the family's parser, which accepts what it implements and names the rest.
    config["rope_scaling"] = {{"type", scaling},
                              {"factor", m.number_or("rope.scaling.factor", 1.0)},
                              {"original_max_position_embeddings",
                               m.int_or("rope.scaling.original_context_length", 4096)}};
  }
  for (const char* key : {"bos_token_id", "eos_token_id"}) {
    const json& id = m.global(std::string("tokenizer.ggml.") + key);
    if (id.is_number_integer()) config[key] = id;
  }
  return config;
}

}  // namespace moeline::model::arch
