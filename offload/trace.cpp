#include "offload/trace.h"

#include <time.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <random>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace moeline::offload {

namespace {
constexpr const char* kHeaderV1 = "# moeline expert trace v1";
constexpr const char* kHeaderV2 = "# moeline expert trace v2";
constexpr const char* kHeader = "# moeline expert trace v3";

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
    out << a.layer << ' ' << a.expert << ' ' << a.t_ns << ' ' << (a.streaming ? 1 : 0) << " 0\n";
  for (const ExpertHint& h : hints)
    out << h.layer << ' ' << h.expert << ' ' << h.t_ns << ' ' << (h.streaming ? 1 : 0) << " 1\n";
  return static_cast<bool>(out);
}

ExpertTrace ExpertTrace::read(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read expert trace " + path);
  ExpertTrace trace;
  std::string line;
  std::getline(in, line);
  const int version = line.rfind(kHeaderV1, 0) == 0   ? 1
                      : line.rfind(kHeaderV2, 0) == 0 ? 2
                      : line.rfind(kHeader, 0) == 0   ? 3
                                                      : 0;
  if (version == 0)
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
  const char* expected = version == 1   ? "layer expert"
                         : version == 2 ? "layer expert t_ns streaming"
                                        : "layer expert t_ns streaming hint";
  size_t number = 1;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    std::istringstream row(line);
    ExpertAccess a;
    int streaming = 0, hint = 0;
    std::string rest;
    bool fields = static_cast<bool>(row >> a.layer >> a.expert);
    if (fields && version >= 2) fields = static_cast<bool>(row >> a.t_ns >> streaming);
    if (fields && version >= 3) fields = static_cast<bool>(row >> hint);
    if (!fields || (row >> rest) || a.layer < 0 || a.layer >= trace.layers || a.expert < 0 ||
        a.expert >= trace.experts_per_layer || (streaming != 0 && streaming != 1) ||
        (hint != 0 && hint != 1))
      throw std::runtime_error(path + ":" + std::to_string(number) + ": expected '" + expected +
                               "' within the header's shape, got '" + line + "'");
    a.streaming = streaming == 1;
    if (hint == 1)
      trace.hints.push_back({a.layer, a.expert, a.t_ns, 0, a.streaming});
    else
      trace.accesses.push_back(a);
  }
  std::stable_sort(trace.hints.begin(), trace.hints.end(),
                   [](const ExpertHint& a, const ExpertHint& b) { return a.t_ns < b.t_ns; });
  return trace;
}

ExpertTrace ExpertTrace::merge(std::vector<ExpertTrace> traces) {
  if (traces.empty()) throw std::runtime_error("no expert traces to merge");
  ExpertTrace merged = traces.front();
  merged.processes.clear();
  merged.kinds.clear();
  merged.accesses.clear();
  merged.hints.clear();
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
    for (ExpertHint h : t.hints) {
      h.process = static_cast<uint16_t>(first + h.process);
      merged.hints.push_back(h);
    }
    merged.processes.insert(merged.processes.end(), t.processes.begin(), t.processes.end());
    merged.kinds.insert(merged.kinds.end(), t.kinds.begin(), t.kinds.end());
  }
  std::stable_sort(merged.accesses.begin(), merged.accesses.end(),
                   [](const ExpertAccess& a, const ExpertAccess& b) { return a.t_ns < b.t_ns; });
  std::stable_sort(merged.hints.begin(), merged.hints.end(),
                   [](const ExpertHint& a, const ExpertHint& b) { return a.t_ns < b.t_ns; });
  return merged;
}

void TraceRecorder::record(int layer, int expert) {
  if (!full()) trace_.accesses.push_back({layer, expert, monotonic_ns(), 0, streaming_});
}

void TraceRecorder::prefetch(int layer, std::span<const int32_t> experts) {
  const uint64_t now = monotonic_ns();
  for (int32_t expert : experts)
    if (!full()) trace_.hints.push_back({layer, expert, now, 0, streaming_});
  inner_.prefetch(layer, experts);
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

ExpertTrace relabel_visits(const ExpertTrace& trace, uint64_t seed) {
  ExpertTrace out = trace;
  out.hints.clear();
  std::mt19937_64 rng(seed);
  const auto experts = static_cast<size_t>(std::max(trace.experts_per_layer, 1));
  std::vector<int32_t> last_layer(trace.processes.size() + 1, -1);
  std::vector<std::vector<int32_t>> labels(trace.processes.size() + 1,
                                           std::vector<int32_t>(experts));
  for (ExpertAccess& a : out.accesses) {
    if (a.process >= labels.size()) {
      labels.resize(a.process + 1u, std::vector<int32_t>(experts));
      last_layer.resize(a.process + 1u, -1);
    }
    std::vector<int32_t>& relabel = labels[a.process];
    if (a.layer != last_layer[a.process]) {  // a new visit: a new permutation of the layer
      last_layer[a.process] = a.layer;
      std::iota(relabel.begin(), relabel.end(), 0);
      std::shuffle(relabel.begin(), relabel.end(), rng);
    }
    if (static_cast<size_t>(a.expert) < experts) a.expert = relabel[static_cast<size_t>(a.expert)];
  }
  return out;
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
    case ReplayPolicy::kDistanceLayer:
      return "distance-layer";
    case ReplayPolicy::kDistanceHinted:
      return "distance-hinted";
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

namespace {
// kDistanceHinted's knowledge: each decoding process's latest prediction for each layer of the
// step it runs, what the step has used, and how often predictions made d layers ahead turned out
// right (by d).
class HintBook {
 public:
  HintBook(size_t processes, int32_t layers, int32_t experts)
      : layers_(layers), experts_(experts), processes_(processes) {
    for (Process& p : processes_) {
      p.sets.assign(static_cast<size_t>(layers), {});
      p.used.assign(static_cast<size_t>(layers * experts), 0);
    }
    outcomes_.assign(static_cast<size_t>(layers + 1), {});
  }

  void hint(const ExpertHint& h) {
    if (h.streaming) return;  // prefill's predictions: its acquisitions do not warm experts
    Process& p = processes_[h.process];
    Set& set = p.sets[static_cast<size_t>(h.layer)];
    // A layer not after the one running is predicted for the process's next step.
    const bool next_step = h.layer <= p.layer;
    if (set.t_ns != h.t_ns || set.step != p.step + next_step) {  // a newer prediction replaces it
      set.t_ns = h.t_ns;
      set.step = p.step + next_step;
      set.ahead =
          std::clamp(next_step ? h.layer + layers_ - p.layer : h.layer - p.layer, 1, layers_);
      set.hinted.assign(static_cast<size_t>(experts_), 0);
    }
    set.hinted[static_cast<size_t>(h.expert)] = 1;
  }

  // A decode access of process `process`: a step starts when its layer falls; a layer it leaves
  // has its prediction scored.
  void access(uint16_t process, int32_t layer, int32_t expert) {
    Process& p = processes_[process];
    if (layer != p.layer) {
      if (p.layer >= 0) score(p, p.layer);
      if (layer < p.layer) ++p.step;
      p.layer = layer;
      std::fill_n(p.used.begin() + layer * experts_, experts_, 0);
    }
    p.used[static_cast<size_t>(layer * experts_ + expert)] = 1;
  }

  // The probability that `process` uses `expert` of `layer` when that layer next runs in its
  // current step, when it predicted that layer (nullopt: no prediction for it).
  std::optional<double> chance(size_t process, int32_t layer, int32_t expert) const {
    const Process& p = processes_[process];
    const Set& set = p.sets[static_cast<size_t>(layer)];
    if (set.step != p.step || set.t_ns == 0 || layer <= p.layer) return std::nullopt;
    const Outcomes& o = outcomes_[static_cast<size_t>(set.ahead)];
    return set.hinted[static_cast<size_t>(expert)] ? (o.hinted_used + 1.0) / (o.hinted + 2.0)
                                                   : (o.other_used + 0.5) / (o.other + 1.0);
  }

 private:
  struct Set {
    uint64_t t_ns = 0, step = 0;
    int32_t ahead = 1;
    std::vector<uint8_t> hinted;
  };
  struct Process {
    int32_t layer = -1;
    uint64_t step = 0;
    std::vector<Set> sets;      // by layer
    std::vector<uint8_t> used;  // by layer * experts + expert, this step
  };
  struct Outcomes {
    double hinted = 0, hinted_used = 0, other = 0, other_used = 0;
  };

  void score(Process& p, int32_t layer) {
    Set& set = p.sets[static_cast<size_t>(layer)];
    if (set.t_ns == 0 || set.step != p.step) return;
    Outcomes& o = outcomes_[static_cast<size_t>(set.ahead)];
    for (int32_t e = 0; e < experts_; ++e) {
      const bool used = p.used[static_cast<size_t>(layer * experts_ + e)] != 0;
      if (set.hinted[static_cast<size_t>(e)]) {
        o.hinted += 1;
        o.hinted_used += used;
      } else {
        o.other += 1;
        o.other_used += used;
      }
    }
    set.t_ns = 0;
  }

  int32_t layers_, experts_;
  std::vector<Process> processes_;
  std::vector<Outcomes> outcomes_;  // by layers ahead
};
}  // namespace

ReplayResult replay(std::span<const ExpertAccess> accesses, uint64_t slots, ReplayPolicy policy,
                    std::span<const ExpertHint> hints) {
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
      policy == ReplayPolicy::kDistanceArea || policy == ReplayPolicy::kDistanceLayer ||
      policy == ReplayPolicy::kDistanceHinted || policy == ReplayPolicy::kStepOracle;
  // kStepOracle: each process's decode steps (runs of its decode accesses whose layer never
  // falls), and while one runs, the experts the rest of it will take (with multiplicity).
  // kDistanceLayer and kDistanceHinted know what every process still takes of the layer it runs
  // (the engine routes a layer's tokens before it acquires their experts, and tells the pool):
  // the rest of each run of a process's accesses to one layer, prefill's as well as decode's.
  const bool oracle = policy == ReplayPolicy::kStepOracle;
  const bool hinted = policy == ReplayPolicy::kDistanceHinted;
  const bool knows_layer = hinted || policy == ReplayPolicy::kDistanceLayer;
  std::vector<uint8_t> run_starts;
  std::vector<size_t> next_decode;  // the same process's next access of the run's kind (n: none)
  std::vector<std::unordered_map<uint64_t, int>> known_rest(oracle || knows_layer ? processes : 0);
  if (oracle || knows_layer) {
    run_starts.assign(n, 0);
    next_decode.assign(n, n);
    std::vector<int32_t> last_layer(processes, -1);
    std::vector<size_t> last_index(processes, n);
    for (size_t i = 0; i < n; ++i) {
      const ExpertAccess& a = accesses[i];
      if (a.streaming && oracle) continue;
      const int32_t last = last_layer[a.process];
      run_starts[i] = last < 0 || (oracle ? a.layer < last : a.layer != last);
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
  int32_t cycle = 1, experts = 1;
  for (const ExpertAccess& a : accesses) {
    cycle = std::max(cycle, a.layer + 1);
    experts = std::max(experts, a.expert + 1);
  }
  for (const ExpertHint& h : hints) {
    cycle = std::max(cycle, h.layer + 1);
    experts = std::max(experts, h.expert + 1);
    processes = std::max<size_t>(processes, h.process + 1u);
  }
  std::optional<HintBook> book;
  if (hinted) book.emplace(processes, cycle, experts);
  size_t next_hint = 0;
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
    if ((oracle && !a.streaming) || knows_layer) {
      auto& rest = known_rest[a.process];
      if (run_starts[i]) {
        rest.clear();
        for (size_t j = i; j != n && (j == i || !run_starts[j]); j = next_decode[j])
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
    if (book) {
      for (; next_hint < hints.size() && hints[next_hint].t_ns <= a.t_ns; ++next_hint)
        book->hint(hints[next_hint]);
      if (!a.streaming) book->access(a.process, a.layer, a.expert);
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
        if (oracle && known_rest[p].contains(expert)) {
          // Due in this step: when its layer comes (now, for the layer running).
          const int32_t ahead = layer - process_layer[p];
          nearest = std::min(nearest, static_cast<double>(ahead < 0 ? ahead + cycle : ahead));
          continue;
        }
        if (book) {
          if (auto chance = book->chance(p, layer, static_cast<int32_t>(expert & 0xFFFFFFFFu))) {
            // Used when its layer comes with that chance, else the estimate's cycles after it.
            const double picked = pick_probability(u.uses, layer_visits);
            nearest = std::min(nearest, (layer - process_layer[p]) +
                                            (1.0 - *chance) * static_cast<double>(cycle) / picked);
            continue;
          }
        }
        nearest = std::min(
            nearest, expected_reuse_distance(layer, process_layer[p], cycle, u.uses, layer_visits));
      }
      return std::isinf(nearest)
                 ? expected_reuse_distance(layer, decode_layer, cycle, u.uses, layer_visits)
                 : nearest;
    };
    // Wanted now: what a process has still to take of the layer it runs (knows_layer).
    auto wanted_now = [&](uint64_t expert) {
      for (const auto& rest : known_rest)
        if (rest.contains(expert)) return true;
      return false;
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
          const bool wanted = knows_layer && wanted_now(c->first);
          if (knows_layer && wanted != wanted_now(victim->first)) {
            better = !wanted;  // about to be taken: evicted only when nothing else may go
          } else if (s.streamed != v.streamed) {
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
              case ReplayPolicy::kDistanceLayer:
              case ReplayPolicy::kDistanceHinted:
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
