// The snapshot store's records as the probe reads them back from RocksDB or from a SnapshotPut:
// prompt (logits and tail KV), result, signature and quality records.
#include "fuzz.h"
#include "reuse/records.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      (void)moeline::reuse::decode_prompt(bytes, 64, 256);
      break;
    case 1:
      (void)moeline::reuse::decode_result(bytes);
      break;
    case 2:
      (void)moeline::reuse::decode_signature(bytes);
      break;
    default:
      (void)moeline::reuse::decode_quality(bytes);
      break;
  }
  return 0;
}
