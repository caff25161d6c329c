#pragma once
// The process metrics every Prometheus client library exports (process_cpu_seconds_total,
// process_resident_memory_bytes, ...), read from /proc/self when /metrics is scraped.

#include <mutex>

#include "stages/runtime/metrics.h"

namespace moeline::runtime {

class ProcessMetrics {
 public:
  explicit ProcessMetrics(Registry& registry);
  // Reads /proc/self (stat, fd) and the fd limit into the gauges; called before each render.
  void update();

 private:
  Counter& cpu_seconds_;
  Gauge &resident_bytes_, &virtual_bytes_, &open_fds_, &max_fds_, &threads_, &start_time_;
  std::mutex mutex_;  // scrapes may overlap: the CPU counter's last reading is shared
  double last_cpu_seconds_ = 0;
  bool start_time_known_ = false;
};

}  // namespace moeline::runtime
