#pragma once
// Structured logs: one line per event on stderr, `key=value` pairs, values quoted when they hold
// spaces. Every line starts with ts=, stage=, replica=, event=. Thread-safe (one write per line).
//
//   Logger log("gateway", "gateway-1");
//   log.info("request_rejected", {{"reason", "prompt_too_long"}, {"tokens", 9000}});
//
// RateLimited lets a flood of identical events (malformed frames) log once per interval with the
// number suppressed, while the metric still counts every one.

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <variant>

namespace moeline::runtime {

using LogValue =
    std::variant<std::string, const char*, int64_t, uint64_t, int, unsigned, double, bool>;
using LogField = std::pair<const char*, LogValue>;

class Logger {
 public:
  Logger(std::string stage, std::string replica);
  void info(const char* event, std::initializer_list<LogField> fields = {}) const;
  void warn(const char* event, std::initializer_list<LogField> fields = {}) const;
  void error(const char* event, std::initializer_list<LogField> fields = {}) const;
  const std::string& stage() const { return stage_; }
  const std::string& replica() const { return replica_; }

 private:
  void write(const char* level, const char* event, std::initializer_list<LogField> fields) const;
  std::string stage_, replica_;
};

class RateLimited {
 public:
  explicit RateLimited(std::chrono::milliseconds interval = std::chrono::seconds(1))
      : interval_(interval) {}
  // True when this occurrence should be logged; `suppressed` is how many were skipped before it.
  bool allow(uint64_t& suppressed);

 private:
  std::mutex mutex_;
  std::chrono::milliseconds interval_;
  std::optional<std::chrono::steady_clock::time_point> last_;  // none: the first call passes
  uint64_t skipped_ = 0;
};

}  // namespace moeline::runtime
