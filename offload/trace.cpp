#include "offload/trace.h"

#include <fstream>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace moeline::offload {

namespace {
constexpr const char* kHeader = "# moeline expert trace v1";
}

bool ExpertTrace::write(const std::string& path) const {
  std::ofstream out(path);
  if (!out) return false;
  out << kHeader << " layers=" << layers << " experts=" << experts_per_layer
      << " slot_bytes=" << slot_bytes << " expert_bytes=" << expert_bytes << '\n';
  for (const ExpertAccess& a : accesses) out << a.layer << ' ' << a.expert << '\n';
  return static_cast<bool>(out);
}

ExpertTrace ExpertTrace::read(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read expert trace " + path);
  ExpertTrace trace;
  std::string line;
  if (!std::getline(in, line) || line.rfind(kHeader, 0) != 0)
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
    std::string rest;
    if (!(row >> a.layer >> a.expert) || (row >> rest) || a.layer < 0 || a.layer >= trace.layers ||
        a.expert < 0 || a.expert >= trace.experts_per_layer)
      throw std::runtime_error(path + ":" + std::to_string(number) +
                               ": expected 'layer expert' within the header's shape, got '" + line +
                               "'");
    trace.accesses.push_back(a);
  }
  return trace;
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
    case ReplayPolicy::kBelady:
      return "belady";
  }
  return "?";
}

std::optional<ReplayPolicy> replay_policy_from(const std::string& name) {
  for (ReplayPolicy p : {ReplayPolicy::kLru, ReplayPolicy::kLru2, ReplayPolicy::kLfu,
                         ReplayPolicy::kDistance, ReplayPolicy::kBelady})
    if (name == replay_policy_name(p)) return p;
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
        ++result.hits;
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
  };
  std::unordered_map<uint64_t, State> cached;
  uint64_t tick = 0;
  // kDistance: the layers run in a cycle; an expert's next use is expected when its layer next
  // runs, or 1/p cycles later, p being how often its layer's visits used it.
  int32_t cycle = 1;
  for (const ExpertAccess& a : accesses) cycle = std::max(cycle, a.layer + 1);
  std::unordered_map<uint64_t, ExpertUse> usage;
  std::vector<double> visits(static_cast<size_t>(cycle), 0.0);
  int32_t current = -1;
  for (const ExpertAccess& a : accesses) {
    const uint64_t k = key(a);
    ++tick;
    if (a.layer != current) {
      current = a.layer;
      visits[static_cast<size_t>(current)] += 1;
    }
    ExpertUse& use = usage[k];
    if (use.visit != visits[static_cast<size_t>(current)]) {
      use.visit = visits[static_cast<size_t>(current)];
      use.uses += 1;
    }
    auto it = cached.find(k);
    if (it != cached.end()) {
      ++result.hits;
    } else {
      ++result.loads;
      if (cached.size() >= slots) {
        auto victim = cached.begin();
        for (auto c = cached.begin(); c != cached.end(); ++c) {
          const State& s = c->second;
          const State& v = victim->second;
          bool better = false;
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
            case ReplayPolicy::kDistance: {
              auto score = [&](uint64_t expert) {
                const auto layer = static_cast<int32_t>(expert >> 32);
                const ExpertUse& u = usage[expert];
                return expected_reuse_distance(layer, current, cycle, u.uses,
                                               visits[static_cast<size_t>(layer)]);
              };
              // Ties go to the least recently used, as in the pool.
              const double candidate = score(c->first), incumbent = score(victim->first);
              better = candidate > incumbent || (candidate == incumbent && s.last < v.last);
              break;
            }
            case ReplayPolicy::kBelady:
              break;
          }
          if (better) victim = c;
        }
        cached.erase(victim);
      }
      it = cached.emplace(k, State{}).first;
    }
    State& s = it->second;
    s.previous = s.last;
    s.last = tick;
    ++s.uses;
  }
  return result;
}

}  // namespace moeline::offload
