#include "model/model_info.h"

#include <xxhash.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "model/gguf.h"

namespace moeline::model {
namespace {

std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

}  // namespace

uint64_t model_id_of(const std::string& config_text, const Checkpoint& checkpoint) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, config_text.data(), config_text.size());
  for (const auto& [name, tensor] : checkpoint.tensors()) {
    XXH3_64bits_update(state, name.data(), name.size());
    XXH3_64bits_update(state, tensor.dtype_name.data(), tensor.dtype_name.size());
    XXH3_64bits_update(state, tensor.shape.data(), tensor.shape.size() * sizeof(int64_t));
    XXH3_64bits_update(state, tensor.data, std::min<size_t>(tensor.bytes, 256));
  }
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return digest;
}

uint64_t model_id_of(const std::filesystem::path& dir, const Checkpoint& checkpoint) {
  return model_id_of(read_text(dir / "config.json"), checkpoint);
}

Expected<ModelInfo> load_model_info(const std::filesystem::path& path) {
  try {
    ModelInfo info;
    if (std::filesystem::is_regular_file(path)) {
      const GgufFile gguf = GgufFile::open(path);
      info.config = ModelConfig::from_gguf(gguf);
      info.model_id = model_id_of(gguf.metadata().dump(), Checkpoint::from_gguf(gguf));
      return info;
    }
    info.config = ModelConfig::load(path);
    info.model_id = model_id_of(path, Checkpoint::open(path));
    return info;
  } catch (const StatusError& e) {
    return e.error();
  } catch (const std::exception& e) {
    return Error{path.string() + ": " + e.what()};
  }
}

}  // namespace moeline::model
