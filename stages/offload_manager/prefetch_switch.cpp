#include "stages/offload_manager/prefetch_switch.h"

#include "stages/offload_manager/offload_metrics.h"

namespace moeline::stages {

PrefetchSwitch::PrefetchSwitch(const PrefetchSwitchSettings& settings, bool prefetching,
                               runtime::Logger& log, runtime::Registry& metrics)
    : settings_(settings), prefetching_(prefetching), log_(log) {
  for (size_t k = 0; k < kinds_.size(); ++k) {
    const runtime::Labels kind = {
        {"kind", offload::prefetch_kind_name(static_cast<offload::PrefetchKind>(k))}};
    kinds_[k].enabled = &metrics.gauge(offload_metric::kPrefetchEnabled, kind);
    kinds_[k].enabled->set(prefetching ? 1 : 0);
    kinds_[k].switched_off = &metrics.counter(offload_metric::kPrefetchSwitchedOffTotal, kind);
  }
}

void PrefetchSwitch::update(const offload::PoolStats& stats, offload::ExpertPool& pool,
                            Clock::time_point now) {
  if (!settings_.automatic || !prefetching_) return;
  for (size_t k = 0; k < kinds_.size(); ++k) {
    Kind& kind = kinds_[k];
    const auto which = static_cast<offload::PrefetchKind>(k);
    const offload::PoolCounters::PrefetchCounts& total = stats.prefetch_by_kind[k];
    if (kind.off) {
      if (std::chrono::duration<double>(now - kind.off_since).count() < settings_.retry_s) continue;
      kind.off = false;
      kind.window_start = total;
      pool.set_prefetch_enabled(which, true);
      kind.enabled->set(1);
      log_.info("prefetch_retried", {{"kind", offload::prefetch_kind_name(which)}});
      continue;
    }
    const uint64_t requests = total.requests - kind.window_start.requests;
    if (requests < settings_.min_requests) continue;
    const double late =
        static_cast<double>(total.late - kind.window_start.late) / static_cast<double>(requests);
    const double wasted = static_cast<double>(total.wasted - kind.window_start.wasted) /
                          static_cast<double>(requests);
    const double used =
        static_cast<double>(total.used - kind.window_start.used) / static_cast<double>(requests);
    kind.window_start = total;  // the next window starts here either way
    if (late <= settings_.bad_share && wasted <= settings_.bad_share) continue;
    kind.off = true;
    kind.off_since = now;
    pool.set_prefetch_enabled(which, false);
    kind.enabled->set(0);
    kind.switched_off->inc();
    log_.warn("prefetch_switched_off", {{"kind", offload::prefetch_kind_name(which)},
                                        {"requests", requests},
                                        {"late_share", late},
                                        {"wasted_share", wasted},
                                        {"used_share", used},
                                        {"threshold", settings_.bad_share},
                                        {"retry_s", settings_.retry_s}});
  }
}

}  // namespace moeline::stages
