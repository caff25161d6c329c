#include "stages/offload_manager/offload_settings.h"

#include "stages/common/common.h"

namespace moeline::stages {

OffloadSettings OffloadSettings::from(const runtime::Config& config) {
  OffloadSettings s;
  s.expert_budget = config.text("expert-budget");
  s.expert_pool = config.text("expert-pool");
  const int64_t depth = config.integer("prefetch-depth");
  if (depth < 0 || depth > 64) throw runtime::ConfigError("--prefetch-depth must be in [0, 64]");
  s.prefetch_depth = static_cast<uint32_t>(depth);
  const int64_t threads = config.integer("loader-threads");
  if (threads < 1 || threads > 256)
    throw runtime::ConfigError("--loader-threads must be in [1, 256]");
  s.loader_threads = static_cast<int>(threads);
  s.direct_io = config.flag("direct-io");
  s.prefetch_switch.automatic = config.flag("prefetch-auto");
  s.prefetch_switch.bad_share = config.number("prefetch-bad-share");
  if (!(s.prefetch_switch.bad_share > 0 && s.prefetch_switch.bad_share <= 1))
    throw runtime::ConfigError("--prefetch-bad-share must be in (0, 1]");
  const int64_t window = config.integer("prefetch-window");
  if (window < 1) throw runtime::ConfigError("--prefetch-window must be >= 1");
  s.prefetch_switch.min_requests = static_cast<uint64_t>(window);
  s.prefetch_switch.retry_s = config.number("prefetch-retry-s");
  if (!(s.prefetch_switch.retry_s > 0))
    throw runtime::ConfigError("--prefetch-retry-s must be > 0");
  s.router_health = {.imbalance_warning = config.number("imbalance-warning"),
                     .imbalance_critical = config.number("imbalance-critical"),
                     .confidence_warning = config.number("confidence-warning"),
                     .hysteresis = config.number("router-hysteresis")};
  if (!(s.router_health.hysteresis >= 0 && s.router_health.hysteresis < 1))
    throw runtime::ConfigError("--router-hysteresis must be in [0, 1)");
  return s;
}

std::vector<runtime::ConfigKey> offload_keys() {
  std::vector<runtime::ConfigKey> keys = worker_keys();
  keys.push_back({"expert-budget", "",
                  "host pool size shared by every compute process of the node: a share of all "
                  "expert bytes (\"25%\") or a size (\"512MiB\"); empty: every expert stays "
                  "resident in each process's mapping of the checkpoint"});
  keys.push_back({"expert-pool", "",
                  "shared memory name of the pool (default: /moeline-pool-<model id>-<hub hash>)"});
  keys.push_back({"prefetch-depth", "1",
                  "MoE layers ahead the compute processes predict and prefetch (0: off)"});
  keys.push_back({"prefetch-auto", "true",
                  "switch prefetch off for a kind of forward pass (decode, prefill) when too much "
                  "of it comes late or goes unused, and try it again after --prefetch-retry-s"});
  keys.push_back({"prefetch-bad-share", "0.5",
                  "late or wasted share of a window of prefetches at which it is switched off"});
  keys.push_back({"prefetch-window", "200", "prefetches per judgement"});
  keys.push_back({"prefetch-retry-s", "300", "seconds before a switched-off prefetch is retried"});
  keys.push_back({"loader-threads", "1", "threads reading experts from disk into the pool"});
  keys.push_back({"imbalance-warning", "0.4",
                  "router health: warn when a layer's load imbalance (std/mean) reaches this"});
  keys.push_back({"imbalance-critical", "0.5", "router health: critical at this imbalance"});
  keys.push_back({"confidence-warning", "1.5",
                  "router health: warn when a layer's mean ln(top-1/top-2) falls below this"});
  keys.push_back({"router-hysteresis", "0.1",
                  "router health: a state is left only once its measure clears the threshold by "
                  "this share of it (a layer hovering at one does not flip every report)"});
  for (const runtime::ConfigKey& key : intake_keys()) keys.push_back(key);
  keys.push_back({"direct-io", "true",
                  "read experts with O_DIRECT, so the page cache does not become a second pool"});
  return keys;
}

}  // namespace moeline::stages
