#include "offload/trace.h"

#include <time.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace moeline::offload {

namespace {
constexpr const char* kHeaderV1 = "# moeline expert trace v1";
constexpr const char* kHeader = "# moeline expert trace v2";

uint64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// A process name or kind as one header field: no spaces or '='.
bool plain_word(const std::string& word) {
  return !word.empty() && word.find_first_of(" \t\n=") == std::string::npos;
}
}  // namespace

bool ExpertTrace::write(const std::string& path) const {
  if (processes.size() != 1 || kinds.size() != 1 || !plain_word(processes[0]) ||
      !plain_word(kinds[0]))
    return false;
  std::ofstream out(path);
  if (!out) return false;
  out << kHeader << " layers=" << layers << " experts=" << experts_per_layer
      << " slot_bytes=" << slot_bytes << " expert_bytes=" << expert_bytes
      << " process=" << processes[0] << " kind=" << kinds[0] << '\n';
  for (const ExpertAccess& a : accesses)
    out << a.layer << ' ' << a.expert << ' ' << a.t_ns << ' ' << (a.streaming ? 1 : 0) << '\n';
  return static_cast<bool>(out);
}

ExpertTrace ExpertTrace::read(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read expert trace " + path);
  ExpertTrace trace;
  std::string line;
  const bool v1 = std::getline(in, line) && line.rfind(kHeaderV1, 0) == 0;
  if (!v1 && line.rfind(kHeader, 0) != 0)
    throw std::runtime_error(path + ":1: not an expert trace (expected '" + kHeader + " ...')");
  std::istringstream header(line.substr(std::string(kHeader).size()));
  for (std::string field; header >> field;) {
    const auto eq = field.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = field.substr(0, eq);
    const std::string value = field.substr(eq + 1);
    try {
      if (key == "layers") trace.layers = std::stoi(value);
      if (key == "experts") trace.experts_per_layer = std::stoi(value);
      if (key == "slot_bytes") trace.slot_bytes = std::stoull(value);
      if (key == "expert_bytes") trace.expert_bytes = std::stoull(value);
      if (key == "process") trace.processes = {value};
      if (key == "kind") trace.kinds = {value};
    } catch (const std::exception&) {
      throw std::runtime_error(path + ":1: bad header field '" + field + "'");
    }
  }
  if (trace.layers <= 0 || trace.experts_per_layer <= 0 || trace.slot_bytes == 0)
    throw std::runtime_error(path + ":1: the header needs layers, experts and slot_bytes");
  size_t number = 1;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    std::istringstream row(line);
    ExpertAccess a;
    int streaming = 0;
    std::string rest;
    const bool fields = v1 ? static_cast<bool>(row >> a.layer >> a.expert)
                           : static_cast<bool>(row >> a.layer >> a.expert >> a.t_ns >> streaming);
    if (!fields || (row >> rest) || a.layer < 0 || a.layer >= trace.layers || a.expert < 0 ||
        a.expert >= trace.experts_per_layer || (streaming != 0 && streaming != 1))
      throw std::runtime_error(path + ":" + std::to_string(number) + ": expected '" +
                               (v1 ? "layer expert" : "layer expert t_ns streaming") +
                               "' within the header's shape, got '" + line + "'");
    a.streaming = streaming == 1;
    trace.accesses.push_back(a);
  }
  return trace;
}

ExpertTrace ExpertTrace::merge(std::vector<ExpertTrace> traces) {
  if (traces.empty()) throw std::runtime_error("no expert traces to merge");
  ExpertTrace merged = traces.front();
  merged.processes.clear();
  merged.kinds.clear();
  merged.accesses.clear();
  for (ExpertTrace& t : traces) {
    if (t.layers != merged.layers || t.experts_per_layer != merged.experts_per_layer ||
        t.slot_bytes != merged.slot_bytes || t.expert_bytes != merged.expert_bytes)
      throw std::runtime_error("expert traces of different models (process " + t.processes[0] +
                               "): layers, experts and slot sizes must match");
    const size_t first = merged.processes.size();
    if (first + t.processes.size() > 65535)
      throw std::runtime_error("too many processes in the expert traces");
    for (ExpertAccess a : t.accesses) {
      a.process = static_cast<uint16_t>(first + a.process);
      merged.accesses.push_back(a);
    }
    merged.processes.insert(merged.processes.end(), t.processes.begin(), t.processes.end());
    merged.kinds.insert(merged.kinds.end(), t.kinds.begin(), t.kinds.end());
  }
  std::stable_sort(merged.accesses.begin(), merged.accesses.end(),
                   [](const ExpertAccess& a, const ExpertAccess& b) { return a.t_ns < b.t_ns; });
  return merged;
}

void TraceRecorder::record(int layer, int expert) {
  if (trace_.accesses.size() < limit_)
    trace_.accesses.push_back({layer, expert, monotonic_ns(), 0, streaming_});
}

TraceRecorder::TraceRecorder(ExpertProvider& inner, const ExpertCatalog& catalog, size_t limit)
    : inner_(inner), limit_(limit) {
  trace_.layers = catalog.layers;
  trace_.experts_per_layer = catalog.experts_per_layer;
  trace_.slot_bytes = pool_slot_bytes(catalog);
  trace_.expert_bytes = catalog.pool_bytes_for_all();
}

ExpertWeights TraceRecorder::acquire(int layer, int expert) {
  record(layer, expert);
  return inner_.acquire(layer, expert);
}

std::optional<ExpertWeights> TraceRecorder::try_acquire(int layer, int expert) {
  auto got = inner_.try_acquire(layer, expert);
  // A refused try is retried with acquire (recorded then): one access either way.
  if (got) record(layer, expert);
  return got;
}

const char* replay_policy_name(ReplayPolicy policy) {
  switch (policy) {
    case ReplayPolicy::kLru:
      return "lru";
    case ReplayPolicy::kLru2:
      return "lru2";
    case ReplayPolicy::kLfu:
      return "lfu";
    case ReplayPolicy::kDistance:
      return "distance";
    case ReplayPolicy::kDistanceStream:
      return "distance-stream";
    case ReplayPolicy::kDistanceAll:
      return "distance-all";
    case ReplayPolicy::kDistanceArea:
      return "distance-area";
    case ReplayPolicy::kStepOracle:
      return "step-oracle";
    case ReplayPolicy::kBelady:
      return "belady";
  }
  return "?";
}

std::optional<ReplayPolicy> replay_policy_from(const std::string& name) {
  for (ReplayPolicy p : kReplayPolicies)
    if (name == replay_policy_name(p)) return p;
  if (name == replay_policy_name(ReplayPolicy::kBelady)) return ReplayPolicy::kBelady;
  return std::nullopt;
}

namespace {
struct ExpertUse {
  double uses = 0, visit = -1;
};
}  // namespace

ReplayResult replay(std::span<const ExpertAccess> accesses, uint64_t slots, ReplayPolicy policy) {
  ReplayResult result;
  result.accesses = accesses.size();
  size_t processes = 1;
  for (const ExpertAccess& a : accesses) processes = std::max<size_t>(processes, a.process + 1u);
  result.process_accesses.assign(processes, 0);
  result.process_hits.assign(processes, 0);
  for (const ExpertAccess& a : accesses) ++result.process_accesses[a.process];
  auto hit = [&result](const ExpertAccess& a) {
    ++result.hits;
    ++result.process_hits[a.process];
  };
  if (slots == 0) {
    result.loads = accesses.size();
    return result;
  }
  auto key = [](const ExpertAccess& a) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a.layer)) << 32) |
           static_cast<uint32_t>(a.expert);
  };
  const size_t n = accesses.size();
  if (policy == ReplayPolicy::kBelady) {
    // Next use of each access's expert (n: never again).
    std::vector<size_t> next(n, n);
    std::unordered_map<uint64_t, size_t> seen;
    for (size_t i = n; i-- > 0;) {
      const uint64_t k = key(accesses[i]);
      auto it = seen.find(k);
      next[i] = it == seen.end() ? n : it->second;
      seen[k] = i;
    }
    std::unordered_map<uint64_t, size_t> cached;                // expert -> its next use
    std::priority_queue<std::pair<size_t, uint64_t>> farthest;  // (next use, expert), lazy
    for (size_t i = 0; i < n; ++i) {
      const uint64_t k = key(accesses[i]);
      auto it = cached.find(k);
      if (it != cached.end()) {
        hit(accesses[i]);
      } else {
        ++result.loads;
        if (cached.size() >= slots) {
          while (true) {
            auto [use, victim] = farthest.top();
            farthest.pop();
            auto v = cached.find(victim);
            if (v != cached.end() && v->second == use) {
              cached.erase(v);
              break;
            }
          }
        }
      }
      cached[k] = next[i];
      farthest.push({next[i], k});
    }
    return result;
  }
  struct State {
    uint64_t last = 0, previous = 0, uses = 0;
    bool streamed = false;  // brought in by a streaming access and not used by decode since
  };
  std::unordered_map<uint64_t, State> cached;
  uint64_t tick = 0;
  const bool stream_aware =
      policy == ReplayPolicy::kDistanceStream || policy == ReplayPolicy::kDistanceAll ||
      policy == ReplayPolicy::kDistanceArea || policy == ReplayPolicy::kStepOracle;
  // kStepOracle: each process's decode steps (runs of its decode accesses whose layer never
  // falls), and while one runs, the experts the rest of it will take (with multiplicity).
  const bool oracle = policy == ReplayPolicy::kStepOracle;
  std::vector<uint8_t> step_starts;
  std::vector<size_t> next_decode;  // the same process's next decode access (n: none)
  std::vector<std::unordered_map<uint64_t, int>> step_rest(oracle ? processes : 0);
  if (oracle) {
    step_starts.assign(n, 0);
    next_decode.assign(n, n);
    std::vector<int32_t> last_layer(processes, -1);
    std::vector<size_t> last_index(processes, n);
    for (size_t i = 0; i < n; ++i) {
      const ExpertAccess& a = accesses[i];
      if (a.streaming) continue;
      step_starts[i] = last_layer[a.process] < 0 || a.layer < last_layer[a.process];
      last_layer[a.process] = a.layer;
      if (last_index[a.process] != n) next_decode[last_index[a.process]] = i;
      last_index[a.process] = i;
    }
  }
  // kDistanceArea: a streaming area of an eighth of the slots (at least one) takes what prefill
  // brings in, least recently used first out; decode's experts keep the rest.
  const uint64_t area_slots =
      policy == ReplayPolicy::kDistanceArea && slots >= 2 ? std::max<uint64_t>(1, slots / 8) : 0;
  const uint64_t main_slots = slots - area_slots;
  std::unordered_map<uint64_t, uint64_t> area;  // expert -> tick of its last use
  // The distance policies: the layers run in a cycle; an expert's next use is expected when its
  // layer next runs, or 1/p cycles later, p being how often its layer's visits used it. A visit
  // is a process's pass through a layer (as the pool counts them: each client its own).
  int32_t cycle = 1;
  for (const ExpertAccess& a : accesses) cycle = std::max(cycle, a.layer + 1);
  std::unordered_map<uint64_t, ExpertUse> usage;
  std::vector<double> visits(static_cast<size_t>(cycle), 0.0);
  std::vector<int32_t> process_layer(processes, -1);
  // kDistanceAll: where each process that decodes is, and when it was last seen there; one not
  // seen for kDecodeIdleNs has no step in flight and does not pull experts closer.
  std::vector<uint64_t> process_seen(processes, 0);
  std::vector<bool> decodes(processes, false);
  int32_t decode_layer = 0;  // kDistanceStream: the layer of the latest decode access
  for (size_t i = 0; i < n; ++i) {
    const ExpertAccess& a = accesses[i];
    const uint64_t k = key(a);
    ++tick;
    if (oracle && !a.streaming) {
      auto& rest = step_rest[a.process];
      if (step_starts[i]) {
        rest.clear();
        for (size_t j = i; j != n && (j == i || !step_starts[j]); j = next_decode[j])
          ++rest[key(accesses[j])];
      }
      if (auto it = rest.find(k); it != rest.end() && --it->second == 0) rest.erase(it);
    }
    const bool counted = !(stream_aware && a.streaming);
    if (counted) {
      const auto layer = static_cast<size_t>(a.layer);
      if (process_layer[a.process] != a.layer) {
        process_layer[a.process] = a.layer;
        visits[layer] += 1;
      }
      ExpertUse& use = usage[k];
      if (use.visit != visits[layer]) {
        use.visit = visits[layer];
        use.uses += 1;
      }
    }
    if (!a.streaming) {
      decodes[a.process] = true;
      process_seen[a.process] = a.t_ns;
      decode_layer = a.layer;
    }
    auto distance = [&](uint64_t expert) {
      const auto layer = static_cast<int32_t>(expert >> 32);
      const ExpertUse& u = usage[expert];
      const double layer_visits = visits[static_cast<size_t>(layer)];
      if (policy == ReplayPolicy::kDistance)
        return expected_reuse_distance(layer, a.layer, cycle, u.uses, layer_visits);
      if (policy == ReplayPolicy::kDistanceStream)
        return expected_reuse_distance(layer, decode_layer, cycle, u.uses, layer_visits);
      double nearest = std::numeric_limits<double>::infinity();
      for (size_t p = 0; p < processes; ++p) {
        if (!decodes[p] || process_layer[p] < 0 || a.t_ns > process_seen[p] + kDecodeIdleNs)
          continue;
        if (oracle && step_rest[p].contains(expert)) {
          // Due in this step: when its layer comes (now, for the layer running).
          const int32_t ahead = layer - process_layer[p];
          nearest = std::min(nearest, static_cast<double>(ahead < 0 ? ahead + cycle : ahead));
          continue;
        }
        nearest = std::min(
            nearest, expected_reuse_distance(layer, process_layer[p], cycle, u.uses, layer_visits));
      }
      return std::isinf(nearest)
                 ? expected_reuse_distance(layer, decode_layer, cycle, u.uses, layer_visits)
                 : nearest;
    };
    auto it = cached.find(k);
    bool promoted = false;  // found in the streaming area by a decode step: moves to the main part
    if (it == cached.end() && area_slots > 0) {
      auto in_area = area.find(k);
      if (in_area != area.end()) {
        hit(a);
        if (a.streaming) {
          in_area->second = tick;
          continue;
        }
        area.erase(in_area);
        promoted = true;
      } else if (a.streaming) {
        ++result.loads;
        if (area.size() >= area_slots)
          area.erase(std::min_element(area.begin(), area.end(), [](const auto& x, const auto& y) {
            return x.second < y.second;
          }));
        area.emplace(k, tick);
        continue;
      }
    }
    if (it != cached.end()) {
      hit(a);
    } else {
      if (!promoted) ++result.loads;
      if (cached.size() >= main_slots) {
        auto victim = cached.begin();
        for (auto c = cached.begin(); c != cached.end(); ++c) {
          const State& s = c->second;
          const State& v = victim->second;
          bool better = false;
          if (s.streamed != v.streamed) {
            better = s.streamed;  // what streaming brought in goes first
          } else if (s.streamed) {
            better = s.last < v.last;
          } else {
            switch (policy) {
              case ReplayPolicy::kLru:
                better = s.last < v.last;
                break;
              case ReplayPolicy::kLru2:
                better = s.previous < v.previous || (s.previous == v.previous && s.last < v.last);
                break;
              case ReplayPolicy::kLfu:
                better = s.uses < v.uses || (s.uses == v.uses && s.last < v.last);
                break;
              case ReplayPolicy::kDistance:
              case ReplayPolicy::kDistanceStream:
              case ReplayPolicy::kDistanceAll:
              case ReplayPolicy::kDistanceArea:
              case ReplayPolicy::kStepOracle: {
                // Ties go to the least recently used, as in the pool.
                const double candidate = distance(c->first), incumbent = distance(victim->first);
                better = candidate > incumbent || (candidate == incumbent && s.last < v.last);
                break;
              }
              case ReplayPolicy::kBelady:
                break;
            }
          }
          if (better) victim = c;
        }
        cached.erase(victim);
      }
      it = cached.emplace(k, State{.streamed = stream_aware && a.streaming}).first;
    }
    State& s = it->second;
    if (!counted && !s.streamed) continue;  // a streaming hit does not warm decode's expert
    if (!a.streaming) s.streamed = false;
    s.previous = s.last;
    s.last = tick;
    ++s.uses;
  }
  return result;
}

}  // namespace moeline::offload
