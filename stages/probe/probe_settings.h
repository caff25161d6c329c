#pragma once
// The probe's settings: every key it reads (flags, the config file, MOELINE_<KEY>) with its default
// and help, and the typed settings of its own parts parsed from them once, at start (the
// approximate lookup reads its `approximate-*`, `signature-*` and `index-*` keys itself).

#include <cstdint>
#include <string>
#include <vector>

#include "reuse/snapshot_store.h"
#include "stages/runtime/config.h"

namespace moeline::stages::probe {

struct ProbeSettings {
  uint32_t queue_capacity = 64;  // --queue: lookups accepted at once (the credit)
  reuse::StoreOptions store;     // --store-*; the disk path with {replica} replaced
  std::string store_policy = "slru";

  // Throws runtime::ConfigError for a value it cannot take.
  static ProbeSettings from(const runtime::Config& config, const std::string& replica);
};

std::vector<runtime::ConfigKey> probe_keys();

}  // namespace moeline::stages::probe
