#include "stages/runtime/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace moeline::runtime {
namespace {

void append_value(std::string& out, const std::string& text) {
  const bool quote = text.empty() || text.find_first_of(" \"=\n\t") != std::string::npos;
  if (!quote) {
    out += text;
    return;
  }
  out += '"';
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  out += '"';
}

std::string to_text(const LogValue& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return v;
        } else if constexpr (std::is_same_v<T, const char*>) {
          return v == nullptr ? "" : v;
        } else if constexpr (std::is_same_v<T, bool>) {
          return v ? "true" : "false";
        } else {
          std::ostringstream s;
          s << v;
          return s.str();
        }
      },
      value);
}

std::atomic<LogLevel> g_level{LogLevel::kInfo};
std::atomic<LogFormat> g_format{LogFormat::kLogfmt};

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
    default:
      return "info";
  }
}

nlohmann::json to_json(const LogValue& value) {
  return std::visit(
      [](const auto& v) -> nlohmann::json {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, const char*>)
          return v == nullptr ? "" : v;
        else
          return v;
      },
      value);
}

std::vector<std::pair<std::string, LogValue>> fields_of(std::initializer_list<LogField> fields) {
  std::vector<std::pair<std::string, LogValue>> out;
  out.reserve(fields.size());
  for (const LogField& field : fields) out.emplace_back(field.first, field.second);
  return out;
}

}  // namespace

void set_log_options(LogLevel level, LogFormat format) {
  g_level.store(level);
  g_format.store(format);
}

LogLevel parse_log_level(const std::string& name) {
  if (name == "info") return LogLevel::kInfo;
  if (name == "warn") return LogLevel::kWarn;
  if (name == "error") return LogLevel::kError;
  throw std::invalid_argument("log level must be info, warn or error, got '" + name + "'");
}

LogFormat parse_log_format(const std::string& name) {
  if (name == "logfmt") return LogFormat::kLogfmt;
  if (name == "json") return LogFormat::kJson;
  throw std::invalid_argument("log format must be logfmt or json, got '" + name + "'");
}

Logger::Logger(std::string stage, std::string replica)
    : stage_(std::move(stage)), replica_(std::move(replica)) {}

void Logger::info(const char* event, std::initializer_list<LogField> fields) const {
  write(LogLevel::kInfo, event, fields_of(fields));
}
void Logger::warn(const char* event, std::initializer_list<LogField> fields) const {
  write(LogLevel::kWarn, event, fields_of(fields));
}
void Logger::error(const char* event, std::initializer_list<LogField> fields) const {
  write(LogLevel::kError, event, fields_of(fields));
}
void Logger::info(const char* event,
                  const std::vector<std::pair<std::string, std::string>>& fields) const {
  std::vector<std::pair<std::string, LogValue>> values;
  values.reserve(fields.size());
  for (const auto& [key, value] : fields) values.emplace_back(key, value);
  write(LogLevel::kInfo, event, values);
}

void Logger::write(LogLevel level, const char* event,
                   const std::vector<std::pair<std::string, LogValue>>& fields) const {
  if (level < g_level.load(std::memory_order_relaxed)) return;
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  tm utc{};
  gmtime_r(&now.tv_sec, &utc);
  char stamp[40];
  const size_t n = std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &utc);
  std::snprintf(stamp + n, sizeof stamp - n, ".%03ldZ", now.tv_nsec / 1'000'000);
  std::string line;
  if (g_format.load(std::memory_order_relaxed) == LogFormat::kJson) {
    // Keys in the order written (the first five always first), one value per key.
    nlohmann::ordered_json object = {{"ts", stamp},
                                     {"level", level_name(level)},
                                     {"stage", stage_},
                                     {"replica", replica_},
                                     {"event", event}};
    for (const auto& [key, value] : fields) {
      // A field named as one of the line's own keys does not overwrite it.
      const bool taken =
          key == "ts" || key == "level" || key == "stage" || key == "replica" || key == "event";
      object[taken ? "field_" + key : key] = to_json(value);
    }
    line = object.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } else {
    line = "ts=";
    line += stamp;
    line += " level=";
    line += level_name(level);
    line += " stage=";
    line += stage_;
    line += " replica=";
    append_value(line, replica_);
    line += " event=";
    line += event;
    for (const auto& [key, value] : fields) {
      line += ' ';
      line += key;
      line += '=';
      append_value(line, to_text(value));
    }
  }
  line += '\n';
  // One write(2) per line keeps lines whole when several threads log.
  [[maybe_unused]] ssize_t written = ::write(STDERR_FILENO, line.data(), line.size());
}

bool RateLimited::allow(uint64_t& suppressed) {
  std::lock_guard lock(mutex_);
  const auto now = std::chrono::steady_clock::now();
  if (last_ && now - *last_ < interval_) {
    ++skipped_;
    return false;
  }
  last_ = now;
  suppressed = skipped_;
  skipped_ = 0;
  return true;
}

}  // namespace moeline::runtime
