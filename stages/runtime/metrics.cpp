#include "stages/runtime/metrics.h"

#include <charconv>
#include <cmath>
#include <sstream>
#include <stdexcept>

namespace moeline::runtime {
namespace {

std::string escape_label(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// HELP text: backslash and newline escaped, as the exposition format requires.
std::string escape_help(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// The shortest text that reads back as the same double ("0.1", not "0.10000000000000001").
std::string format_number(double value) {
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (std::isnan(value)) return "NaN";
  // Counts print as integers ("200000", not "2e+05").
  if (value == std::floor(value) && std::fabs(value) < 9007199254740992.0)
    return std::to_string(static_cast<int64_t>(value));
  char text[32];
  auto [end, ec] = std::to_chars(text, text + sizeof text, value);
  return ec == std::errc() ? std::string(text, end) : std::to_string(value);
}

// Inserts `extra` into an already rendered label set ("{a="1"}" + le -> "{a="1",le="..."}").
std::string with_label(const std::string& rendered, const std::string& extra) {
  if (rendered.empty()) return "{" + extra + "}";
  return rendered.substr(0, rendered.size() - 1) + "," + extra + "}";
}

}  // namespace

std::string render_labels(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) out += ',';
    out += labels[i].first + "=\"" + escape_label(labels[i].second) + "\"";
  }
  return out + "}";
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::cumulative() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    out[i] = total;
  }
  return out;
}

std::vector<double> latency_buckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

std::vector<double> size_buckets() {
  return {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
}

Registry::Family& Registry::family(const std::string& name, const std::string& type,
                                   const std::string& help) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.type = type;
    it->second.help = help;
  } else if (it->second.type != type) {
    throw std::logic_error("metric " + name + " registered as " + it->second.type + " and " + type);
  }
  return it->second;
}

Counter& Registry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& slot = family(name, "counter", help).counters[render_labels(labels)];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& slot = family(name, "gauge", help).gauges[render_labels(labels)];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& Registry::histogram(const std::string& name, const std::string& help,
                               const std::vector<double>& bounds, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& slot = family(name, "histogram", help).histograms[render_labels(labels)];
  if (!slot) slot = std::make_unique<Histogram>(bounds);
  return *slot;
}

namespace {
std::string& process_labels() {
  static std::string rendered;  // "key="value",..." without braces; empty: none
  return rendered;
}

std::string with_process_labels(const std::string& rendered) {
  const std::string& extra = process_labels();
  return extra.empty() ? rendered : with_label(rendered, extra);
}
}  // namespace

void Registry::set_process_labels(const Labels& labels) {
  const std::string rendered = render_labels(labels);
  process_labels() = rendered.empty() ? "" : rendered.substr(1, rendered.size() - 2);
}

std::string Registry::render() const {
  std::lock_guard lock(mutex_);
  std::string out;
  for (const auto& [name, family] : families_) {
    out += "# HELP " + name + " " + escape_help(family.help) + "\n";
    out += "# TYPE " + name + " " + family.type + "\n";
    for (const auto& [stored, counter] : family.counters)
      out += name + with_process_labels(stored) + " " + format_number(counter->value()) + "\n";
    for (const auto& [stored, gauge] : family.gauges)
      out += name + with_process_labels(stored) + " " + format_number(gauge->value()) + "\n";
    for (const auto& [stored, histogram] : family.histograms) {
      const std::string labels = with_process_labels(stored);
      const std::vector<uint64_t> cumulative = histogram->cumulative();
      const auto& bounds = histogram->bounds();
      for (size_t i = 0; i <= bounds.size(); ++i) {
        const std::string le =
            "le=\"" + (i < bounds.size() ? format_number(bounds[i]) : std::string("+Inf")) + "\"";
        out +=
            name + "_bucket" + with_label(labels, le) + " " + std::to_string(cumulative[i]) + "\n";
      }
      out += name + "_sum" + labels + " " + format_number(histogram->sum()) + "\n";
      out += name + "_count" + labels + " " + std::to_string(cumulative.back()) + "\n";
    }
  }
  return out;
}

}  // namespace moeline::runtime
