#pragma once
// Expert access traces, and replaying them offline against a cache policy and a budget next to the
// optimal bound (Belady's MIN: evict the expert whose next use is farthest away), so a policy's
// hit ratio can be judged against what any policy could have reached on the same accesses.
//
// A trace is the sequence of (layer, expert) acquisitions a process's forward passes made, recorded
// by wrapping the engine's ExpertProvider (`moeline run` and the compute stages, --expert-trace).
// File (v2): a header line "# moeline expert trace v2 layers=L experts=E slot_bytes=B
// expert_bytes=T process=NAME kind=KIND", then "layer expert t_ns streaming" per line: when it was
// acquired (CLOCK_MONOTONIC, so the traces of the processes of one host merge into the order the
// shared pool saw) and whether a prefill batch acquired it (1) or a decode step (0). v1 files (no
// process, "layer expert" lines) are still read.
//
// The traces of several processes sharing a pool are merged by time (`merge`) and replayed as one
// stream against one cache, each access's hit counted for its process.

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
  uint64_t t_ns = 0;       // CLOCK_MONOTONIC when acquired (0 in v1 traces)
  uint16_t process = 0;    // which of the trace's processes acquired it
  bool streaming = false;  // acquired by a prefill batch (ExpertProvider::set_streaming)
  bool operator==(const ExpertAccess&) const = default;
};

struct ExpertTrace {
  int layers = 0, experts_per_layer = 0;
  uint64_t slot_bytes = 0;    // one pool slot (an expert with alignment): budget / slot_bytes slots
  uint64_t expert_bytes = 0;  // a pool of every expert: what a budget of "25%" is a share of
  // The processes the accesses came from ("decode-0"), with their kinds ("prefill", "decode",
  // "run"); one for a trace read from a file, more once merged.
  std::vector<std::string> processes = {"run"}, kinds = {"run"};
  std::vector<ExpertAccess> accesses;

  // Writes a one-process trace (a merged one is written per process: not here).
  bool write(const std::string& path) const;
  // Throws std::runtime_error naming the file and line on anything malformed.
  static ExpertTrace read(const std::string& path);
  // One trace of every process's accesses in the order of their times (stable for equal times).
  // Throws std::runtime_error when the traces are of different models (shapes, slot sizes).
  static ExpertTrace merge(std::vector<ExpertTrace> traces);
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
  void set_streaming(bool streaming) override {
    streaming_ = streaming;
    inner_.set_streaming(streaming);
  }
  // Names the process in the trace ("decode-0", "decode").
  void set_process(const std::string& name, const std::string& kind) {
    trace_.processes = {name};
    trace_.kinds = {kind};
  }

  const ExpertTrace& trace() const { return trace_; }
  bool write(const std::string& path) const { return trace_.write(path); }

 private:
  void record(int layer, int expert);
  ExpertProvider& inner_;
  ExpertTrace trace_;
  size_t limit_;
  bool streaming_ = false;
};

// kDistance is the pool's policy as it was (every access counted alike, distances from the layer of
// the latest access). kDistanceStream: prefill's accesses (streaming) neither count as uses nor
// warm an expert: one they bring in enters at the cold end, first to go unless a decode step uses
// it. kDistanceAll: that, with distances measured from every decode process's current layer (the
// nearest one ahead of an expert's layer), as a pool that sees every process would.
// kDistanceArea: kDistanceAll with prefill's acquisitions in a streaming area of their own (an
// eighth of the slots, least recently used out first) instead of at the cold end of the whole
// pool; a decode step that finds its expert there moves it to the main part without a load.
// kStepOracle is a bound, not a policy: kDistanceAll told exactly which experts the rest of each
// running decode step will take (what a perfect router-based prediction of the next layers would
// know; not which experts the next tokens pick), each of them due when its layer comes.
enum class ReplayPolicy {
  kLru,
  kLru2,
  kLfu,
  kDistance,
  kDistanceStream,
  kDistanceAll,
  kDistanceArea,
  kStepOracle,
  kBelady
};
// The policies a replay can be asked for, in the order reports list them; Belady's bound is
// reported beside every replay.
inline constexpr ReplayPolicy kReplayPolicies[] = {
    ReplayPolicy::kLru,          ReplayPolicy::kLru2,           ReplayPolicy::kLfu,
    ReplayPolicy::kDistance,     ReplayPolicy::kDistanceStream, ReplayPolicy::kDistanceAll,
    ReplayPolicy::kDistanceArea, ReplayPolicy::kStepOracle};
const char* replay_policy_name(ReplayPolicy policy);
std::optional<ReplayPolicy> replay_policy_from(const std::string& name);

struct ReplayResult {
  uint64_t accesses = 0, hits = 0, loads = 0;
  // By process (the trace's process index): accesses and hits.
  std::vector<uint64_t> process_accesses, process_hits;
  double hit_ratio() const {
    return accesses ? static_cast<double>(hits) / static_cast<double>(accesses) : 1.0;
  }
};

// A cache of `slots` experts serving the accesses one at a time, filled on demand.
ReplayResult replay(std::span<const ExpertAccess> accesses, uint64_t slots, ReplayPolicy policy);

}  // namespace moeline::offload
