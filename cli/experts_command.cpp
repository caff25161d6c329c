#include "cli/experts_command.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/suggest.h"
#include "cli/args.h"
#include "offload/expert_pool.h"
#include "offload/trace.h"
#include "stages/stack/stack.h"

namespace moeline::cli {
namespace {

constexpr const char* kUsage =
    R"(usage: moeline experts --run-dir DIR [--png FILE] [--json]
       moeline experts replay --trace FILE [--budgets 100%,50%,25%] [--policies lru,distance]
                              [--json]

(default)  the router health of a running stack, from its offload manager: per MoE layer, the
           share of recent tokens each expert received as a heat map, the load imbalance
           (std/mean), the router's confidence (mean ln top-1/top-2) and its state
  --run-dir DIR   the stack's run directory (moeline stack up --run-dir)
  --png FILE      also write the heat map as a PNG (a row per layer, a column per expert)
  --json          print the offload manager's router report as JSON instead

replay     an expert access trace (moeline run --expert-trace FILE) against cache policies at
           each budget, next to the optimal bound (Belady's MIN) for the same budget
  --trace FILE    the trace
  --budgets LIST  shares of the experts or sizes ("25%", "64MiB"), comma-separated
                  (default 100%,50%,25%)
  --policies LIST lru, lru2, lfu, distance (the pool's: expected reuse distance over the
                  cycle of layers) (default: all four)
  --json          one JSON object
)";

[[noreturn]] void usage_error(const std::string& message) {
  throw std::invalid_argument(message);
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// A colour from dark blue (cold) to yellow (hot), t in [0, 1].
std::array<uint8_t, 3> heat_colour(double t) {
  t = std::clamp(t, 0.0, 1.0);
  const double r = std::clamp(1.6 * t - 0.2, 0.0, 1.0), g = std::clamp(1.4 * t, 0.0, 0.9),
               b = std::clamp(0.5 - 0.6 * t, 0.0, 0.5) + 0.1 * (1 - t);
  return {static_cast<uint8_t>(255 * r), static_cast<uint8_t>(255 * g),
          static_cast<uint8_t>(255 * b)};
}

void put_u32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8)
    out.push_back(static_cast<char>((v >> shift) & 0xff));
}

void png_chunk(std::string& out, const char* type, const std::string& data) {
  put_u32(out, static_cast<uint32_t>(data.size()));
  const std::string body = std::string(type, 4) + data;
  out += body;
  put_u32(out, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()),
                                           static_cast<uInt>(body.size()))));
}

// An RGB PNG of `rows` x `columns` cells of `cell` pixels, shaded by share[r][c] in [0, 1].
bool write_png(const std::string& path, const std::vector<std::vector<double>>& share, int cell) {
  const int rows = static_cast<int>(share.size());
  const int columns = rows ? static_cast<int>(share[0].size()) : 0;
  if (rows == 0 || columns == 0) return false;
  const int width = columns * cell, height = rows * cell;
  std::string raw;
  raw.reserve(static_cast<size_t>(height) * (1 + 3 * static_cast<size_t>(width)));
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);  // filter: none
    for (int x = 0; x < width; ++x) {
      const bool border = x % cell == 0 || y % cell == 0;
      const auto rgb =
          border ? std::array<uint8_t, 3>{40, 40, 40}
                 : heat_colour(share[static_cast<size_t>(y / cell)][static_cast<size_t>(x / cell)]);
      raw.append(reinterpret_cast<const char*>(rgb.data()), 3);
    }
  }
  uLongf packed_size = compressBound(static_cast<uLong>(raw.size()));
  std::string packed(packed_size, '\0');
  if (compress2(reinterpret_cast<Bytef*>(packed.data()), &packed_size,
                reinterpret_cast<const Bytef*>(raw.data()), static_cast<uLong>(raw.size()),
                9) != Z_OK)
    return false;
  packed.resize(packed_size);
  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  put_u32(header, static_cast<uint32_t>(width));
  put_u32(header, static_cast<uint32_t>(height));
  header += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit RGB, no interlace
  png_chunk(png, "IHDR", header);
  png_chunk(png, "IDAT", packed);
  png_chunk(png, "IEND", "");
  std::ofstream out(path, std::ios::binary);
  out.write(png.data(), static_cast<std::streamsize>(png.size()));
  return static_cast<bool>(out);
}

int show(const std::vector<std::string>& args) {
  std::string run_dir, png;
  bool json = false;
  for (size_t i = 0; i < args.size(); ++i) {
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) usage_error(args[i] + " needs a value");
      return args[++i];
    };
    if (args[i] == "--run-dir") {
      run_dir = value();
    } else if (args[i] == "--png") {
      png = value();
    } else if (args[i] == "--json") {
      json = true;
    } else {
      usage_error("unknown option '" + args[i] + "'" + did_you_mean(args[i], flags_in(kUsage)));
    }
  }
  if (run_dir.empty()) usage_error("--run-dir is required");
  const nlohmann::json detail = stages::stack_stage_detail(run_dir, "offload");
  if (!detail.is_object() || !detail.contains("router")) {
    std::cerr << "moeline: error: no offload manager answers in " << run_dir
              << " (is the stack up? moeline stack status --run-dir " << run_dir << ")\n";
    return 1;
  }
  const nlohmann::json& router = detail["router"];
  if (json) {
    std::cout << nlohmann::json{{"router", router}, {"expert_pool", detail["expert_pool"]}}.dump(2)
              << '\n';
    return 0;
  }
  // Each layer's counts as shares of its busiest expert.
  std::vector<std::vector<double>> share;
  std::vector<size_t> layer_index;
  for (size_t l = 0; l < router.size(); ++l) {
    const std::vector<double> counts = router[l].value("counts", std::vector<double>{});
    const double top = counts.empty() ? 0.0 : *std::max_element(counts.begin(), counts.end());
    if (top <= 0) continue;  // a dense layer, or no traffic yet
    std::vector<double> row;
    for (double c : counts) row.push_back(c / top);
    share.push_back(std::move(row));
    layer_index.push_back(l);
  }
  if (share.empty()) {
    std::cout << "no routed tokens yet\n";
    return 0;
  }
  static const char* kShades[] = {" ",      "\u2581", "\u2582", "\u2583", "\u2584",
                                  "\u2585", "\u2586", "\u2587", "\u2588"};
  const bool colour = ::isatty(STDOUT_FILENO) != 0;
  // With a pool: each layer's share of acquisitions served without a load.
  std::vector<uint64_t> layer_hits, layer_misses;
  if (detail.contains("expert_pool") && detail["expert_pool"].is_object()) {
    layer_hits = detail["expert_pool"].value("layer_hits", std::vector<uint64_t>{});
    layer_misses = detail["expert_pool"].value("layer_misses", std::vector<uint64_t>{});
  }
  auto pool_hits = [&](size_t layer) -> std::string {
    if (layer >= layer_hits.size() || layer >= layer_misses.size()) return "-";
    const uint64_t total = layer_hits[layer] + layer_misses[layer];
    if (total == 0) return "-";
    char text[16];
    std::snprintf(text, sizeof(text), "%.2f",
                  static_cast<double>(layer_hits[layer]) / static_cast<double>(total));
    return text;
  };
  std::printf("%-6s %-*s  %9s %10s %9s  %s\n", "layer", static_cast<int>(share[0].size()),
              "experts", "imbalance", "confidence", "pool hits", "state");
  for (size_t i = 0; i < share.size(); ++i) {
    const nlohmann::json& layer = router[layer_index[i]];
    std::string bar;
    for (double s : share[i]) {
      const auto level = static_cast<size_t>(std::lround(s * 8));
      if (colour) {
        const auto rgb = heat_colour(s);
        bar += "\x1b[38;2;" + std::to_string(rgb[0]) + ";" + std::to_string(rgb[1]) + ";" +
               std::to_string(rgb[2]) + "m" + kShades[level] + "\x1b[0m";
      } else {
        bar += kShades[level];
      }
    }
    const std::string state = layer.value("state", "");
    std::printf("%-6zu %s  %9.2f %10.2f %9s  %s%s%s\n", layer_index[i], bar.c_str(),
                layer.value("imbalance", 0.0), layer.value("confidence", 0.0),
                pool_hits(layer_index[i]).c_str(), state.c_str(),
                layer.value("reason", "").empty() ? "" : ": ", layer.value("reason", "").c_str());
  }
  if (detail.contains("expert_pool") && detail["expert_pool"].is_object()) {
    const nlohmann::json& pool = detail["expert_pool"];
    std::printf("expert pool %s: %d slots, hit ratio %.3f, %d loads, %d evictions\n",
                pool.value("name", "").c_str(), pool.value("slots", 0),
                pool.value("hit_ratio", 0.0), pool.value("loads", 0), pool.value("evictions", 0));
  }
  if (!png.empty()) {
    if (!write_png(png, share, 24)) {
      std::cerr << "moeline: error: cannot write " << png << '\n';
      return 1;
    }
    std::cout << "wrote " << png << '\n';
  }
  return 0;
}

int replay_command(const std::vector<std::string>& args) {
  std::string trace_path, budgets = "100%,50%,25%", policies = "lru,lru2,lfu,distance";
  bool json = false;
  for (size_t i = 0; i < args.size(); ++i) {
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) usage_error(args[i] + " needs a value");
      return args[++i];
    };
    if (args[i] == "--trace") {
      trace_path = value();
    } else if (args[i] == "--budgets") {
      budgets = value();
    } else if (args[i] == "--policies") {
      policies = value();
    } else if (args[i] == "--json") {
      json = true;
    } else {
      usage_error("unknown option '" + args[i] + "'" + did_you_mean(args[i], flags_in(kUsage)));
    }
  }
  if (trace_path.empty()) usage_error("--trace is required");
  std::vector<offload::ReplayPolicy> chosen;
  for (const std::string& name : split(policies)) {
    auto policy = offload::replay_policy_from(name);
    if (!policy || *policy == offload::ReplayPolicy::kBelady)
      usage_error("--policies: unknown policy '" + name + "' (lru, lru2, lfu, distance)");
    chosen.push_back(*policy);
  }
  const offload::ExpertTrace trace = offload::ExpertTrace::read(trace_path);
  nlohmann::json out = {{"trace", trace_path},
                        {"accesses", trace.accesses.size()},
                        {"slot_bytes", trace.slot_bytes},
                        {"expert_bytes", trace.expert_bytes},
                        {"budgets", nlohmann::json::array()}};
  if (!json) std::printf("%-10s %6s %9s %9s\n", "budget", "slots", "policy", "hit ratio");
  for (const std::string& budget : split(budgets)) {
    if (budget.find('%') != std::string::npos && trace.expert_bytes == 0)
      usage_error("the trace does not say its expert bytes: give budgets as sizes");
    const uint64_t bytes = offload::parse_expert_budget(budget, trace.expert_bytes);
    const uint64_t slots = bytes / trace.slot_bytes;
    nlohmann::json row = {{"budget", budget}, {"bytes", bytes}, {"slots", slots}};
    auto add = [&](offload::ReplayPolicy policy) {
      const offload::ReplayResult r = offload::replay(trace.accesses, slots, policy);
      row[offload::replay_policy_name(policy)] = r.hit_ratio();
      if (!json)
        std::printf("%-10s %6llu %9s %9.4f\n", budget.c_str(),
                    static_cast<unsigned long long>(slots), offload::replay_policy_name(policy),
                    r.hit_ratio());
    };
    for (offload::ReplayPolicy p : chosen) add(p);
    add(offload::ReplayPolicy::kBelady);
    out["budgets"].push_back(row);
  }
  if (json) std::cout << out.dump(2) << '\n';
  return 0;
}

}  // namespace

int experts_command(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  if (std::find(args.begin(), args.end(), "--help") != args.end()) {
    std::cout << kUsage;
    return 0;
  }
  return run_reporting_errors<std::invalid_argument>(kUsage, [&] {
    if (!args.empty() && args[0] == "replay")
      return replay_command(std::vector<std::string>(args.begin() + 1, args.end()));
    return show(args);
  });
}

}  // namespace moeline::cli
