// config.json (and generation_config.json's part in it): any JSON, any types, any sizes. A bad
// file must be a StatusError, never an allocation sized from it.
#include "fuzz.h"
#include "model/config.h"
#include "model/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto dir = moeline::fuzz::scratch() / "config";
  std::filesystem::create_directories(dir);
  moeline::fuzz::write_file(dir / "config.json", data, size);
  try {
    const moeline::model::ModelConfig config = moeline::model::ModelConfig::load(dir);
    (void)moeline::model::kv_shape(config);
    (void)moeline::model::moe_layer_indices(config);
  } catch (const moeline::StatusError&) {
  }
  return 0;
}
