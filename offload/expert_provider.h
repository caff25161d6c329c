#pragma once
// The only way compute reaches expert weights. acquire() pins an expert until the matching
// release(): a provider must not move or evict a pinned expert, so a forward pass can use the views
// it got for as long as it holds them. Implementations are thread-safe.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "base/status.h"
#include "kernels/cpu/dtype.h"

namespace moeline::offload {

// One SwiGLU expert: down(silu(gate(x)) * up(x)).
struct ExpertWeights {
  kernels::MatrixView gate;  // [intermediate, hidden]
  kernels::MatrixView up;    // [intermediate, hidden]
  kernels::MatrixView down;  // [hidden, intermediate]

  size_t bytes() const { return gate.bytes() + up.bytes() + down.bytes(); }
};

class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  virtual int layers() const = 0;
  virtual int experts_per_layer() const = 0;
  // Waits as long as it takes (a load, a slot to free). Call it only while holding no pins.
  // Throws StatusError, the one exception of the provider's hot path, which the forward pass
  // returns as its Status: kUnavailable when the pool cannot serve now (shutting down, its owner
  // gone, this process's pins taken back), kIoError when the expert could not be read, kInternal
  // for an expert that does not exist (a caller's bug).
  virtual ExpertWeights acquire(int layer, int expert) = 0;
  // Like acquire, but returns nothing rather than wait for another caller's pins to be released:
  // what a caller that already holds pins uses, so that callers never wait on each other.
  virtual std::optional<ExpertWeights> try_acquire(int layer, int expert) {
    return acquire(layer, expert);
  }
  virtual void release(int layer, int expert) = 0;
  // What a forward pass will acquire of the layer it runs now (its tokens routed): a cache keeps
  // them until they are acquired, rather than evict one for another of the same layer. Replaces
  // the previous call's list. Never waits.
  virtual void expect(int /*layer*/, std::span<const int32_t> /*experts*/) {}
  // A hint: these experts of `layer` will probably be acquired soon. Never waits.
  virtual void prefetch(int /*layer*/, std::span<const int32_t> /*experts*/) {}
  // How many MoE layers ahead the forward pass should predict and prefetch (0: never; the
  // prediction costs a router matmul per layer, wasted when everything is resident).
  virtual int prefetch_depth() const { return 0; }
  // A hint for the forward passes that follow: true while they run a prefill batch, whose
  // acquisitions sweep most experts of every layer once (streaming) rather than come back layer
  // after layer as decode steps do. A cache may keep them from displacing decode's working set.
  virtual void set_streaming(bool /*streaming*/) {}
  // The memory every expert this provider hands out lies in, when it is one fixed mapping (a
  // shared pool's slots): what a GPU registers once, so copies from it run at pinned speed.
  virtual std::span<const std::byte> served_from() const { return {}; }
};

}  // namespace moeline::offload
