#pragma once
// Structured logs: one line per event on stderr, `key=value` pairs (logfmt), values quoted when
// they hold spaces, or one JSON object per line (`--log-format json`). Every line starts with ts=,
// level=, stage=, replica=, event=. Lines below the process's level (`--log-level`) are not
// written. Thread-safe (one write per line).
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
#include <utility>
#include <variant>
#include <vector>

namespace moeline::runtime {

using LogValue =
    std::variant<std::string, const char*, int64_t, uint64_t, int, unsigned, double, bool>;
using LogField = std::pair<const char*, LogValue>;

enum class LogLevel { kInfo = 0, kWarn = 1, kError = 2 };
enum class LogFormat { kLogfmt, kJson };
// The process's level and format (every Logger; set once at start, from --log-level and
// --log-format). Throws std::invalid_argument for a name it does not know.
void set_log_options(LogLevel level, LogFormat format);
LogLevel parse_log_level(const std::string& name);
LogFormat parse_log_format(const std::string& name);

class Logger {
 public:
  Logger(std::string stage, std::string replica);
  void info(const char* event, std::initializer_list<LogField> fields = {}) const;
  void warn(const char* event, std::initializer_list<LogField> fields = {}) const;
  void error(const char* event, std::initializer_list<LogField> fields = {}) const;
  // An event whose fields are known only at run time (the effective configuration).
  void info(const char* event,
            const std::vector<std::pair<std::string, std::string>>& fields) const;
  const std::string& stage() const { return stage_; }
  const std::string& replica() const { return replica_; }

 private:
  void write(LogLevel level, const char* event,
             const std::vector<std::pair<std::string, LogValue>>& fields) const;
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
