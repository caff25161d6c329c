#pragma once
// The offload manager's settings: every key it reads (flags, the config file, MOELINE_<KEY>) with
// its default and help, and the typed settings parsed from them once, at start.

#include <cstdint>
#include <string>
#include <vector>

#include "offload/router_health.h"
#include "stages/offload_manager/prefetch_switch.h"
#include "stages/runtime/config.h"

namespace moeline::stages {

struct OffloadSettings {
  std::string expert_budget;  // --expert-budget: empty, a share ("25%") or a size ("512MiB")
  std::string expert_pool;    // --expert-pool: empty for the default name
  uint32_t prefetch_depth = 1;
  int loader_threads = 1;
  bool direct_io = true;
  offload::RouterHealthOptions router_health;
  PrefetchSwitchSettings prefetch_switch;

  static OffloadSettings from(const runtime::Config& config);
};

std::vector<runtime::ConfigKey> offload_keys();

}  // namespace moeline::stages
