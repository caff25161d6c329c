#pragma once
// Which expert each slot of a fixed-size expert cache holds, and which to give up for another: the
// host pool's policy (expected_reuse_distance over the cycle of layers, ties to the least recently
// used; a prefetch never evicts an unused prefetch nor an expert expected no later than the one it
// brings in) for a cache whose caller moves the bytes itself — the GPU's expert cache
// (model/cuda_engine). Plain bookkeeping, no memory of its own: testable without a device, and
// replayable against `replay(..., ReplayPolicy::kDistance)`. Not thread-safe.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace moeline::offload {

class SlotPolicy {
 public:
  // `slots` slots for the experts of `layers` layers (the cycle decode runs through) of
  // `experts_per_layer` each; an expert's key is layer * experts_per_layer + expert.
  SlotPolicy(int slots, int layers, int experts_per_layer);

  int slots() const { return static_cast<int>(owner_.size()); }
  // Layer `layer` runs (one visit: an expert it uses counts once towards how often it is picked).
  void visit(int layer);
  // The slot holding `key`, or -1.
  int slot_of(int64_t key) const { return slot_of_[static_cast<size_t>(key)]; }
  // The key in `slot`, or -1.
  int64_t owner(int slot) const { return owner_[static_cast<size_t>(slot)]; }
  bool prefetched(int slot) const { return prefetched_[static_cast<size_t>(slot)] != 0; }

  // The running layer uses `key` (resident or not: the estimate counts it either way); a resident
  // one becomes the most recently used. True when it was resident as a prefetch not used before.
  bool use(int64_t key);
  // The slot to fill with `key`: a free one, else the resident expert whose next use is expected
  // farthest ahead (ties: least recently used), never one holding a key in `keep`. With
  // `prefetch`, also never a prefetch not used yet, nor an expert expected no later than `key`.
  // -1 when none may go.
  int victim(int64_t key, std::span<const int64_t> keep, bool prefetch = false) const;
  // `slot` now holds `key`, its previous expert gone; a prefetch until first used.
  void assign(int slot, int64_t key, bool prefetch = false);
  // Expected layer steps until `key` is next used, while the current layer runs.
  double distance(int64_t key) const;

 private:
  int layers_, experts_per_layer_;
  int current_ = -1;
  uint64_t clock_ = 0;
  std::vector<int64_t> owner_;                // by slot
  std::vector<uint64_t> last_use_;            // by slot
  std::vector<uint8_t> prefetched_;           // by slot
  std::vector<int> slot_of_;                  // by key
  std::vector<double> visits_;                // by layer
  std::vector<double> uses_, counted_visit_;  // by key
};

}  // namespace moeline::offload
