#pragma once
// Prometheus metrics: counters, gauges and histograms in families (one name, help and type, many
// label sets), rendered in the text exposition format for /metrics. Recording is lock-free
// (atomics); registering takes a lock and returns a reference that stays valid for the registry's
// lifetime, so hot paths look a series up once and keep it.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace moeline::runtime {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void inc(double by = 1.0) { value_.fetch_add(by, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double value) { value_.store(value, std::memory_order_relaxed); }
  void add(double by) { value_.fetch_add(by, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative counts per bound, then +Inf.
  std::vector<uint64_t> cumulative() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

// Latency buckets in seconds, 100 µs to 60 s.
std::vector<double> latency_buckets();
// Small-count buckets (batch sizes, queue depths): 1, 2, 4, ... 1024.
std::vector<double> size_buckets();

// A metric's name and help: each stage lists its metrics in one table of these
// (stages/<stage>/<stage>_metrics.h), which is what /metrics shows and dashboards read.
struct MetricName {
  const char* name;
  const char* help;
};

// Families every stage's runtime exports (labelled by values known only when they happen).
inline constexpr MetricName kHandlerErrors{
    "moeline_handler_errors_total",
    "Exceptions a message handler threw, caught before the stage loop"};
inline constexpr MetricName kWireRejectedFrames{"moeline_wire_rejected_frames_total",
                                                "Received messages refused by the wire codec"};

class Registry {
 public:
  Counter& counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help,
                       const std::vector<double>& bounds, const Labels& labels = {});
  Counter& counter(const MetricName& metric, const Labels& labels = {}) {
    return counter(metric.name, metric.help, labels);
  }
  Gauge& gauge(const MetricName& metric, const Labels& labels = {}) {
    return gauge(metric.name, metric.help, labels);
  }
  Histogram& histogram(const MetricName& metric, const std::vector<double>& bounds,
                       const Labels& labels = {}) {
    return histogram(metric.name, metric.help, bounds, labels);
  }
  // A family whose children appear on their first event (labelled by values not known in
  // advance): exported from the start with its HELP and TYPE, so dashboards and alert rules find
  // it before anything has happened.
  void declare_counter(const MetricName& metric) { family(metric.name, "counter", metric.help); }
  // Labels every sample of every registry of this process carries (the stage's model), set once
  // at start before anything renders; the Prometheus convention that lets one query span models.
  static void set_process_labels(const Labels& labels);
  std::string render() const;

 private:
  struct Family {
    std::string type, help;
    std::map<std::string, std::unique_ptr<Counter>> counters;
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& family(const std::string& name, const std::string& type, const std::string& help);
  mutable std::mutex mutex_;
  std::map<std::string, Family> families_;
};

std::string render_labels(const Labels& labels);

}  // namespace moeline::runtime
