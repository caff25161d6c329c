#pragma once
// A hook into every MoE layer's routing decision, fed from the forward pass itself (no second
// pass): signatures, router-health statistics and the offload predictor are built on it. Called on
// the forward pass's thread, once per MoE layer per forward; the pointers are valid only during the
// call, so an observer copies what it keeps.

#include <cstdint>
#include <span>
#include <vector>

namespace moeline::model {

struct RoutedToken {
  uint64_t sequence_id;
  int64_t position;
};

struct RouterEvent {
  int64_t layer;
  int64_t experts;
  int64_t top_k;
  std::span<const RoutedToken> tokens;
  const float* scores;        // [tokens, experts]: softmax router probabilities
  const int32_t* chosen;      // [tokens, top_k]: expert ids, highest score first
  const float* weights;       // [tokens, top_k]: the weights applied to the chosen experts' outputs
  double router_seconds = 0;  // the router's matmul, softmax and top-k for these tokens
};

class RouterObserver {
 public:
  virtual ~RouterObserver() = default;
  virtual void on_router(const RouterEvent& event) = 0;
};

// Several observers on one engine (expert usage and signatures, say), called in the order added.
class RouterFanout : public RouterObserver {
 public:
  void add(RouterObserver* observer) { observers_.push_back(observer); }
  void on_router(const RouterEvent& event) override {
    for (RouterObserver* observer : observers_) observer->on_router(event);
  }

 private:
  std::vector<RouterObserver*> observers_;
};

}  // namespace moeline::model
