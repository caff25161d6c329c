#include "offload/slot_policy.h"

#include <algorithm>
#include <stdexcept>

#include "offload/expert_pool.h"

namespace moeline::offload {

SlotPolicy::SlotPolicy(int slots, int layers, int experts_per_layer)
    : layers_(std::max(layers, 1)),
      experts_per_layer_(std::max(experts_per_layer, 1)),
      owner_(static_cast<size_t>(std::max(slots, 0)), -1),
      last_use_(owner_.size(), 0),
      prefetched_(owner_.size(), 0),
      slot_of_(static_cast<size_t>(layers_) * static_cast<size_t>(experts_per_layer_), -1),
      visits_(static_cast<size_t>(layers_), 0.0),
      uses_(slot_of_.size(), 0.0),
      counted_visit_(slot_of_.size(), 0.0) {}

void SlotPolicy::visit(int layer) {
  if (layer < 0 || layer >= layers_) throw std::out_of_range("SlotPolicy: layer out of range");
  current_ = layer;
  visits_[static_cast<size_t>(layer)] += 1;
}

double SlotPolicy::distance(int64_t key) const {
  const auto layer = static_cast<int32_t>(key / experts_per_layer_);
  return expected_reuse_distance(layer, current_, layers_, uses_[static_cast<size_t>(key)],
                                 visits_[static_cast<size_t>(layer)]);
}

bool SlotPolicy::use(int64_t key) {
  const auto k = static_cast<size_t>(key);
  const double visit = visits_[static_cast<size_t>(key / experts_per_layer_)];
  if (counted_visit_[k] != visit) {
    counted_visit_[k] = visit;
    uses_[k] += 1;
  }
  const int slot = slot_of_[k];
  if (slot < 0) return false;
  const auto s = static_cast<size_t>(slot);
  last_use_[s] = ++clock_;
  const bool unused_prefetch = prefetched_[s] != 0;
  prefetched_[s] = 0;
  return unused_prefetch;
}

int SlotPolicy::victim(int64_t key, std::span<const int64_t> keep, bool prefetch) const {
  const double incoming = prefetch ? distance(key) : 0.0;
  int chosen = -1;
  double chosen_distance = 0;
  for (int slot = 0; slot < slots(); ++slot) {
    const auto s = static_cast<size_t>(slot);
    if (owner_[s] < 0) return slot;
    if (std::find(keep.begin(), keep.end(), owner_[s]) != keep.end()) continue;
    if (prefetch && prefetched_[s]) continue;
    const double d = distance(owner_[s]);
    if (prefetch && d <= incoming) continue;
    if (chosen < 0 || d > chosen_distance ||
        (d == chosen_distance && last_use_[s] < last_use_[static_cast<size_t>(chosen)])) {
      chosen = slot;
      chosen_distance = d;
    }
  }
  return chosen;
}

void SlotPolicy::assign(int slot, int64_t key, bool prefetch) {
  const auto s = static_cast<size_t>(slot);
  if (owner_[s] >= 0) slot_of_[static_cast<size_t>(owner_[s])] = -1;
  if (const int previous = slot_of_[static_cast<size_t>(key)]; previous >= 0)
    owner_[static_cast<size_t>(previous)] = -1;
  owner_[s] = key;
  slot_of_[static_cast<size_t>(key)] = slot;
  prefetched_[s] = prefetch ? 1 : 0;
  last_use_[s] = ++clock_;
}

}  // namespace moeline::offload
