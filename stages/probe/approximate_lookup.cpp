#include "stages/probe/approximate_lookup.h"

#include <algorithm>

#include "model/generator.h"
#include "model/model_text.h"
#include "model/sampling.h"
#include "reuse/blend.h"
#include "stages/common/common.h"
#include "stages/probe/stored_kv.h"

namespace moeline::stages {
namespace {

// Index neighbours considered per lookup.
constexpr int kCandidates = 8;

}  // namespace

// Approximate reuse: an engine for the first layers (lookup signatures), the index with its
// signature records (a store of their own, rebuilt into the index at start), the decision rule.
ApproximateLookup::ApproximateLookup(const runtime::Config& config, const model::Model& model,
                                     reuse::SnapshotStore& store,
                                     const reuse::StoreOptions& store_options,
                                     ProbeMetrics& metrics, runtime::Registry& registry,
                                     runtime::Logger& log)
    : model_(model),
      store_(store),
      metrics_(metrics),
      log_(log),
      block_bytes_(model::KvCache::bytes_per_token(model.config()) * model::kBlockTokens) {
  auto tokenizer = model::load_model_tokenizer(model_.dir());
  if (!tokenizer) throw std::runtime_error(tokenizer.error().message);
  tokenizer_ = std::make_unique<tokenizer::Tokenizer>(std::move(*tokenizer));
  signatures_engine_ = std::make_unique<SignatureEngine>(config, model_, metrics_);

  reuse::IndexOptions index;
  index.dimension = std::max(1, signatures_engine_->dimension());
  index.m = static_cast<int>(config.integer("index-m"));
  index.ef_construction = static_cast<int>(config.integer("index-ef-construction"));
  index.ef_search = static_cast<int>(config.integer("index-ef-search"));
  index_ = std::make_unique<reuse::SimilarityIndex>(index);
  reuse::SimilarityIndex::search_on_one_thread();

  reuse::DecisionOptions decision;
  decision.threshold = static_cast<float>(config.number("approximate-threshold"));
  decision.max_error = config.number("approximate-max-error");
  decision.shadow_fraction = config.number("approximate-shadow-fraction");
  decision.bin_width = config.number("approximate-bin-width");
  try {
    rule_ = std::make_unique<reuse::DecisionRule>(decision);
  } catch (const std::invalid_argument& e) {
    throw runtime::ConfigError(e.what());
  }
  const std::string metric = config.text("approximate-metric");
  if (metric == "cosine") {
    metric_ = Metric::kCosine;
  } else if (metric == "euclidean") {
    metric_ = Metric::kEuclidean;
  } else if (metric == "jaccard") {
    metric_ = Metric::kJaccard;
  } else {
    throw runtime::ConfigError("--approximate-metric must be cosine, euclidean or jaccard, got '" +
                               metric + "'");
  }
  recompute_fraction_ = config.number("approximate-recompute-fraction");
  if (!(recompute_fraction_ >= 0 && recompute_fraction_ <= 1))
    throw runtime::ConfigError("--approximate-recompute-fraction must be in [0, 1]");

  reuse::StoreOptions options;
  options.ram_bytes = runtime::parse_bytes(config.text("signature-store-bytes"));
  options.disk_bytes = store_options.disk_bytes;
  options.disk_reserve_bytes = store_options.disk_reserve_bytes;
  options.disk_path =
      store_options.disk_path.empty() ? "" : store_options.disk_path + "/signatures";
  signatures_ = open_store(options, "signatures", registry, log_);
  log_.info("index_rebuilt", {{"entries", rebuild_index()},
                              {"dimension", index.dimension},
                              {"signature_layers", signatures_engine_->layers()}});
}

// The index from the signature store: at start, and when the index holds far more entries than
// the store (records the store evicted leave entries behind until a lookup meets them).
size_t ApproximateLookup::rebuild_index() {
  index_->clear();
  namespaces_.clear();
  size_t indexed = 0;
  for (uint64_t key : signatures_->keys()) {
    reuse::Value value = signatures_->get(key);
    auto record = value ? reuse::decode_signature(*value) : std::nullopt;
    if (record && index_signature(*record)) ++indexed;
  }
  return indexed;
}

void ApproximateLookup::reconcile_index() {
  if (++signature_puts_ % 1024 != 0) return;
  size_t indexed = 0;
  for (const std::string& name : namespaces_) indexed += index_->size(name);
  const reuse::StoreStats& stored = signatures_->stats();
  if (indexed <= 2 * (stored.ram_entries + stored.disk_entries) + 1024) return;
  const size_t live = rebuild_index();
  log_.info("index_reconciled", {{"entries_before", indexed}, {"entries", live}});
}

// A signature record from prefill: stored (keyed by the prompt it describes, which its tokens and
// namespace determine: nothing to trust about the key) and indexed.
void ApproximateLookup::put_signature(const std::string& bytes) {
  auto record = reuse::decode_signature(bytes);
  if (!record || !index_signature(*record)) {
    metrics_.refused_records->inc();
    uint64_t suppressed = 0;
    if (refusal_log_.allow(suppressed))
      log_.warn(
          "signature_refused",
          {{"reason", record ? "dimension or tokens do not fit this model" : "malformed record"},
           {"suppressed", suppressed}});
    return;
  }
  // The block sums are for lookups over this prompt's prefixes: kept in memory, not stored.
  if (!record->block_sums.empty()) {
    const uint64_t ns = model::namespace_id(record->cache_namespace);
    const std::vector<uint64_t> chain =
        reuse::block_chain(record->tokens, reuse_model_key(model_.model_id()), ns);
    for (const auto& [block, sums] : record->block_sums)
      if (block < chain.size() && sums.sums.size() == signatures_engine_->block_sums_width())
        signatures_engine_->remember_block_sums(chain[block], sums);
    record->block_sums.clear();
  }
  signatures_->put(reuse::signature_entry(donor_key(*record)), reuse::encode(*record));
  reconcile_index();
}

uint64_t ApproximateLookup::donor_key(const reuse::SignatureRecord& record) const {
  const uint64_t ns = model::namespace_id(record.cache_namespace);
  const uint64_t model_key = reuse_model_key(model_.model_id());
  const std::vector<uint64_t> chain = reuse::block_chain(record.tokens, model_key, ns);
  return reuse::prompt_key(record.tokens, chain, model_key, ns);
}

bool ApproximateLookup::index_signature(const reuse::SignatureRecord& record) {
  if (static_cast<int>(record.signature.size()) != index_->options().dimension ||
      record.tokens.empty())
    return false;
  const int64_t vocab = model_.config().vocab_size;
  for (int32_t t : record.tokens)
    if (t < 0 || t >= vocab) return false;
  index_->add(record.cache_namespace, donor_key(record), record.signature);
  namespaces_.insert(record.cache_namespace);
  return true;
}

// A response-reuse shadow check's first-token distributions: when prefill stores the shadowed
// prompt's record (its full computation's logits), against the donor's stored logits. (The
// gateway judges the check by the first tokens; this measures how far apart they were.)
void ApproximateLookup::compare_first_tokens(uint64_t prompt_entry, const std::string& bytes) {
  auto pending = pending_kl_.find(prompt_entry);
  if (pending == pending_kl_.end()) return;
  const uint64_t donor = pending->second;
  pending_kl_.erase(pending);
  const auto vocab = static_cast<size_t>(model_.config().vocab_size);
  auto full = reuse::decode_prompt(bytes, vocab, block_bytes_);
  reuse::Value stored = store_.get(reuse::prompt_entry(donor));
  auto reused = stored ? reuse::decode_prompt(*stored, vocab, block_bytes_) : std::nullopt;
  if (!full || !reused) return;
  const double kl = reuse::softmax_kl(full->logits, reused->logits);
  const bool top1 = model::argmax(full->logits.data(), static_cast<int64_t>(vocab)) ==
                    model::argmax(reused->logits.data(), static_cast<int64_t>(vocab));
  metrics_.shadow_kl->observe(kl);
  metrics_.top1[top1 ? "agreed" : "disagreed"]->inc();
}

void ApproximateLookup::expect_first_tokens(uint64_t prompt_key, uint64_t donor) {
  if (pending_kl_.size() >= 4096) pending_kl_.clear();  // bounded; a lost comparison is harmless
  pending_kl_[reuse::prompt_entry(prompt_key)] = donor;
}

void ApproximateLookup::record_quality(uint64_t donor, const std::string& bytes) {
  auto quality = reuse::decode_quality(bytes);
  if (!quality) {
    metrics_.refused_records->inc();
    return;
  }
  rule_->record(quality->cell, donor, quality->correct);
  metrics_.checks[quality->correct ? "agreed" : "disagreed"]->inc();
  const double agreed = metrics_.checks["agreed"]->value();
  metrics_.agreement->set(agreed / (agreed + metrics_.checks["disagreed"]->value()));
  double best = 1.0;
  for (const auto& [cell, counts] : rule_->cells()) best = std::min(best, rule_->error_bound(cell));
  metrics_.error_estimate->set(best);
  log_.info("shadow_check", {{"donor", donor},
                             {"cell", rule_->cell_name(quality->cell)},
                             {"correct", quality->correct},
                             {"kl", static_cast<double>(quality->kl)},
                             {"error_bound", rule_->error_bound(quality->cell)}});
}

// The similarity of a lookup to a stored prompt in the configured metric (Euclidean as
// 1 - distance / 2, so that every metric reads "higher is closer", up to 1): the better of the
// two poolings.
float ApproximateLookup::similarity(const LookupSignatures& lookup,
                                    const reuse::SignatureRecord& donor) const {
  float best = -1.0f;
  const std::pair<const std::vector<float>*, const std::vector<std::set<int32_t>>*> pools[] = {
      {&lookup.past_prefix, &lookup.past_prefix_sets}, {&lookup.whole, &lookup.whole_sets}};
  for (const auto& [vector, sets] : pools) {
    if (vector->empty() || vector->size() != donor.signature.size()) continue;
    float score = 0;
    switch (metric_) {
      case Metric::kCosine:
        score = reuse::cosine(*vector, donor.signature);
        break;
      case Metric::kEuclidean:
        score = 1.0f - reuse::euclidean(*vector, donor.signature) / 2.0f;
        break;
      case Metric::kJaccard:
        score = reuse::jaccard(*sets, donor.expert_sets);
        break;
    }
    best = std::max(best, score);
  }
  return best;
}

std::string ApproximateLookup::token_text(int32_t token) {
  auto it = token_texts_.find(token);
  if (it != token_texts_.end()) return it->second;
  auto text = tokenizer_->decode({token}, tokenizer::DecodeOptions{});
  return token_texts_[token] = text ? *text : std::string();
}

// The index's nearest few (by cosine, both poolings) are the candidates; those at or above the
// threshold in the configured metric qualify, and the one closest in tokens (smallest share
// changed) is the donor: the signature finds the neighbourhood, the tokens pick within it.
std::optional<ApproximateLookup::Donor> ApproximateLookup::nearest_donor(
    const std::vector<int32_t>& tokens, const std::string& name_space, uint64_t key,
    const LookupSignatures& lookup) {
  std::vector<reuse::SimilarityIndex::Hit> hits;
  for (const std::vector<float>* signature : {&lookup.past_prefix, &lookup.whole}) {
    if (signature->empty()) continue;
    for (const reuse::SimilarityIndex::Hit& hit :
         index_->search(name_space, *signature, kCandidates))
      if (hit.id != key) hits.push_back(hit);
  }
  std::sort(hits.begin(), hits.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  hits.erase(std::unique(hits.begin(), hits.end(),
                         [](const auto& a, const auto& b) { return a.id == b.id; }),
             hits.end());
  std::optional<Donor> best;
  for (reuse::SimilarityIndex::Hit hit : hits) {
    reuse::Value stored = signatures_->get(reuse::signature_entry(hit.id));
    auto record = stored ? reuse::decode_signature(*stored) : std::nullopt;
    if (!record) {
      index_->remove(name_space, hit.id);  // its record is gone: a tombstone from now on
      continue;
    }
    hit.score = similarity(lookup, *record);
    if (hit.score < rule_->options().threshold) continue;
    const double changed = reuse::changed_fraction(tokens, record->tokens);
    if (!best || changed < best->changed) best = Donor{hit, std::move(*record), changed};
  }
  return best;
}

ApproximateResult ApproximateLookup::lookup(const std::vector<int32_t>& tokens,
                                            const std::string& name_space, uint64_t key,
                                            const model::SamplingParams& sampling, uint32_t allowed,
                                            int64_t from, const std::vector<uint64_t>& chain,
                                            const std::vector<reuse::Value>& prefix_blocks) {
  ApproximateResult result;
  result.outcome = wire::ApproximateOutcome::NoCandidate;
  const LookupSignatures lookup = signatures_engine_->compute(tokens, from, chain, prefix_blocks);
  if (lookup.past_prefix.empty() && lookup.whole.empty()) return result;
  const std::optional<Donor> best = nearest_donor(tokens, name_space, key, lookup);
  if (!best) return result;
  const reuse::SimilarityIndex::Hit& hit = best->hit;
  const reuse::SignatureRecord& donor = best->record;
  std::optional<reuse::ResultRecord> answer;
  if (allowed & reuse::kResponse) {
    if (reuse::Value value = store_.get(reuse::result_entry(hit.id, sampling)))
      answer = reuse::decode_result(*value);
    if (answer && answer->tokens.empty()) answer.reset();
  }
  std::vector<uint8_t> kv, mask;
  if (!answer && (allowed & reuse::kBlend)) blend_kv(tokens, from, donor, hit.id, kv, mask);
  if (!answer && kv.empty()) return result;  // nothing of it that this request could use
  const char* mode = answer ? "response" : "blend";
  metrics_.candidates[mode]->inc();
  const reuse::DifferenceKind kind =
      reuse::classify_difference(tokens, donor.tokens, [this](int32_t t) { return token_text(t); });
  const reuse::Decision decision =
      rule_->decide(hit.score, kind, best->changed, hit.id,
                    answer ? reuse::ReuseMode::kResponse : reuse::ReuseMode::kBlend);
  result.donor = hit.id;
  result.similarity = hit.score;
  result.cell = decision.cell;
  if (answer) result.donor_result = std::move(*answer);
  result.kv = std::move(kv);
  result.mask = std::move(mask);
  switch (decision.action) {
    case reuse::Decision::kServe:
      result.outcome =
          answer ? wire::ApproximateOutcome::Response : wire::ApproximateOutcome::Blend;
      metrics_.served[mode]->inc();
      break;
    case reuse::Decision::kShadow:
      result.outcome = wire::ApproximateOutcome::Shadow;
      result.shadow_mode = answer ? wire::ShadowMode::Response : wire::ShadowMode::Blend;
      result.sampled = std::string_view(decision.reason) == "sampled";
      break;
    case reuse::Decision::kReject:
      result.outcome = wire::ApproximateOutcome::Rejected;
      break;
  }
  log_.info("approximate_candidate", {{"donor", hit.id},
                                      {"similarity", static_cast<double>(hit.score)},
                                      {"changed", best->changed},
                                      {"mode", mode},
                                      {"difference", reuse::difference_name(kind)},
                                      {"cell", rule_->cell_name(decision.cell)},
                                      {"decision", std::string(wire::name(result.outcome))},
                                      {"reason", decision.reason},
                                      {"error_bound", decision.error_bound}});
  return result;
}

// The donor's KV moved to this prompt's aligned positions, if the donor's whole prompt is
// cached (its blocks, and the prompt record's partial last block) and covers at least a block
// past the exact prefix hit (`from` tokens). Less would save almost nothing over prefilling past
// the prefix, and the blend costs its transplant and its full early layers: same-context
// prompts with another question went from TTFT p50 4.5 to 6.6 ms when blended.
void ApproximateLookup::blend_kv(const std::vector<int32_t>& tokens, int64_t from,
                                 const reuse::SignatureRecord& donor, uint64_t donor_key,
                                 std::vector<uint8_t>& kv, std::vector<uint8_t>& mask) {
  const std::vector<int32_t> alignment = reuse::align_tokens(tokens, donor.tokens);
  const auto past_prefix = alignment.begin() + std::clamp<int64_t>(from, 0, alignment.size());
  if (std::count_if(past_prefix, alignment.end(), [](int32_t a) { return a >= 0; }) <
      model::kBlockTokens)
    return;
  const uint64_t ns = model::namespace_id(donor.cache_namespace);
  const std::vector<uint64_t> chain =
      reuse::block_chain(donor.tokens, reuse_model_key(model_.model_id()), ns);
  std::vector<reuse::Value> blocks = cached_prefix(store_, chain, chain.size(), block_bytes_);
  if (blocks.size() != chain.size()) return;
  if (donor.tokens.size() % model::kBlockTokens != 0) {
    reuse::Value value = store_.get(reuse::prompt_entry(donor_key));
    auto prompt = value ? reuse::decode_prompt(
                              *value, static_cast<size_t>(model_.config().vocab_size), block_bytes_)
                        : std::nullopt;
    if (!prompt || prompt->tail_kv.empty()) return;
    blocks.push_back(std::make_shared<const std::string>(std::move(prompt->tail_kv)));
  }
  std::vector<uint8_t> donor_kv;
  donor_kv.reserve(blocks.size() * block_bytes_);
  for (const reuse::Value& block : blocks)
    donor_kv.insert(donor_kv.end(), block->begin(), block->end());
  const model::ModelConfig& cfg = model_.config();
  const reuse::KvGeometry geometry = reuse::KvGeometry::of(cfg);
  kv = reuse::transplant_kv(donor_kv, alignment, geometry);
  mask.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) mask[i] = alignment[i] >= 0 ? 1 : 0;
}

void ApproximateLookup::update_gauges() {
  size_t live = 0, dead = 0;
  for (const std::string& name : namespaces_) {
    live += index_->size(name);
    dead += index_->tombstones(name);
  }
  metrics_.index_entries->set(static_cast<double>(live));
  metrics_.index_tombstones->set(static_cast<double>(dead));
  metrics_.index_rebuilds->set(static_cast<double>(index_->rebuilds()));
}

}  // namespace moeline::stages
