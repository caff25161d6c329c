#pragma once
// The forward pass on one CUDA device: the Engine's semantics (model/forward.h) with every op on
// the GPU — cuBLAS for the projections and experts, the kernels of kernels/cuda for the rest —
// over a paged KV cache in device memory with the CPU cache's block layout (Sequence and
// BlockPool are shared with the CPU engine).
//
// Expert weights live in a device expert cache of `expert_budget_fraction` of all expert bytes.
// At 1 every expert is uploaded once, and decode steps run their experts on the device without a
// host round trip, replayed as CUDA graphs. Below 1, the host drives each MoE layer: experts are
// copied on demand — from the node's shared host pool (registered with the device) or a pinned
// copy of this engine's own — on a dedicated copy stream, one CUDA event per slot saying when its
// bytes have arrived and another when the compute stream is done with it, so copies overlap the
// experts computed before them and a slot is never overwritten while in use. Slots are given up
// by the host pool's policy (offload::SlotPolicy: expected reuse distance over the cycle of
// layers); the next MoE layer's router, applied to the current hidden state, picks experts to copy
// ahead; and a miss may be computed on the CPU instead, where its weights are, when the
// measured costs (copy time against CPU time plus the rows' round trip) say that is cheaper.
//
// Every family the CPU engine runs, DeepSeek's multi-head latent attention included (the same
// absorbed form over a latent cache). Built only with CUDA (MOELINE_HAVE_CUDA).

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "offload/expert_provider.h"

namespace moeline::model {

struct CudaEngineOptions {
  int device = 0;  // the CUDA device ordinal this engine runs on
  int32_t kv_blocks = 1024;
  double expert_budget_fraction = 1.0;  // of all expert bytes, in (0, 1]
  // Below a budget of 1, where missing experts come from: the node's shared host pool (an
  // offload::PoolClient; its mapping is registered with the device once it has one — a stage's
  // provider names the node's pool only after the offload manager's plan — and each copy holds a
  // pin on the host slot until it has arrived), or, when null, a pinned copy of every expert that
  // this engine makes for itself.
  offload::ExpertProvider* host_experts = nullptr;
  // Below a budget of 1: after routing a MoE layer, the next MoE layer's router is applied to the
  // current hidden state and the experts it picks start copying while this layer computes.
  bool prefetch = true;
  // Replay decode steps (one token per sequence, every expert resident) as CUDA graphs: one per
  // batch size, captured on its second step and replayed while the buffers it captured stay.
  bool decode_graphs = true;
  // Below a budget of 1: the CPU threads that may compute a missing expert where its weights are
  // (host memory) instead of copying it to the device, when the measured costs say that is
  // cheaper (null: always copy).
  kernels::ThreadPool* cpu_threads = nullptr;
  // How the two costs compare: the CPU is chosen when its cost is under the copy's times this
  // (above 1 favours the CPU; the tests use a huge value to take that path every time).
  double cpu_preference = 1.0;
};

struct CudaExpertStats {
  uint64_t hits = 0, misses = 0;
  uint64_t prefetched = 0, prefetch_used = 0;
  uint64_t computed_on_cpu = 0;  // misses computed on the host instead of copied
  uint64_t bytes_loaded = 0;
  std::vector<float> load_ms;  // each load's copy time (CUDA events)
};

class CudaEngine : public ForwardPass {
 public:
  static Expected<std::unique_ptr<CudaEngine>> create(const Model& model,
                                                      const CudaEngineOptions& options);
  ~CudaEngine() override;

  // As Engine::forward: logits [sequences wanting logits, vocab] on the host.
  Status forward(std::span<const SequenceInput> batch, std::vector<float>& logits) override;
  BlockPool& pool();
  BlockPool& blocks() override { return pool(); }
  const Model& model() const override;
  // The observer sees what the CPU engine's sees, copied back from the device once the forward
  // is done (router_seconds is 0: the router is not timed on the device). Decode graphs capture
  // the copies too.
  void set_router_observer(RouterObserver* observer) override;
  size_t kv_block_bytes() const override;
  Status export_kv(std::span<const int32_t> blocks, uint8_t* out) override;
  Status import_kv(std::span<const int32_t> blocks, const uint8_t* in) override;
  CudaExpertStats expert_stats() const;
  // The load times recorded since the last call, handed over and forgotten (a long-running stage
  // takes them into its histogram rather than letting them accumulate).
  std::vector<float> take_load_ms();
  // Decode steps replayed from a CUDA graph so far.
  uint64_t graph_replays() const;
  // Nodes (kernels and copies) of the decode graph captured for `batch` sequences; 0: none yet.
  size_t graph_nodes(int64_t batch) const;
  int expert_slots() const;
  // Bytes of device memory holding weights (experts included) and KV.
  size_t device_weight_bytes() const;

  struct State;

 private:
  explicit CudaEngine(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moeline::model
