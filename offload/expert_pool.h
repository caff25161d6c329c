#pragma once
// The host tier of expert offload: one pool of expert slots per node, in POSIX shared memory,
// shared by every compute process (stages/README.md, "Expert offload").
//
// - The owner (the offload manager; `moeline run` for itself) creates the pool with a byte budget,
//   runs the loader threads that read experts from the checkpoint on disk into slots (O_DIRECT, so
//   the page cache cannot quietly act as a second, unbounded pool), and removes the pool at exit.
// - Clients (prefill and decode processes, and the owner's own engine) attach by name. They map the
//   slots read-only and the page table read-write: acquire() pins an expert (a reference count), so
//   it cannot be evicted mid-forward; release() unpins it. A client that misses reserves a slot — a
//   free one, or the unpinned resident expert whose next use is expected farthest ahead
//   (expected_reuse_distance) — and queues the load; the loader fills it.
// - prefetch() queues loads of experts a client expects to need soon (the next layers' routers
//   applied to the current hidden state), without waiting for them.
//
// Expert bytes never travel in messages: a slot holds an expert's gate, up and down matrices at
// fixed offsets, and every process builds its views over its own mapping of the slot. A caller
// that holds pins never waits for a slot (try_acquire fails instead), so callers cannot deadlock
// each other however small the budget. Counters live in the shared header, so any process (the
// manager's /metrics) reads the node's totals.

#include <array>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"
#include "offload/expert_provider.h"

namespace moeline::offload {

// Where one matrix of an expert lies in the checkpoint.
struct FileRange {
  uint32_t file = 0;  // index into ExpertCatalog::files
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// What the pool needs to know of a checkpoint's experts: their shapes and where their bytes are.
// Built by the model loader (model::Model::expert_catalog); the pool knows nothing of formats.
struct ExpertCatalog {
  struct Expert {
    ExpertWeights shape;  // dtype, rows and cols of gate, up, down (data pointers unused)
    std::array<FileRange, 3> ranges;  // gate, up, down
  };
  std::vector<std::filesystem::path> files;
  int layers = 0;
  int experts_per_layer = 0;
  // [layer * experts_per_layer + expert]; layers without experts have none (zero bytes).
  std::vector<Expert> experts;
  uint64_t model_id = 0;

  bool has(int layer, int expert) const;
  const Expert& at(int layer, int expert) const;
  uint64_t total_expert_bytes() const;
  // What a pool holding every expert takes: the experts times pool_slot_bytes (slots are sized
  // for the largest expert, so with experts of mixed sizes, as a GGUF's Q4_K_M mix has, this is
  // more than total_expert_bytes). A budget of "25%" is a share of this: a quarter of the experts.
  uint64_t pool_bytes_for_all() const;
  int moe_layers() const;
};

// The size of one pool slot: the largest expert, its matrices 64-byte aligned, in whole pages. A
// budget of B bytes holds floor(B / slot bytes) experts.
uint64_t pool_slot_bytes(const ExpertCatalog& catalog);

// The expected distance, in layer steps, to an expert's next use while layer `current` runs: until
// its layer next runs (a whole cycle of `cycle` layers for the current one), then a cycle for each
// time its layer runs without it, estimated from its `uses` in its layer's `visits`
// ((uses + 1/2) / (visits + 1)). Decode runs the layers in a cycle, so the experts of the layer
// that just ran are the last needed again, unless they are picked far more often than the rest.
// The pool evicts the largest; moeline experts replay compares it with Belady's bound.
double expected_reuse_distance(int32_t layer, int32_t current, int32_t cycle, double uses,
                               double visits);
// The estimate's chance that an expert is picked when its layer runs: (uses + 1/2) / (visits + 1).
inline double pick_probability(double uses, double visits) {
  return (uses + 0.5) / (visits + 1.0);
}
// A process whose decode steps have not acquired an expert for this long has none in flight: its
// last layer no longer pulls experts closer (the pool's policy, and its replay).
inline constexpr uint64_t kDecodeIdleNs = 100'000'000;

// "25%" of the pool that holds every expert (pool_bytes_for_all), "64MiB" / "1.5GB" / "4096"
// bytes. Throws std::invalid_argument with
// the accepted forms on anything else. Keep the forms stable: other tools pass this flag.
uint64_t parse_expert_budget(const std::string& text, uint64_t total_expert_bytes);
// The same budget as a share of the experts (a GPU's expert cache is sized by it).
double expert_budget_fraction(const std::string& text, uint64_t total_expert_bytes);

// The kind of forward pass a prefetch serves: decode steps, or prefill batches (streaming).
enum class PrefetchKind : uint8_t { kDecode = 0, kPrefill = 1 };
inline const char* prefetch_kind_name(PrefetchKind kind) {
  return kind == PrefetchKind::kDecode ? "decode" : "prefill";
}

// Node-wide counters (monotonic), kept in the pool's shared header.
struct PoolCounters {
  uint64_t hits = 0, misses = 0;  // demand acquisitions that found the expert resident / not
  uint64_t joined = 0;  // of the misses, those that found it loading for another caller's demand
  uint64_t loads = 0, evictions = 0;  // loads completed (demand and prefetch), slots reclaimed
  uint64_t bytes_loaded = 0;          // from disk into the pool
  uint64_t load_ns = 0;               // total time the loaders spent reading
  uint64_t stall_ns = 0;              // total time callers waited for a load or a slot
  uint64_t prefetch_requests = 0;     // prefetches queued (the expert was absent)
  uint64_t prefetch_loads = 0;        // of those, loaded
  uint64_t prefetch_used = 0;         // prefetched experts used before they were evicted
  uint64_t prefetch_late = 0;         // demand found its expert still queued by a prefetch
  uint64_t prefetch_dropped = 0;      // prefetches not queued: no slot could be freed
  uint64_t direct_io = 0;             // 1 when the loaders read with O_DIRECT
  uint64_t clients_reclaimed = 0;     // dead clients whose pins the owner took back
  // The prefetch counters again by the kind of forward pass that asked (PrefetchKind): whether
  // prefetch pays for that kind, which the offload manager switches it off for when it does not.
  struct PrefetchCounts {
    uint64_t requests = 0;  // queued
    uint64_t used = 0;      // used before evicted
    uint64_t late = 0;      // demand found it still loading
    uint64_t wasted = 0;    // evicted unused
  };
  std::array<PrefetchCounts, 2> prefetch_by_kind{};
  std::array<uint32_t, 2> prefetch_off{};  // 1: prefetch switched off for that kind
  // Load time histogram: bucket i counts loads that took < 2^i microseconds (last: the rest).
  static constexpr int kLoadBuckets = 24;
  std::array<uint64_t, kLoadBuckets> load_us_buckets{};
};

// A snapshot: the counters and the pool's shape.
struct PoolStats : PoolCounters {
  uint64_t slots = 0, slot_bytes = 0, resident = 0, pinned = 0;
  std::vector<uint64_t> layer_hits, layer_misses;  // by layer

  double hit_ratio() const {
    return hits + misses == 0 ? 1.0
                              : static_cast<double>(hits) / static_cast<double>(hits + misses);
  }
  // The load time under which the given share of loads completed (upper bucket edge), in µs.
  double load_us_quantile(double q) const;
};

struct PoolLayout;  // the shared header and tables (expert_pool.cpp)

// A mapping of a pool (owner or client side).
class PoolMapping {
 public:
  ~PoolMapping();
  PoolMapping(const PoolMapping&) = delete;
  PoolMapping& operator=(const PoolMapping&) = delete;
  PoolStats stats() const;
  const std::string& name() const { return name_; }

 protected:
  PoolMapping() = default;
  std::string name_;
  int fd_ = -1;
  PoolLayout* layout_ = nullptr;  // header + tables, read-write
  size_t layout_bytes_ = 0;
  std::byte* data_ = nullptr;  // the slots
  size_t data_bytes_ = 0;
  friend class ExpertPool;
  friend class PoolClient;
};

// The owner: creates the shared segment and runs the loaders until destroyed (then unlinks it).
class ExpertPool : public PoolMapping {
 public:
  struct Options {
    std::string name;  // shared memory object name, "/moeline-pool-..." (one per node and model)
    uint64_t budget_bytes = 0;  // host pool size; at least one expert
    int loader_threads = 1;
    bool direct_io = true;  // O_DIRECT reads; falls back (counted) where the filesystem refuses
  };
  // Errors: an invalid name or a budget under one expert (invalid argument), a pool of that name
  // whose owner runs (unavailable), shared memory that cannot be created, sized or mapped, or a
  // checkpoint file that cannot be opened (I/O error, resource exhausted).
  static Expected<std::unique_ptr<ExpertPool>> create(const ExpertCatalog& catalog,
                                                      const Options& options);
  ~ExpertPool();

  uint64_t slots() const;
  // Switches prefetch off (or on again) for one kind of forward pass, for every client: their
  // prefetch hints of that kind are dropped while it is off.
  void set_prefetch_enabled(PrefetchKind kind, bool enabled);
  // Removes the pool's name once this process's clients have attached: nobody else can attach,
  // and nothing is left in /dev/shm if the process dies (moeline run's private pool).
  void make_private();

 private:
  ExpertPool() = default;
  static std::unique_ptr<ExpertPool> create_or_throw(const ExpertCatalog& catalog,
                                                     const Options& options);
  void loader_loop(int index);
  // Takes back the pins of clients whose heartbeat stopped (a process killed mid-forward).
  void reclaim_dead_clients();
  void load(uint32_t entry, int file_handle_index, std::vector<std::byte>& bounce);

  ExpertCatalog catalog_;
  Options options_;
  std::vector<int> files_;  // open descriptors, by catalog file
  std::vector<std::thread> loaders_;
  std::atomic<bool> stopping_{false};
  bool unlinked_ = false;
};

// A compute process's view of the pool: an ExpertProvider.
class PoolClient final : public PoolMapping, public ExpertProvider {
 public:
  // Errors: no such pool yet, or not ready (unavailable: ask again), another model or shape
  // (invalid argument), a truncated segment (corruption), 64 clients attached already (resource
  // exhausted).
  static Expected<std::unique_ptr<PoolClient>> attach(const std::string& name,
                                                      const ExpertCatalog& catalog);
  // Detaches: the pins it still holds are released.
  ~PoolClient() override;

  int layers() const override { return catalog_.layers; }
  int experts_per_layer() const override { return catalog_.experts_per_layer; }
  ExpertWeights acquire(int layer, int expert) override;
  std::optional<ExpertWeights> try_acquire(int layer, int expert) override;
  void release(int layer, int expert) override;
  void expect(int layer, std::span<const int32_t> experts) override;
  void prefetch(int layer, std::span<const int32_t> experts) override;
  int prefetch_depth() const override { return prefetch_depth_; }
  // A prefill batch's acquisitions are not counted in the usage estimates, and what they bring in
  // is evicted first until a decode step uses it.
  void set_streaming(bool streaming) override { streaming_ = streaming; }
  std::span<const std::byte> served_from() const override { return {data_, data_bytes_}; }
  // False once the process that created the pool has exited (its loaders are gone with it).
  bool owner_alive() const;
  // MoE layers ahead to prefetch (default 1; 0 turns prefetch off).
  void set_prefetch_depth(int depth) { prefetch_depth_ = depth; }

 private:
  PoolClient() = default;
  static std::unique_ptr<PoolClient> attach_or_throw(const std::string& name,
                                                     const ExpertCatalog& catalog);
  std::optional<ExpertWeights> acquire_or_fail(int layer, int expert, bool may_wait);
  ExpertWeights views(uint32_t entry, int32_t slot) const;
  // Whether its row of the client table is still its own (under the pool's lock).
  bool owns_row() const;

  ExpertCatalog catalog_;
  std::vector<std::array<size_t, 3>> offsets_;  // of gate, up, down inside a slot, by entry
  int prefetch_depth_ = 1;
  int32_t current_layer_ = -1;  // the layer this client acquired last (under the pool's lock)
  int64_t pins_held_ = 0;       // pins this client holds now (under the pool's lock)
  int32_t client_ = -1;         // its row of the pool's client table
  uint64_t generation_ = 0;     // the row's generation when this client took it
  std::atomic<bool> detaching_{false};
  std::atomic<bool> streaming_{false};
  std::thread heartbeat_;
};

}  // namespace moeline::offload
