#include "stages/load/latency_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cli/picture.h"

namespace moeline::stages {
namespace {

using cli::Picture;
using cli::Rgb;

constexpr Rgb kBackground{255, 255, 255}, kInk{30, 30, 30}, kDim{110, 110, 110},
    kGrid{225, 225, 225};
struct Series {
  const char* name;
  double q;
  Rgb colour;
};
constexpr Series kSeries[] = {
    {"p50", 0.50, {31, 119, 180}}, {"p90", 0.90, {255, 127, 14}}, {"p99", 0.99, {214, 39, 40}}};

// One window's percentiles; empty windows are gaps in the lines.
struct Window {
  bool empty = true;
  double value[3] = {0, 0, 0};
};

std::vector<Window> windows_of(std::span<const TimedSample> samples, int count, double width_s) {
  std::vector<std::vector<double>> values(static_cast<size_t>(count));
  for (const TimedSample& s : samples) {
    const int index = std::clamp(static_cast<int>(s.at_s / width_s), 0, count - 1);
    values[static_cast<size_t>(index)].push_back(s.ms);
  }
  std::vector<Window> windows(static_cast<size_t>(count));
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i].empty()) continue;
    std::sort(values[i].begin(), values[i].end());
    windows[i].empty = false;
    for (int k = 0; k < 3; ++k) windows[i].value[k] = quantile(values[i], kSeries[k].q);
  }
  return windows;
}

// The smallest 1, 2 or 5 times a power of ten at or above `value`.
double nice_ceiling(double value) {
  if (!(value > 0)) return 1;
  const double power = std::pow(10.0, std::floor(std::log10(value)));
  for (double step : {1.0, 2.0, 5.0, 10.0})
    if (step * power >= value * (1 - 1e-9)) return step * power;
  return 10 * power;
}

std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof text, value >= 100 || value == std::floor(value) ? "%.0f" : "%.3g",
                value);
  return text;
}

void draw_panel(Picture& picture, int left, int top, int width, int height, const char* label,
                const std::vector<Window>& windows, double window_s, double duration_s) {
  double highest = 0;
  for (const Window& w : windows)
    if (!w.empty) highest = std::max(highest, w.value[2]);
  const double y_max = nice_ceiling(highest);
  picture.text(left, top - 14, label, kInk);
  constexpr int kTicks = 5;
  for (int t = 0; t <= kTicks; ++t) {
    const int y = top + height - height * t / kTicks;
    picture.fill(left, y, width, 1, kGrid);
    const std::string text = number_text(y_max * t / kTicks);
    picture.text(left - 6 - Picture::text_width(text), y - 3, text, kDim);
  }
  // Seconds at round steps (at most about ten of them), not at fractions of the run.
  const double x_step = nice_ceiling(duration_s / 10);
  for (double at = 0; at <= duration_s * (1 + 1e-9); at += x_step) {
    const int x = left + static_cast<int>(std::lround(at / duration_s * width));
    picture.fill(x, top + height, 1, 4, kDim);
    const std::string text = number_text(at);
    picture.text(x - Picture::text_width(text) / 2, top + height + 7, text, kDim);
  }
  picture.fill(left, top, 1, height + 1, kDim);
  picture.fill(left, top + height, width, 1, kDim);
  auto x_of = [&](size_t i) {
    const double centre = (static_cast<double>(i) + 0.5) * window_s;
    return left + static_cast<int>(std::lround(centre / duration_s * width));
  };
  auto y_of = [&](double value) {
    return top + height - static_cast<int>(std::lround(std::min(value, y_max) / y_max * height));
  };
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < windows.size(); ++i) {
      if (windows[i].empty) continue;
      const int x = x_of(i), y = y_of(windows[i].value[k]);
      picture.fill(x - 2, y - 2, 5, 5, kSeries[k].colour);
      if (i + 1 < windows.size() && !windows[i + 1].empty)
        picture.line(x, y, x_of(i + 1), y_of(windows[i + 1].value[k]), kSeries[k].colour, 2);
    }
  }
  if (highest == 0) picture.text(left + 12, top + height / 2, "no samples", kDim);
  int legend_x = left + width - 3 * 48;
  for (const Series& series : kSeries) {
    picture.fill(legend_x, top - 12, 12, 5, series.colour);
    picture.text(legend_x + 16, top - 14, series.name, kInk);
    legend_x += 48;
  }
}

}  // namespace

double quantile(const std::vector<double>& sorted, double q) {
  const double index = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(index));
  const auto hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (index - static_cast<double>(lo));
}

bool write_latency_plot(const std::string& path, const LatencyPlot& plot) {
  const double duration_s = plot.duration_s > 0 ? plot.duration_s : 1;
  // About one window a second, between 10 and 60 windows, so each holds enough samples to have
  // a p99 and the run still shows its shape.
  const int count = std::clamp(static_cast<int>(std::lround(duration_s)), 10, 60);
  const double window_s = duration_s / count;
  const int left = 72, right = 24, panel_height = 220, width = 880;
  const int first_top = 84, second_top = first_top + panel_height + 64;
  Picture picture(width, second_top + panel_height + 56, kBackground);
  picture.text(16, 10, plot.title, kInk, 2);
  picture.text(16, 32, plot.subtitle, kDim);
  char windows_text[96];
  std::snprintf(windows_text, sizeof windows_text,
                "each point: the percentile of the samples in a %.3g s window", window_s);
  picture.text(16, 46, windows_text, kDim);
  const int panel_width = width - left - right;
  draw_panel(picture, left, first_top, panel_width, panel_height, "time to first token (ms)",
             windows_of(plot.ttft, count, window_s), window_s, duration_s);
  draw_panel(picture, left, second_top, panel_width, panel_height, "per-token latency (ms)",
             windows_of(plot.per_token, count, window_s), window_s, duration_s);
  picture.text(left + panel_width / 2 - Picture::text_width("seconds since the start") / 2,
               second_top + panel_height + 24, "seconds since the start", kDim);
  return picture.write_png(path);
}

}  // namespace moeline::stages
