#pragma once
// The only way compute reaches expert weights. acquire() pins an expert until the matching
// release(): a provider must not move or evict a pinned expert, so a forward pass can use the views
// it got for as long as it holds them. Implementations are thread-safe.

#include <cstdint>

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
  virtual ExpertWeights acquire(int layer, int expert) = 0;
  virtual void release(int layer, int expert) = 0;
};

}  // namespace moeline::offload
