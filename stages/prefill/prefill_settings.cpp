#include "stages/prefill/prefill_settings.h"

#include <string>

#include "stages/common/common.h"

namespace moeline::stages::prefill {

PrefillSettings PrefillSettings::from(const runtime::Config& config) {
  PrefillSettings s;
  const int64_t queue = config.integer("queue");
  if (queue < 1 || queue > 65536) throw runtime::ConfigError("--queue must be in [1, 65536]");
  s.queue_capacity = static_cast<uint32_t>(queue);
  s.max_batch_tokens = config.integer("max-batch-tokens");
  if (s.max_batch_tokens < 1) throw runtime::ConfigError("--max-batch-tokens must be at least 1");
  s.blend_select_layer = config.integer("blend-select-layer");
  s.signatures = signature_options(config);
  return s;
}

std::vector<runtime::ConfigKey> prefill_keys() {
  std::vector<runtime::ConfigKey> keys = compute_keys();
  for (const runtime::ConfigKey& key : intake_keys()) keys.push_back(key);
  keys.push_back({"queue", "8", "jobs this replica accepts ahead of its batches (its credit)"});
  keys.push_back({"max-batch-tokens", "2048", "prompt tokens per prefill batch"});
  for (const runtime::ConfigKey& key : signature_keys()) keys.push_back(key);
  keys.push_back({"blend-select-layer", "1",
                  "blended reuse runs every token through this layer, then only the recomputed"});
  return keys;
}

}  // namespace moeline::stages::prefill
