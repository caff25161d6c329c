#pragma once
// Prefill's settings: every key it reads (flags, the config file, MOELINE_<KEY>) with its default
// and help, and the typed settings parsed from them once, at start.

#include <cstdint>
#include <vector>

#include "reuse/signature.h"
#include "stages/runtime/config.h"

namespace moeline::stages::prefill {

struct PrefillSettings {
  uint32_t queue_capacity = 8;      // --queue: jobs accepted ahead of the batches (the credit)
  int64_t max_batch_tokens = 2048;  // --max-batch-tokens
  int64_t blend_select_layer = 1;   // --blend-select-layer (checked against the model at start)
  reuse::SignatureOptions signatures;

  static PrefillSettings from(const runtime::Config& config);
};

std::vector<runtime::ConfigKey> prefill_keys();

}  // namespace moeline::stages::prefill
