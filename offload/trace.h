#pragma once
// Expert access traces, and replaying them offline against a cache policy and a budget next to the
// optimal bound (Belady's MIN: evict the expert whose next use is farthest away), so a policy's
// hit ratio can be judged against what any policy could have reached on the same accesses.
//
// A trace is the sequence of (layer, expert) acquisitions a process's forward passes made, recorded
// by wrapping the engine's ExpertProvider (`moeline run` and the compute stages, --expert-trace).
// File (v3): a header line "# moeline expert trace v3 layers=L experts=E slot_bytes=B
// expert_bytes=T process=NAME kind=KIND", then "layer expert t_ns streaming hint" per line: when it
// was acquired or predicted (CLOCK_MONOTONIC, so the traces of the processes of one host merge into
// the order the shared pool saw), whether a prefill batch (1) or a decode step (0) did it, and
// whether the line is an acquisition (0) or a prediction (1: the prefetch hints the engine
// computes, a later layer's router applied to the current hidden state). v2 files (no hint column)
// and v1 files (no process, "layer expert" lines) are still read.
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

// A prediction that `expert` of `layer` will be acquired: what ExpertProvider::prefetch was told.
struct ExpertHint {
  int32_t layer = 0, expert = 0;
  uint64_t t_ns = 0;
  uint16_t process = 0;
  bool streaming = false;  // made by a prefill batch
  bool operator==(const ExpertHint&) const = default;
};

struct ExpertTrace {
  int layers = 0, experts_per_layer = 0;
  uint64_t slot_bytes = 0;    // one pool slot (an expert with alignment): budget / slot_bytes slots
  uint64_t expert_bytes = 0;  // a pool of every expert: what a budget of "25%" is a share of
  // The processes the accesses came from ("decode-0"), with their kinds ("prefill", "decode",
  // "run"); one for a trace read from a file, more once merged.
  std::vector<std::string> processes = {"run"}, kinds = {"run"};
  std::vector<ExpertAccess> accesses;
  std::vector<ExpertHint> hints;  // in the order of their times

  // Writes a one-process trace (a merged one is written per process: not here).
  bool write(const std::string& path) const;
  // Throws std::runtime_error naming the file and line on anything malformed.
  static ExpertTrace read(const std::string& path);
  // One trace of every process's accesses in the order of their times (stable for equal times).
  // Throws std::runtime_error when the traces are of different models (shapes, slot sizes).
  static ExpertTrace merge(std::vector<ExpertTrace> traces);
};

// Passes every call through to `inner` and records each acquisition and each prediction it is
// told (prefetch), the first `limit` of them together.
class TraceRecorder final : public ExpertProvider {
 public:
  TraceRecorder(ExpertProvider& inner, const ExpertCatalog& catalog,
                size_t limit = static_cast<size_t>(-1));
  int layers() const override { return inner_.layers(); }
  int experts_per_layer() const override { return inner_.experts_per_layer(); }
  ExpertWeights acquire(int layer, int expert) override;
  std::optional<ExpertWeights> try_acquire(int layer, int expert) override;
  void release(int layer, int expert) override { inner_.release(layer, expert); }
  void expect(int layer, std::span<const int32_t> experts) override {
    inner_.expect(layer, experts);
  }
  void prefetch(int layer, std::span<const int32_t> experts) override;
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
  bool full() const { return trace_.accesses.size() + trace_.hints.size() >= limit_; }
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
// kDistanceLayer: kDistanceAll told which experts each process has still to take of the layer it
// runs (the engine has routed that layer's tokens and tells the pool, ExpertProvider::expect):
// those go last. Without it the experts of the layer running look the farthest from their next use
// (a whole cycle away) and are evicted between two acquisitions of the same layer.
// kDistanceHinted: kDistanceLayer given the trace's hints: an expert a decoding process predicted
// for a layer it has still to run in this step counts as used there with the probability its
// predictions at that many layers ahead have turned out right so far (and one it did not predict
// for a predicted layer with the share of such experts used); the expected distance is then
// "when its layer comes" with that probability, else the estimate's cycles after it.
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
  kDistanceLayer,
  kDistanceHinted,
  kStepOracle,
  kBelady
};
// The policies a replay can be asked for, in the order reports list them; Belady's bound is
// reported beside every replay.
inline constexpr ReplayPolicy kReplayPolicies[] = {
    ReplayPolicy::kLru,          ReplayPolicy::kLru2,           ReplayPolicy::kLfu,
    ReplayPolicy::kDistance,     ReplayPolicy::kDistanceStream, ReplayPolicy::kDistanceAll,
    ReplayPolicy::kDistanceArea, ReplayPolicy::kDistanceLayer,  ReplayPolicy::kDistanceHinted,
    ReplayPolicy::kStepOracle};
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

// The trace with each visit of a process to a layer (a run of its accesses to one layer) given a
// random relabelling of that layer's experts, drawn anew for every visit (seeded): what each visit
// takes, how many experts and how often each, stays; which experts a visit shares with another
// is left to chance. Belady's bound on such a trace, against a policy's hit ratio on it, is what
// knowing the future picks of routers with nothing to learn is worth — the part of the gap no
// online policy can close. The hints are dropped (they would name the old labels).
ExpertTrace relabel_visits(const ExpertTrace& trace, uint64_t seed);

// A cache of `slots` experts serving the accesses one at a time, filled on demand. `hints` (in the
// order of their times) are what kDistanceHinted knows; the other policies ignore them.
ReplayResult replay(std::span<const ExpertAccess> accesses, uint64_t slots, ReplayPolicy policy,
                    std::span<const ExpertHint> hints = {});

}  // namespace moeline::offload
