#pragma once
// The forward pass on one CUDA device: the Engine's semantics (model/forward.h) with every op on
// the GPU — cuBLAS for the projections and experts, the kernels of kernels/cuda for the rest —
// over a paged KV cache in device memory with the CPU cache's block layout (Sequence and
// BlockPool are shared with the CPU engine).
//
// Expert weights live in a device expert cache of `expert_budget_fraction` of all expert bytes:
// at 1 every expert is uploaded once; below, experts are copied on demand from a pinned host copy
// on a dedicated copy stream, one CUDA event per slot saying when its bytes have arrived and
// another when the compute stream is done with it, so copies overlap the experts computed before
// them and a slot is never overwritten while in use.
//
// Every family the CPU engine runs, DeepSeek's multi-head latent attention included (the same
// absorbed form over a latent cache). Built only with CUDA (MOELINE_HAVE_CUDA).

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/status.h"
#include "offload/expert_provider.h"

namespace moeline::model {

struct CudaEngineOptions {
  int32_t kv_blocks = 1024;
  double expert_budget_fraction = 1.0;  // of all expert bytes, in (0, 1]
  // Below a budget of 1, where missing experts come from: the node's shared host pool (an
  // offload::PoolClient; its mapping is registered with the device once, and each copy holds a pin
  // on the host slot until it has arrived), or, when null, a pinned copy of every expert that this
  // engine makes for itself.
  offload::ExpertProvider* host_experts = nullptr;
  // Below a budget of 1: after routing a MoE layer, the next MoE layer's router is applied to the
  // current hidden state and the experts it picks start copying while this layer computes.
  bool prefetch = true;
  // Replay decode steps (one token per sequence, every expert resident) as CUDA graphs: one per
  // batch size, captured on its second step and replayed while the buffers it captured stay.
  bool decode_graphs = true;
};

struct CudaExpertStats {
  uint64_t hits = 0, misses = 0;
  uint64_t prefetched = 0, prefetch_used = 0;
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
  CudaExpertStats expert_stats() const;
  // Decode steps replayed from a CUDA graph so far.
  uint64_t graph_replays() const;
  int expert_slots() const;
  // Bytes of device memory holding weights (experts included) and KV.
  size_t device_weight_bytes() const;

  struct State;

 private:
  explicit CudaEngine(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moeline::model
