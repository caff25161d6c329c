#pragma once
// Decode's settings: every key it reads (flags, the config file, MOELINE_<KEY>) with its default
// and help, and the typed settings parsed from them once, at start.

#include <cstdint>
#include <vector>

#include "stages/runtime/config.h"

namespace moeline::stages::decode {

struct DecodeSettings {
  uint32_t max_batch = 64;  // --max-batch: sequences in the running batch (the credit)
  int64_t kv_blocks = 0;    // --kv-blocks (0: sized from --kv-bytes)
  uint64_t kv_bytes = 0;    // --kv-bytes

  static DecodeSettings from(const runtime::Config& config);
};

std::vector<runtime::ConfigKey> decode_keys();

}  // namespace moeline::stages::decode
