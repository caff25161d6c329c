#pragma once
// The picture `moeline load --plot FILE.png` draws: time to first token and per-token latency over
// the run, as their p50, p90 and p99 in each time window, so a latency that creeps up, a stall or
// a restart shows where it happened rather than vanishing into one percentile of the whole run.

#include <span>
#include <string>
#include <vector>

namespace moeline::stages {

struct TimedSample {
  double at_s;  // when it was taken, in seconds from the start of the run
  double ms;    // the latency
};

// The q-quantile (0..1) of sorted values, interpolated between the two nearest ranks (numpy's
// default); values must not be empty.
double quantile(const std::vector<double>& sorted, double q);

struct LatencyPlot {
  std::string title, subtitle;
  double duration_s = 0;
  std::span<const TimedSample> ttft, per_token;  // the run's samples, not copied
};

// Writes the PNG; false when the file cannot be written.
bool write_latency_plot(const std::string& path, const LatencyPlot& plot);

}  // namespace moeline::stages
