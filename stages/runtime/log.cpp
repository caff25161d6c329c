#include "stages/runtime/log.h"

#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <sstream>

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

}  // namespace

Logger::Logger(std::string stage, std::string replica)
    : stage_(std::move(stage)), replica_(std::move(replica)) {}

void Logger::info(const char* event, std::initializer_list<LogField> fields) const {
  write("info", event, fields);
}
void Logger::warn(const char* event, std::initializer_list<LogField> fields) const {
  write("warn", event, fields);
}
void Logger::error(const char* event, std::initializer_list<LogField> fields) const {
  write("error", event, fields);
}

void Logger::write(const char* level, const char* event,
                   std::initializer_list<LogField> fields) const {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  tm utc{};
  gmtime_r(&now.tv_sec, &utc);
  char stamp[40];
  const size_t n = std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &utc);
  std::snprintf(stamp + n, sizeof stamp - n, ".%03ldZ", now.tv_nsec / 1'000'000);
  std::string line = "ts=";
  line += stamp;
  line += " level=";
  line += level;
  line += " stage=";
  line += stage_;
  line += " replica=";
  append_value(line, replica_);
  line += " event=";
  line += event;
  for (const LogField& field : fields) {
    line += ' ';
    line += field.first;
    line += '=';
    append_value(line, to_text(field.second));
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
