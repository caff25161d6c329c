#pragma once
// Activation signatures for approximate reuse (stages/README.md, "Exact reuse"): for the first k
// MoE layers, the router score vectors averaged over a prompt's tokens — only the tokens not
// already covered by an exact prefix hit, so that a shared template does not dominate —
// concatenated, L2-normalised, and projected to a fixed dimension when the concatenation is larger
// (a seeded sparse random projection, the same for every process, renormalised).
//
// SignatureAccumulator is a RouterObserver: attached to an engine, it pools the router scores of
// the sequences it watches as the forward pass produces them (no second pass). Also here: the
// three similarity metrics the issue names — cosine (the default), Euclidean distance, and
// Jaccard over the top-k expert sets.
//
// Not thread-safe: one per engine (the forward pass's thread).

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <unordered_map>
#include <vector>

#include "model/router_observer.h"

namespace moeline::reuse {

struct SignatureOptions {
  int layers = 2;       // the first k MoE layers
  int dimension = 256;  // projected to this when the concatenation is larger
  uint64_t projection_seed = 0x6d6f656c696e65ULL;
};

// Router scores pooled over some tokens, for the first k MoE layers: per layer, the score sums, the
// token count and the experts chosen. Sums over disjoint tokens add up.
struct RouterSums {
  std::vector<double> sums;     // [k layers][experts]
  std::vector<int64_t> tokens;  // per pooled layer
  std::vector<std::set<int32_t>> chosen;
  void add(const RouterSums& other);
};

class SignatureAccumulator : public model::RouterObserver {
 public:
  // `moe_layers`: the model's MoE layer indices in order (dense layers have no router).
  SignatureAccumulator(std::vector<int64_t> moe_layers, int64_t experts, SignatureOptions options);

  // Pools the sequence's tokens at positions >= from_position (the part no prefix hit covers);
  // `per_block` also keeps the sums of each KV block (block_sums).
  void watch(uint64_t sequence_id, int64_t from_position, bool per_block = false);
  // Adds sums pooled elsewhere — a cached prefix's blocks, not recomputed — to the sequence's pool.
  void add(uint64_t sequence_id, const RouterSums& sums);
  // Per KV block index, the sums of the block's pooled tokens (watch with per_block).
  std::map<int64_t, RouterSums> block_sums(uint64_t sequence_id) const;
  void forget(uint64_t sequence_id);
  void on_router(const model::RouterEvent& event) override;

  // The sequence's signature: unit length, options.dimension (or the concatenation's size when
  // that is smaller). Empty when no pooled token has been seen.
  std::vector<float> signature(uint64_t sequence_id) const;
  // Per pooled layer, the set of experts chosen for any pooled token (for Jaccard).
  std::vector<std::set<int32_t>> expert_sets(uint64_t sequence_id) const;

 private:
  struct Pool {
    int64_t from_position = 0;
    bool per_block = false;
    RouterSums total;
    std::map<int64_t, RouterSums> blocks;
  };
  RouterSums empty_sums() const;
  std::unordered_map<int64_t, int> slot_of_layer_;
  int64_t experts_;
  SignatureOptions options_;
  std::unordered_map<uint64_t, Pool> pools_;
};

// L2-normalises in place; false (vector untouched) when it is all zeros.
bool normalize(std::vector<float>& vector);
// A seeded sparse random projection (entries +-1 with probability 1/6 each, else 0: Achlioptas'
// construction), the same in every process; the result is renormalised.
std::vector<float> project(std::span<const float> vector, int dimension, uint64_t seed);

float cosine(std::span<const float> a, std::span<const float> b);
float euclidean(std::span<const float> a, std::span<const float> b);
// Mean over layers of |A ∩ B| / |A ∪ B| (1 when both are empty).
float jaccard(const std::vector<std::set<int32_t>>& a, const std::vector<std::set<int32_t>>& b);

}  // namespace moeline::reuse
