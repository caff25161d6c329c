#pragma once
// Expert access traces, and replaying them offline against a cache policy and a budget next to the
// optimal bound (Belady's MIN: evict the expert whose next use is farthest away), so a policy's
// hit ratio can be judged against what any policy could have reached on the same accesses.
//
// A trace is the sequence of (layer, expert) acquisitions a forward pass made, recorded by wrapping
// the engine's ExpertProvider (moeline run --expert-trace). File: a header line
// "# moeline expert trace v1 layers=L experts=E slot_bytes=B expert_bytes=T", then "layer expert"
// per line.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "offload/expert_pool.h"
#include "offload/expert_provider.h"

namespace moeline::offload {

struct ExpertAccess {
  int32_t layer = 0, expert = 0;
  bool operator==(const ExpertAccess&) const = default;
};

struct ExpertTrace {
  int layers = 0, experts_per_layer = 0;
  uint64_t slot_bytes = 0;    // one pool slot (an expert with alignment): budget / slot_bytes slots
  uint64_t expert_bytes = 0;  // a pool of every expert: what a budget of "25%" is a share of
  std::vector<ExpertAccess> accesses;

  bool write(const std::string& path) const;
  // Throws std::runtime_error naming the file and line on anything malformed.
  static ExpertTrace read(const std::string& path);
};

// Passes every call through to `inner` and records each acquisition (the first `limit`).
class TraceRecorder final : public ExpertProvider {
 public:
  TraceRecorder(ExpertProvider& inner, const ExpertCatalog& catalog,
                size_t limit = static_cast<size_t>(-1));
  int layers() const override { return inner_.layers(); }
  int experts_per_layer() const override { return inner_.experts_per_layer(); }
  ExpertWeights acquire(int layer, int expert) override;
  std::optional<ExpertWeights> try_acquire(int layer, int expert) override;
  void release(int layer, int expert) override { inner_.release(layer, expert); }
  void prefetch(int layer, std::span<const int32_t> experts) override {
    inner_.prefetch(layer, experts);
  }
  int prefetch_depth() const override { return inner_.prefetch_depth(); }

  const ExpertTrace& trace() const { return trace_; }
  bool write(const std::string& path) const { return trace_.write(path); }

 private:
  void record(int layer, int expert) {
    if (trace_.accesses.size() < limit_) trace_.accesses.push_back({layer, expert});
  }
  ExpertProvider& inner_;
  ExpertTrace trace_;
  size_t limit_;
};

enum class ReplayPolicy { kLru, kLru2, kLfu, kDistance, kBelady };
const char* replay_policy_name(ReplayPolicy policy);
std::optional<ReplayPolicy> replay_policy_from(const std::string& name);

struct ReplayResult {
  uint64_t accesses = 0, hits = 0, loads = 0;
  double hit_ratio() const {
    return accesses ? static_cast<double>(hits) / static_cast<double>(accesses) : 1.0;
  }
};

// A cache of `slots` experts serving the accesses one at a time, filled on demand.
ReplayResult replay(std::span<const ExpertAccess> accesses, uint64_t slots, ReplayPolicy policy);

}  // namespace moeline::offload
