#pragma once
// What a process that runs no forward pass needs of a model (the gateway): its config and its id,
// read from config.json and the tensors' headers (or a GGUF's metadata) without binding,
// converting or deriving any weight. Library moeline_model_info: the checkpoint formats' readers
// and the families' configs, nothing of the forward pass.

#include <cstdint>
#include <filesystem>
#include <string>

#include "base/status.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace moeline::model {

struct ModelInfo {
  ModelConfig config;
  uint64_t model_id = 0;
};

// `path`: a Hugging Face folder or a GGUF file.
Expected<ModelInfo> load_model_info(const std::filesystem::path& path);

// A model's id (peers compare it in the settings hash; reuse keys include it): a hash of the
// config (config.json's text, or a GGUF's metadata as JSON) and of every tensor's name, dtype,
// shape and first bytes, so two seeds of the same shape differ. Model::load uses the same.
uint64_t model_id_of(const std::string& config_text, const Checkpoint& checkpoint);
// The same for a Hugging Face folder: its config.json's text and its checkpoint.
uint64_t model_id_of(const std::filesystem::path& dir, const Checkpoint& checkpoint);

}  // namespace moeline::model
