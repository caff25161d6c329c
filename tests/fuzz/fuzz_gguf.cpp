// A GGUF file as the loader meets it on disk: header, typed metadata (nested arrays), the tensor
// table (dimensions, types, offsets), alignment, truncation. A bad file must be a StatusError,
// nothing else; every tensor of a file that opens must dequantize within its bounds.
#include "fuzz.h"
#include "model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = moeline::fuzz::scratch() / "fuzz.gguf";
  moeline::fuzz::write_file(path, data, size);
  try {
    const auto file = moeline::model::GgufFile::open(path);
    for (const auto& [name, tensor] : file.tensors())
      if (tensor.elements() <= (int64_t{1} << 20)) (void)file.dequantize(tensor);
  } catch (const moeline::StatusError&) {
  }
  return 0;
}
