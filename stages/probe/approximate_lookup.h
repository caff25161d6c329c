#pragma once
// The probe's approximate lookup: a lookup signature (stages/probe/signature_engine.h), the nearest
// cached prompts of the namespace in the FAISS index, the donor closest in tokens among those over
// the threshold, and what the decision rule makes of it (serve its answer, blend its KV,
// shadow-check it, or refuse it). It also keeps what the lookups learn from: prefill's signature
// records (indexed), the shadow checks' outcomes (the rule's evidence), and the first-token
// distributions of response shadows.

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/kv_cache.h"
#include "model/model.h"
#include "reuse/approximate.h"
#include "reuse/records.h"
#include "reuse/signature.h"
#include "reuse/similarity_index.h"
#include "reuse/snapshot_store.h"
#include "stages/probe/probe_metrics.h"
#include "stages/probe/signature_engine.h"
#include "stages/runtime/config.h"
#include "stages/runtime/log.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages {

// What approximate reuse made of a lookup (ProbePlan.outcome and the fields that go with it).
struct ApproximateResult {
  // NotAsked, or Response, Blend, Shadow, NoCandidate, Rejected.
  wire::ApproximateOutcome outcome = wire::ApproximateOutcome::NotAsked;
  wire::ShadowMode shadow_mode = wire::ShadowMode::None;  // for a shadow: what it compares
  bool sampled = false;  // a shadow of a hit the rule would have served
  uint64_t donor = 0;
  float similarity = 0;
  int cell = 0;
  reuse::ResultRecord donor_result;  // response (served, or to compare with)
  std::vector<uint8_t> kv;           // blend: the prompt's blocks with the donor's KV
  std::vector<uint8_t> mask;         // blend: 1 where the KV is the donor's
};

class ApproximateLookup {
 public:
  // Loads the tokenizer, builds the signature engine and the index, opens the signature store
  // beside `store_options`' disk tier and rebuilds the index from it. Throws ConfigError for a
  // bad --approximate-* setting.
  ApproximateLookup(const runtime::Config& config, const model::Model& model,
                    reuse::SnapshotStore& store, const reuse::StoreOptions& store_options,
                    ProbeMetrics& metrics, runtime::Registry& registry, runtime::Logger& log);

  // The nearest cached prompt of the namespace that has what a mode needs, and what the decision
  // rule makes of it. `from`: the exact prefix hit's length (pooled signatures leave it out);
  // `prefix_blocks`: its blocks (imported rather than recomputed when their sums are known).
  ApproximateResult lookup(const std::vector<int32_t>& tokens, const std::string& name_space,
                           uint64_t key, const model::SamplingParams& sampling, uint32_t allowed,
                           int64_t from, const std::vector<uint64_t>& chain,
                           const std::vector<reuse::Value>& prefix_blocks);

  // What the store intake hands over: a signature record, a shadow check's outcome, a prompt
  // record (compared with its donor's when its prompt was a response shadow).
  void put_signature(const std::string& bytes);
  void record_quality(uint64_t donor, const std::string& bytes);
  void compare_first_tokens(uint64_t prompt_entry, const std::string& bytes);
  // A response shadow of `prompt_key` from `donor`: its prompt record will be compared.
  void expect_first_tokens(uint64_t prompt_key, uint64_t donor);

  double recompute_fraction() const { return recompute_fraction_; }
  const reuse::SnapshotStore& signatures() const { return *signatures_; }
  void flush() { signatures_->flush(); }
  void update_gauges();

 private:
  enum class Metric { kCosine, kEuclidean, kJaccard };
  struct Donor {
    reuse::SimilarityIndex::Hit hit;  // score: the similarity in the configured metric
    reuse::SignatureRecord record;
    double changed = 1;  // changed_fraction against the lookup's prompt
  };

  size_t rebuild_index();
  void reconcile_index();
  uint64_t donor_key(const reuse::SignatureRecord& record) const;
  bool index_signature(const reuse::SignatureRecord& record);
  float similarity(const LookupSignatures& lookup, const reuse::SignatureRecord& donor) const;
  std::string token_text(int32_t token);
  std::optional<Donor> nearest_donor(const std::vector<int32_t>& tokens,
                                     const std::string& name_space, uint64_t key,
                                     const LookupSignatures& lookup);
  void blend_kv(const std::vector<int32_t>& tokens, int64_t from,
                const reuse::SignatureRecord& donor, uint64_t donor_key, std::vector<uint8_t>& kv,
                std::vector<uint8_t>& mask);

  const model::Model& model_;
  reuse::SnapshotStore& store_;
  ProbeMetrics& metrics_;
  runtime::Logger& log_;
  size_t block_bytes_;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  std::unordered_map<int32_t, std::string> token_texts_;
  double recompute_fraction_ = 0.15;
  Metric metric_ = Metric::kCosine;
  std::unique_ptr<SignatureEngine> signatures_engine_;
  std::unique_ptr<reuse::SimilarityIndex> index_;
  std::unique_ptr<reuse::SnapshotStore> signatures_;
  std::unique_ptr<reuse::DecisionRule> rule_;
  std::set<std::string> namespaces_;
  runtime::RateLimited refusal_log_;
  std::unordered_map<uint64_t, uint64_t> pending_kl_;  // shadowed prompt's entry -> donor
  uint64_t signature_puts_ = 0;
};

}  // namespace moeline::stages
