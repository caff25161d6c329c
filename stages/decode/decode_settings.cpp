#include "stages/decode/decode_settings.h"

#include "stages/common/common.h"

namespace moeline::stages::decode {

DecodeSettings DecodeSettings::from(const runtime::Config& config) {
  DecodeSettings s;
  const int64_t max_batch = config.integer("max-batch");
  if (max_batch < 1 || max_batch > 65536)
    throw runtime::ConfigError("--max-batch must be in [1, 65536]");
  s.max_batch = static_cast<uint32_t>(max_batch);
  s.kv_blocks = config.integer("kv-blocks");
  if (s.kv_blocks < 0 || s.kv_blocks > (int64_t{1} << 30))
    throw runtime::ConfigError("--kv-blocks must be in [0, 2^30]");
  s.kv_bytes = runtime::parse_bytes(config.text("kv-bytes"));
  return s;
}

std::vector<runtime::ConfigKey> decode_keys() {
  std::vector<runtime::ConfigKey> keys = compute_keys();
  for (const runtime::ConfigKey& key : intake_keys()) keys.push_back(key);
  keys.push_back({"max-batch", "64", "sequences in the running batch (its credit)"});
  keys.push_back({"kv-blocks", "0",
                  "KV cache blocks (0: enough for max-batch full contexts, "
                  "within --kv-bytes)"});
  keys.push_back({"kv-bytes", "2GiB", "memory budget for the KV cache when --kv-blocks is 0"});
  return keys;
}

}  // namespace moeline::stages::decode
