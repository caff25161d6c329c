// A safetensors file as the loader meets it on disk: header length, JSON header, offsets, dtypes,
// shapes, overlaps, truncation. A bad file must be a StatusError, nothing else.
#include "fuzz.h"
#include "model/model.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto dir = moeline::fuzz::scratch() / "safetensors";
  std::filesystem::create_directories(dir);
  moeline::fuzz::write_file(dir / "model.safetensors", data, size);
  try {
    auto checkpoint = moeline::model::Checkpoint::open(dir);
    (void)checkpoint;
  } catch (const moeline::StatusError&) {
  }
  return 0;
}
