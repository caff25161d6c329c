#include "cli/experts_command.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/suggest.h"
#include "cli/args.h"
#include "cli/picture.h"
#include "offload/expert_pool.h"
#include "offload/trace.h"
#include "stages/stack/stack.h"

namespace moeline::cli {
namespace {

constexpr const char* kUsage =
    R"(usage: moeline experts --run-dir DIR [--png FILE] [--json]
       moeline experts replay --trace FILE [--trace FILE ...] [--budgets 100%,50%,25%]
                              [--policies lru,distance] [--relabel SEED] [--json]

(default)  the router health of a running stack, from its offload manager: per MoE layer, the
           share of recent tokens each expert received as a heat map, the load imbalance
           (std/mean), the router's confidence (mean ln top-1/top-2) and its state
  --run-dir DIR   the stack's run directory (moeline stack up --run-dir)
  --png FILE      also write the heat map as a PNG: a row per MoE layer, a column per expert,
                  titled with the model and the time window, with a colour scale
  --json          print the offload manager's router report as JSON instead

replay     expert access traces (--expert-trace of `moeline run` or of a stack's prefill and decode
           processes) against cache policies at each budget, next to the optimal bound (Belady's
           MIN) for the same budget. Several traces (the processes sharing one pool) are merged
           by time and replayed as one stream against one cache; each hit ratio is also given
           per process kind (prefill, decode)
  --trace FILE    a trace; repeat it for each process (or list them: a,b,c)
  --budgets LIST  shares of the experts or sizes ("25%", "64MiB"), comma-separated
                  (default 100%,50%,25%)
  --policies LIST lru, lru2, lfu, distance (the pool's: expected reuse distance over the
                  cycle of layers), distance-stream (prefill's acquisitions neither counted nor
                  kept warm: they enter at the cold end), distance-all (that, with distances from
                  every decode process's layer), distance-area (distance-all with prefill's
                  acquisitions in a streaming area of an eighth of the slots), distance-layer
                  (the pool's today: distance-all keeping what each process has still to take
                  of the layer it runs), distance-hinted (distance-layer weighing the decode
                  steps' predictions of their next layers, recorded in the traces, by how often
                  they came true), step-oracle (a bound: distance-all told which experts the
                  rest of each running decode step takes) (default: all ten)
  --relabel SEED  replay the traces with each visit of a process to a layer given a random
                  relabelling of that layer's experts (what each visit takes stays; what it
                  shares with other visits is left to chance): Belady's lead over a policy on
                  such a trace is what no online policy can close
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
Rgb heat_colour(double t) {
  t = std::clamp(t, 0.0, 1.0);
  const double r = std::clamp(1.6 * t - 0.2, 0.0, 1.0), g = std::clamp(1.4 * t, 0.0, 0.9),
               b = std::clamp(0.5 - 0.6 * t, 0.0, 0.5) + 0.1 * (1 - t);
  return {static_cast<uint8_t>(255 * r), static_cast<uint8_t>(255 * g),
          static_cast<uint8_t>(255 * b)};
}

// The heat map as a picture: a row per MoE layer (labelled with its index), a column per expert,
// each cell the expert's tokens as a share of the layer's busiest expert; a title with the model
// and the time window, axis labels, and the colour scale.
bool write_heat_map(const std::string& path, const std::vector<std::vector<double>>& share,
                    const std::vector<size_t>& layer_index, const std::string& model,
                    double decay) {
  const int rows = static_cast<int>(share.size());
  const int columns = rows ? static_cast<int>(share[0].size()) : 0;
  if (rows == 0 || columns == 0) return false;
  const int cell = std::clamp(1200 / columns, 6, 24);
  const Rgb ink{230, 230, 230}, dim{150, 150, 150}, background{24, 24, 28};
  char when[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const std::string title = "expert routing: " + (model.empty() ? std::string("model") : model);
  const int window = decay > 0 && decay < 1 ? static_cast<int>(std::lround(1 / (1 - decay))) : 0;
  const std::string subtitle =
      "tokens per expert / the layer's busiest expert; recent traffic" +
      (window ? " (about the last " + std::to_string(window) + " reports)" : std::string()) + ", " +
      when;
  const int left = 16 + Picture::text_width("layer"), top = 56, right = 16, bottom = 84;
  const int grid_width = columns * cell, grid_height = rows * cell;
  const int width = std::max({left + grid_width + right, 16 + Picture::text_width(title, 2) + 16,
                              16 + Picture::text_width(subtitle) + 16, left + 260 + right});
  Picture picture(width, top + grid_height + bottom, background);
  picture.text(16, 10, title, ink, 2);
  picture.text(16, 32, subtitle, dim);
  // Rows: the layer index at the left of each; the axis name above them.
  picture.text(8, top - 12, "layer", dim);
  for (int r = 0; r < rows; ++r) {
    const std::string label = std::to_string(layer_index[static_cast<size_t>(r)]);
    if (cell >= 8 || r % 4 == 0)
      picture.text(left - 6 - Picture::text_width(label), top + r * cell + (cell - 7) / 2, label,
                   ink);
    for (int c = 0; c < columns; ++c)
      picture.fill(left + c * cell + 1, top + r * cell + 1, cell - 1, cell - 1,
                   heat_colour(share[static_cast<size_t>(r)][static_cast<size_t>(c)]));
  }
  // Columns: every k-th expert's index below the grid, k so that the labels do not overlap.
  const int label_every =
      std::max(1, (Picture::text_width(std::to_string(columns - 1)) + 4 + cell - 1) / cell);
  for (int c = 0; c < columns; c += label_every) {
    const std::string label = std::to_string(c);
    picture.text(left + c * cell + (cell - Picture::text_width(label)) / 2, top + grid_height + 4,
                 label, ink);
  }
  picture.text(left, top + grid_height + 16, "expert", dim);
  // The colour scale: 0 (no tokens) to 1 (the layer's busiest expert).
  const int scale_y = top + grid_height + 34, scale_width = 240;
  for (int x = 0; x < scale_width; ++x)
    picture.fill(left + x, scale_y, 1, 12, heat_colour(static_cast<double>(x) / (scale_width - 1)));
  picture.text(left, scale_y + 16, "0", ink);
  picture.text(left + scale_width - Picture::text_width("1"), scale_y + 16, "1", ink);
  picture.text(left + 16, scale_y + 16, "share of the layer's busiest expert", dim);
  return picture.write_png(path);
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
      usage_error(unknown_option(args[i], kUsage));
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
    if (!write_heat_map(png, share, layer_index, detail.value("model", ""),
                        detail.value("router_decay", 0.0))) {
      std::cerr << "moeline: error: cannot write " << png << '\n';
      return 1;
    }
    std::cout << "wrote " << png << '\n';
  }
  return 0;
}

int replay_command(const std::vector<std::string>& args) {
  std::vector<std::string> trace_paths;
  // Every policy by default, and their names for an unknown one.
  std::string budgets = "100%,50%,25%", policies, known;
  for (offload::ReplayPolicy policy : offload::kReplayPolicies) {
    if (!policies.empty()) {
      policies.append(",");
      known.append(", ");
    }
    policies.append(offload::replay_policy_name(policy));
    known.append(offload::replay_policy_name(policy));
  }
  bool json = false;
  std::optional<uint64_t> relabel_seed;
  for (size_t i = 0; i < args.size(); ++i) {
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) usage_error(args[i] + " needs a value");
      return args[++i];
    };
    if (args[i] == "--trace") {
      for (const std::string& path : split(value())) trace_paths.push_back(path);
    } else if (args[i] == "--budgets") {
      budgets = value();
    } else if (args[i] == "--policies") {
      policies = value();
    } else if (args[i] == "--json") {
      json = true;
    } else if (args[i] == "--relabel") {
      const std::string text = value();
      try {
        size_t used = 0;
        relabel_seed = std::stoull(text, &used);
        if (used != text.size()) throw std::invalid_argument(text);
      } catch (const std::exception&) {
        usage_error("--relabel needs a seed (a non-negative integer), got '" + text + "'");
      }
    } else {
      usage_error(unknown_option(args[i], kUsage));
    }
  }
  if (trace_paths.empty()) usage_error("--trace is required");
  std::vector<offload::ReplayPolicy> chosen;
  for (const std::string& name : split(policies)) {
    auto policy = offload::replay_policy_from(name);
    if (!policy || *policy == offload::ReplayPolicy::kBelady)
      usage_error("--policies: unknown policy '" + name + "' (" + known + ")");
    chosen.push_back(*policy);
  }
  std::vector<offload::ExpertTrace> traces;
  for (const std::string& path : trace_paths) traces.push_back(offload::ExpertTrace::read(path));
  offload::ExpertTrace trace = offload::ExpertTrace::merge(std::move(traces));
  if (relabel_seed) trace = offload::relabel_visits(trace, *relabel_seed);
  // The kinds of process in the traces, in order of appearance, and each process's kind.
  std::vector<std::string> kinds;
  for (const std::string& kind : trace.kinds)
    if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(kind);
  nlohmann::json processes = nlohmann::json::array();
  for (size_t p = 0; p < trace.processes.size(); ++p)
    processes.push_back({{"process", trace.processes[p]}, {"kind", trace.kinds[p]}});
  nlohmann::json out = {
      {"traces", trace_paths},
      {"processes", processes},
      {"accesses", trace.accesses.size()},
      {"hints", trace.hints.size()},
      {"relabel_seed", relabel_seed ? nlohmann::json(*relabel_seed) : nlohmann::json()},
      {"slot_bytes", trace.slot_bytes},
      {"expert_bytes", trace.expert_bytes},
      {"budgets", nlohmann::json::array()}};
  const bool by_kind = kinds.size() > 1;
  if (!json) {
    std::printf("%-10s %6s %15s %9s", "budget", "slots", "policy", "hit ratio");
    if (by_kind)
      for (const std::string& kind : kinds) std::printf(" %9s", kind.c_str());
    std::printf("\n");
  }
  for (const std::string& budget : split(budgets)) {
    if (budget.find('%') != std::string::npos && trace.expert_bytes == 0)
      usage_error("the trace does not say its expert bytes: give budgets as sizes");
    const uint64_t bytes = offload::parse_expert_budget(budget, trace.expert_bytes);
    const uint64_t slots = bytes / trace.slot_bytes;
    nlohmann::json row = {{"budget", budget}, {"bytes", bytes}, {"slots", slots}};
    auto add = [&](offload::ReplayPolicy policy) {
      const offload::ReplayResult r = offload::replay(trace.accesses, slots, policy, trace.hints);
      const char* name = offload::replay_policy_name(policy);
      row[name] = r.hit_ratio();
      if (!json)
        std::printf("%-10s %6llu %15s %9.4f", budget.c_str(),
                    static_cast<unsigned long long>(slots), name, r.hit_ratio());
      for (const std::string& kind : kinds) {
        uint64_t accesses = 0, hits = 0;
        for (size_t p = 0; p < r.process_accesses.size(); ++p) {
          if (trace.kinds[p] != kind) continue;
          accesses += r.process_accesses[p];
          hits += r.process_hits[p];
        }
        const double ratio =
            accesses ? static_cast<double>(hits) / static_cast<double>(accesses) : 1.0;
        row["by_kind"][kind][name] = ratio;
        row["by_kind"][kind]["accesses"] = accesses;
        if (!json && by_kind) std::printf(" %9.4f", ratio);
      }
      if (!json) std::printf("\n");
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
