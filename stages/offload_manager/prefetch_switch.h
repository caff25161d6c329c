#pragma once
// Prefetch that pays on this hardware or turns itself off. Per kind of forward pass (decode steps,
// prefill batches), over a window of at least `min_requests` prefetches: when the share that came
// too late (demand found the expert still loading) or was wasted (evicted unused) passes
// `bad_share`, prefetch is switched off for that kind on every client of the pool, logged and
// counted; after `retry_s` it is tried again with a fresh window, since the load may have changed.

#include <array>
#include <chrono>

#include "offload/expert_pool.h"
#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"

namespace moeline::stages {

struct PrefetchSwitchSettings {
  bool automatic = true;  // false: prefetch stays as configured
  double bad_share = 0.5;
  uint64_t min_requests = 200;
  double retry_s = 300;
};

class PrefetchSwitch {
 public:
  using Clock = std::chrono::steady_clock;
  // `prefetching`: whether prefetch runs at all (--prefetch-depth > 0).
  PrefetchSwitch(const PrefetchSwitchSettings& settings, bool prefetching, runtime::Logger& log,
                 runtime::Registry& metrics);
  // With each snapshot of the pool's counters.
  void update(const offload::PoolStats& stats, offload::ExpertPool& pool, Clock::time_point now);

 private:
  struct Kind {
    offload::PoolCounters::PrefetchCounts window_start;
    bool off = false;
    Clock::time_point off_since;
    runtime::Gauge* enabled = nullptr;
    runtime::Counter* switched_off = nullptr;
  };
  PrefetchSwitchSettings settings_;
  bool prefetching_;
  runtime::Logger& log_;
  std::array<Kind, 2> kinds_;
};

}  // namespace moeline::stages
