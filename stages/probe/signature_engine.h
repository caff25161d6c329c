#pragma once
// Lookup signatures: a partial forward of a prompt through the first MoE layers (its own small
// KV cache and thread pool), whose router scores are pooled into the signatures the similarity
// index is searched with. Remembers the router sums of full blocks it computed (and those prefill
// sends with its signature records), so that a later lookup over the same prefix imports the
// prefix's KV and sums instead of recomputing them.

#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/router_observer.h"
#include "offload/resident_provider.h"
#include "reuse/signature.h"
#include "reuse/snapshot_store.h"
#include "stages/probe/probe_metrics.h"
#include "stages/runtime/config.h"

namespace moeline::stages {

// Two signatures of a prompt from one partial forward: pooled over positions past the exact
// prefix hit (so that a shared template does not dominate) and over the whole prompt. Stored
// signatures were pooled past whatever prefix hit their own prefill had — none for a prompt
// computed cold — so a lookup asks with both.
struct LookupSignatures {
  std::vector<float> past_prefix, whole;
  std::vector<std::set<int32_t>> past_prefix_sets, whole_sets;
};

class SignatureEngine {
 public:
  // --signature-*, --threads; the cache holds --signature-max-tokens (capped at the context).
  SignatureEngine(const runtime::Config& config, const model::Model& model, ProbeMetrics& metrics);

  // The signatures of `tokens` pooled from `from` on and whole (empty past the token limit).
  // `chain`: the prompt's block keys; `prefix_blocks`: the exact prefix's cached blocks.
  LookupSignatures compute(const std::vector<int32_t>& tokens, int64_t from,
                           const std::vector<uint64_t>& chain,
                           const std::vector<reuse::Value>& prefix_blocks);
  // Router sums of a full block by its key (bounded, oldest first out: a lost entry only means
  // recomputing that prefix once more).
  void remember_block_sums(uint64_t block_key, const reuse::RouterSums& sums);

  int dimension() const { return signature_dimension_; }
  int layers() const { return signature_options_.layers; }
  size_t block_sums_width() const { return block_sums_width_; }

 private:
  const model::Model& model_;
  ProbeMetrics& metrics_;
  reuse::SignatureOptions signature_options_;
  int64_t signature_layers_ = 0, max_signature_tokens_ = 0;
  int signature_dimension_ = 0;
  std::unique_ptr<kernels::ThreadPool> pool_;
  std::unique_ptr<offload::ResidentExpertProvider> experts_;
  std::unique_ptr<model::KvCache> cache_;
  std::unique_ptr<model::Engine> engine_;
  std::unique_ptr<reuse::SignatureAccumulator> accumulator_, whole_accumulator_;
  model::RouterFanout observers_;
  uint64_t next_sequence_id_ = 1;
  std::unordered_map<uint64_t, reuse::RouterSums> block_sums_;
  std::deque<uint64_t> block_sums_order_;
  size_t block_sums_width_ = 1;  // values per block's sums: signature layers x experts
};

}  // namespace moeline::stages
