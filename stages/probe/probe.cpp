#include "stages/probe/probe.h"
#include "stages/probe/routing.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/generator.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/model_text.h"
#include "model/sampling.h"
#include "offload/resident_provider.h"
#include "reuse/approximate.h"
#include "reuse/blend.h"
#include "reuse/records.h"
#include "reuse/signature.h"
#include "reuse/similarity_index.h"
#include "reuse/snapshot_store.h"
#include "stages/common/common.h"
#include "stages/runtime/dispatch.h"
#include "stages/runtime/link.h"
#include "stages/runtime/service.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages {
namespace {

using Clock = std::chrono::steady_clock;

// Index neighbours considered per lookup.
constexpr int kCandidates = 8;
// Memory for the router sums of full blocks the probe remembers (the prefix-import shortcut).
constexpr size_t kRememberedBytes = size_t{32} << 20;

enum class Metric { kCosine, kEuclidean, kJaccard };

// What approximate reuse made of a lookup (ProbePlan.approximate and the fields that go with it).
struct ApproximateOutcome {
  std::string outcome;      // "" (not asked), response, blend, shadow, no_candidate, rejected
  std::string shadow_mode;  // for shadow: response or blend
  bool sampled = false;     // a shadow of a hit the rule would have served
  uint64_t donor = 0;
  float similarity = 0;
  int cell = 0;
  reuse::ResultRecord donor_result;  // response (served, or to compare with)
  std::vector<uint8_t> kv;           // blend: the prompt's blocks with the donor's KV
  std::vector<uint8_t> mask;         // blend: 1 where the KV is the donor's
};

class Probe {
 public:
  explicit Probe(const runtime::Config& config)
      : service_("probe", replica_name(config, "probe")), metrics_(service_.metrics) {
    runtime::StageService::install_signal_handlers();
    service_.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
    auto loaded = model::Model::load(config.text("model"));
    if (!loaded) throw std::runtime_error(loaded.error().message);
    model_ = std::move(*loaded);
    const model::ModelConfig& cfg = model_->config();
    block_bytes_ = model::KvCache::bytes_per_token(cfg) * model::kBlockTokens;
    for (int64_t eos : cfg.eos_token_ids) eos_.push_back(static_cast<int32_t>(eos));

    reuse::StoreOptions options;
    options.ram_bytes = runtime::parse_bytes(config.text("store-ram-bytes"));
    options.disk_bytes = runtime::parse_bytes(config.text("store-disk-bytes"));
    options.disk_reserve_bytes = runtime::parse_bytes(config.text("store-disk-reserve"));
    options.disk_path = config.text("store-path");
    // One folder per replica where replicas share a volume (docker-compose --scale probe=N).
    if (const size_t at = options.disk_path.find("{replica}"); at != std::string::npos)
      options.disk_path.replace(at, 9, service_.log.replica());
    const std::string policy = config.text("store-policy");
    if (policy != "slru" && policy != "lru")
      throw runtime::ConfigError("--store-policy must be slru or lru, got '" + policy + "'");
    options.policy =
        policy == "lru" ? reuse::EvictionPolicy::kLru : reuse::EvictionPolicy::kSegmentedLru;
    store_ = open_store(options, "snapshots");
    service_.log.info("store_opened",
                      {{"ram_bytes", options.ram_bytes},
                       {"disk_bytes", options.disk_bytes},
                       {"disk_path", options.disk_path.empty() ? "(none)" : options.disk_path},
                       {"disk_entries", store_->stats().disk_entries},
                       {"policy", policy}});

    open_approximate(config, options);

    service_.start_http(config.text("http"), config.text("port-file"));
    register_metrics();
    credits_ = static_cast<uint32_t>(config.integer("queue"));
    configure_io_threads(context_, config);
    runtime::LinkSettings settings = link_settings(
        config, wire::StageKind::Probe, service_.log.replica(), *model_, service_.http_port());
    link_ = std::make_unique<runtime::HubLink>(context_, settings, service_.log, metrics_);
    // Snapshot puts come from prefill straight to this intake (the gateway never relays them).
    if (settings.curve_keys)
      zap_ = std::make_unique<runtime::ZapHandler>(context_, service_.log, metrics_);
    intake_ = open_intake(context_, config, settings, "probe", service_.log, metrics_, zap_.get());
    link_->set_intake(intake_->endpoint(), intake_->public_key());
    peers_ = std::make_unique<runtime::PeerSender>(context_, settings.curve_keys);
    router_ = std::make_unique<PlanRouter>(*link_, *peers_, *intake_);
  }

  // A disk tier that cannot be opened (corrupt, or on a full disk) must not keep the probe down:
  // every request would wait for it. It is moved aside (named in the log and counted) and the
  // probe starts with an empty disk tier, or with none when even that cannot be opened.
  std::unique_ptr<reuse::SnapshotStore> open_store(const reuse::StoreOptions& options,
                                                   const char* name) {
    reuse::StoreOpenReport report;
    auto store = reuse::SnapshotStore::open_resilient(options, report);
    if (!report.error.empty()) {
      metrics_
          .counter(
              "moeline_probe_store_open_failures_total",
              "Disk tiers that could not be opened at start (moved aside, or run without)",
              {{"store", name}, {"outcome", report.disk_tier ? "moved_aside" : "no_disk_tier"}})
          .inc();
      service_.log.error("store_unusable", {{"store", name},
                                            {"path", options.disk_path},
                                            {"moved_to", report.moved_aside_to},
                                            {"disk_tier", report.disk_tier},
                                            {"error", report.error}});
    }
    metrics_
        .gauge("moeline_probe_store_disk_tier", "1 while the store has a disk tier",
               {{"store", name}})
        .set(report.disk_tier && !options.disk_path.empty() ? 1 : 0);
    return store;
  }

  // Approximate reuse: an engine for the first layers (lookup signatures), the index with its
  // signature records (a store of their own, rebuilt into the index at start), the decision rule.
  void open_approximate(const runtime::Config& config, const reuse::StoreOptions& store) {
    const model::ModelConfig& cfg = model_->config();
    auto tokenizer = model::load_model_tokenizer(model_->dir());
    if (!tokenizer) throw std::runtime_error(tokenizer.error().message);
    tokenizer_ = std::make_unique<tokenizer::Tokenizer>(std::move(*tokenizer));
    signature_options_ = signature_options(config);
    signature_layers_ = model::layers_through_moe(cfg, signature_options_.layers);
    const std::vector<int64_t> moe = model::moe_layer_indices(cfg);
    const int64_t experts = std::max<int64_t>(1, cfg.num_experts);
    const int64_t concatenated =
        static_cast<int64_t>(std::min(moe.size(), static_cast<size_t>(signature_options_.layers))) *
        experts;
    signature_dimension_ =
        static_cast<int>(std::min<int64_t>(concatenated, signature_options_.dimension));
    block_sums_width_ = static_cast<size_t>(std::max<int64_t>(1, concatenated));
    max_signature_tokens_ = config.integer("signature-max-tokens");
    if (cfg.max_position_embeddings > 0)
      max_signature_tokens_ = std::min(max_signature_tokens_, cfg.max_position_embeddings);
    configure_quant_math(config);
    int threads = static_cast<int>(config.integer("threads"));
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    pool_ = std::make_unique<kernels::ThreadPool>(threads);
    experts_ = std::make_unique<offload::ResidentExpertProvider>(model_->experts());
    // KV only for the layers a signature runs (a partial forward never reads past them).
    model::ModelConfig signature_config = cfg;
    signature_config.num_layers = std::max<int64_t>(1, signature_layers_);
    cache_ = std::make_unique<model::KvCache>(
        signature_config, static_cast<int32_t>((max_signature_tokens_ + model::kBlockTokens - 1) /
                                               model::kBlockTokens));
    engine_ = std::make_unique<model::Engine>(*model_, *experts_, *pool_, *cache_);
    accumulator_ = std::make_unique<reuse::SignatureAccumulator>(moe, experts, signature_options_);
    whole_accumulator_ =
        std::make_unique<reuse::SignatureAccumulator>(moe, experts, signature_options_);
    observers_.add(accumulator_.get());
    observers_.add(whole_accumulator_.get());
    engine_->set_router_observer(&observers_);

    reuse::IndexOptions index;
    index.dimension = std::max(1, signature_dimension_);
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
      throw runtime::ConfigError(
          "--approximate-metric must be cosine, euclidean or jaccard, got '" + metric + "'");
    }
    recompute_fraction_ = config.number("approximate-recompute-fraction");
    if (!(recompute_fraction_ >= 0 && recompute_fraction_ <= 1))
      throw runtime::ConfigError("--approximate-recompute-fraction must be in [0, 1]");

    reuse::StoreOptions options;
    options.ram_bytes = runtime::parse_bytes(config.text("signature-store-bytes"));
    options.disk_bytes = store.disk_bytes;
    options.disk_reserve_bytes = store.disk_reserve_bytes;
    options.disk_path = store.disk_path.empty() ? "" : store.disk_path + "/signatures";
    signatures_ = open_store(options, "signatures");
    service_.log.info("index_rebuilt", {{"entries", rebuild_index()},
                                        {"dimension", index.dimension},
                                        {"signature_layers", signature_options_.layers}});
  }

  // The index from the signature store: at start, and when the index holds far more entries than
  // the store (records the store evicted leave entries behind until a lookup meets them).
  size_t rebuild_index() {
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

  void reconcile_index() {
    if (++signature_puts_ % 1024 != 0) return;
    size_t indexed = 0;
    for (const std::string& name : namespaces_) indexed += index_->size(name);
    const reuse::StoreStats& stored = signatures_->stats();
    if (indexed <= 2 * (stored.ram_entries + stored.disk_entries) + 1024) return;
    const size_t live = rebuild_index();
    service_.log.info("index_reconciled", {{"entries_before", indexed}, {"entries", live}});
  }

  int run() {
    while (!runtime::StageService::stop_requested()) {
      service_.tick();
      if (link_->rejected()) return 3;
      if (link_->needs_hello()) link_->hello(credits_);
      service_.set_ready(link_->accepted());
      uint32_t handled = 0;
      for (int wait_ms = 50;; wait_ms = 0) {
        // Puts before lookups: a request sent once the client saw the first token of the one
        // that made them (prefill sends its puts first) must find them.
        while (auto put = intake_->receive()) service_.guard("probe", [&] { on_intake(*put); });
        auto message = link_->receive(wait_ms, &intake_->socket());
        if (!message) {
          if (intake_->pending()) continue;
          break;
        }
        service_.guard("probe", [&] { dispatch(*message); });
        ++handled;
      }
      if (handled) batch_->observe(handled);
      update_gauges();
    }
    store_->flush();
    signatures_->flush();
    service_.log.info("stopped", {{"disk_entries", store_->stats().disk_entries}});
    return 0;
  }

 private:
  void register_metrics() {
    lookups_ = &metrics_.counter("moeline_probe_lookups_total", "Jobs looked up");
    lookup_tokens_ = &metrics_.counter("moeline_probe_lookup_tokens_total",
                                       "Prompt tokens of the jobs looked up");
    for (const char* level : {"none", "prefix", "full", "result", "response", "blend"}) {
      hits_[level] = &metrics_.counter(
          "moeline_probe_hits_total", "Jobs by the reuse level that served them (request-weighted)",
          {{"level", level}});
      hit_tokens_[level] = &metrics_.counter(
          "moeline_probe_hit_tokens_total",
          "Prompt tokens reused, by level (token-weighted; none: tokens not reused)",
          {{"level", level}});
      outcomes_[level] = &metrics_.counter("moeline_probe_requests_total", "Jobs by outcome",
                                           {{"outcome", level}});
    }
    latency_ = &metrics_.histogram("moeline_probe_latency_seconds", "Lookup time per job",
                                   runtime::latency_buckets());
    batch_ = &metrics_.histogram("moeline_probe_batch_size", "Messages handled per loop iteration",
                                 runtime::size_buckets());
    queue_depth_ = &metrics_.gauge("moeline_probe_queue_depth", "Jobs waiting in this probe");
    puts_ = &metrics_.counter("moeline_probe_store_puts_total", "Entries put into the store");
    for (const char* tier : {"ram", "disk"}) {
      bytes_[tier] = &metrics_.gauge("moeline_probe_store_bytes", "Snapshot store bytes by tier",
                                     {{"tier", tier}});
      entries_[tier] = &metrics_.gauge("moeline_probe_store_entries",
                                       "Snapshot store entries by tier", {{"tier", tier}});
    }
    for (const char* outcome : {"response", "blend", "shadow", "no_candidate", "rejected"})
      approximate_[outcome] = &metrics_.counter(
          "moeline_probe_approximate_total",
          "Lookups that asked for approximate reuse, by outcome (response/blend: served hits; "
          "shadow: candidate computed in full and compared; rejected: candidate refused)",
          {{"outcome", outcome}});
    for (const char* mode : {"response", "blend"}) {
      candidates_[mode] =
          &metrics_.counter("moeline_probe_approximate_candidates_total",
                            "Candidates at or above the threshold, by mode", {{"mode", mode}});
      served_[mode] = &metrics_.counter("moeline_probe_approximate_served_total",
                                        "Approximate hits served, by mode", {{"mode", mode}});
    }
    for (const char* result : {"agreed", "disagreed"})
      checks_[result] = &metrics_.counter("moeline_probe_shadow_checks_total",
                                          "Shadow check outcomes received", {{"result", result}});
    agreement_ = &metrics_.gauge("moeline_probe_shadow_agreement",
                                 "Share of shadow checks that agreed (all received)");
    error_estimate_ = &metrics_.gauge(
        "moeline_probe_approximate_error_bound",
        "Upper 95% bound of the false-reuse rate, in the best-evidenced cell of the decision rule");
    index_entries_ = &metrics_.gauge("moeline_probe_index_entries", "Live signatures in the index");
    index_tombstones_ =
        &metrics_.gauge("moeline_probe_index_tombstones", "Removed entries not yet rebuilt away");
    index_rebuilds_ = &metrics_.gauge("moeline_probe_index_rebuilds", "Index rebuilds (total)");
    signature_seconds_ = &metrics_.histogram(
        "moeline_probe_signature_seconds",
        "Partial forward for a lookup's signature (compare with prefill time per job)",
        runtime::latency_buckets());
    shadow_kl_ = &metrics_.histogram(
        "moeline_probe_shadow_kl",
        "Response-reuse shadow checks: KL(full || donor) of the first-token distributions (nats)",
        {0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5});
    for (const char* result : {"agreed", "disagreed"})
      top1_[result] = &metrics_.counter(
          "moeline_probe_shadow_top1_total",
          "Response-reuse shadow checks: top-1 first token of the full computation vs the donor's",
          {{"result", result}});
    prefix_imports_ = &metrics_.counter(
        "moeline_probe_signature_prefix_imports_total",
        "Lookups whose signature imported the cached prefix (KV and router sums) instead of "
        "recomputing it");
    refused_records_ = &metrics_.counter("moeline_probe_refused_records_total",
                                         "Signature or quality records refused (malformed)");
    const std::vector<std::pair<const char*, const char*>> counters = {
        {"evictions", "Entries evicted from the RAM tier"},
        {"spills", "Entries written to the disk tier"},
        {"restores", "Entries read back from the disk tier"},
        {"disk_evictions", "Entries dropped from the disk tier (its budget)"},
        {"corrupt_entries", "Disk entries that failed their checksum (dropped, never served)"},
        {"spill_failures", "Spills the disk tier refused (a full or failing disk; dropped)"}};
    for (const auto& [name, help] : counters)
      store_counters_[name] = &metrics_.gauge(std::string("moeline_probe_store_") + name,
                                              std::string(help) + " (total)");
  }

  void update_gauges() {
    const reuse::StoreStats& s = store_->stats();
    bytes_["ram"]->set(static_cast<double>(s.ram_bytes));
    bytes_["disk"]->set(static_cast<double>(s.disk_bytes));
    entries_["ram"]->set(static_cast<double>(s.ram_entries));
    entries_["disk"]->set(static_cast<double>(s.disk_entries));
    store_counters_["evictions"]->set(static_cast<double>(s.evictions));
    store_counters_["spills"]->set(static_cast<double>(s.spills));
    store_counters_["restores"]->set(static_cast<double>(s.restores));
    store_counters_["disk_evictions"]->set(static_cast<double>(s.disk_evictions));
    store_counters_["corrupt_entries"]->set(static_cast<double>(s.corrupt));
    store_counters_["spill_failures"]->set(static_cast<double>(s.spill_failures));
    // A failed spill drops its entry (the disk refused it); said once per new failure, at most
    // once a second.
    const uint64_t failures = s.spill_failures + signatures_->stats().spill_failures;
    if (failures > spill_failures_logged_) {
      if (uint64_t suppressed = 0; spill_failure_log_.allow(suppressed)) {
        const reuse::SnapshotStore& failing =
            s.spill_failures > 0 ? *store_ : static_cast<const reuse::SnapshotStore&>(*signatures_);
        service_.log.error("store_spill_failed", {{"path", failing.options().disk_path},
                                                  {"failures", failures},
                                                  {"error", failing.disk_error()}});
        spill_failures_logged_ = failures;
      }
    }
    queue_depth_->set(0);
    size_t live = 0, dead = 0;
    for (const std::string& name : namespaces_) {
      live += index_->size(name);
      dead += index_->tombstones(name);
    }
    index_entries_->set(static_cast<double>(live));
    index_tombstones_->set(static_cast<double>(dead));
    index_rebuilds_->set(static_cast<double>(index_->rebuilds()));
  }

  void dispatch(wire::Message& message) {
    static constexpr runtime::HandlerTable<Probe, 3, wire::Message&> kHandlers({
        {wire::MessageType::ProbeJob, &Probe::on_probe_job},
        {wire::MessageType::SnapshotPut, &Probe::on_snapshot_put},
        // A job is answered as soon as it arrives: nothing to cancel.
        {wire::MessageType::CancelJob, &Probe::ignore},
    });
    if (!kHandlers.dispatch(*this, message.type, message))
      service_.log.warn("unexpected_message", {{"type", wire::message_type_name(message.type)}});
  }

  // A put from prefill's job, taken only with the ticket the gateway signed for this replica.
  void on_intake(wire::Message& message) {
    if (message.type != wire::MessageType::SnapshotPut)
      return intake_->refuse(message.type, "not_taken_here");
    if (!runtime::has_valid_ticket(link_->handover_key(), *message.as<wire::SnapshotPut>()))
      return intake_->refuse(message.type, "bad_ticket");
    this->put(message);
  }

  void on_probe_job(wire::Message& message) { lookup(*message.as<wire::ProbeJob>()); }
  void on_snapshot_put(wire::Message& message) { put(message); }
  void ignore(wire::Message&) {}

  void put(const wire::Message& message) {
    const auto* put = message.as<wire::SnapshotPut>();
    if (auto bad = wire::check_bulk(put->frames(), message.bulk)) {
      service_.log.warn("snapshot_refused", {{"reason", *bad}});
      return;
    }
    const size_t entries = put->entries() ? put->entries()->size() : 0;
    if (entries != message.bulk.size()) {
      service_.log.warn("snapshot_refused", {{"reason", "entries and frames differ in number"}});
      return;
    }
    // Deepest first (entries come in chain order): the head of a chain ends up the most recent.
    for (size_t i = entries; i-- > 0;) {
      const auto* entry = put->entries()->Get(static_cast<flatbuffers::uoffset_t>(i));
      const auto bytes = message.bulk[i].bytes();
      std::string record(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      if (entry->kind() == 'P') compare_first_tokens(entry->key(), record);
      if (entry->kind() == 'S') {
        put_signature(record);
        continue;
      }
      if (entry->kind() == 'Q') {
        record_quality(entry->key(), record);
        continue;
      }
      // A block must be exactly one block of this model's KV.
      if (entry->kind() == 'B' && bytes.size() != block_bytes_) continue;
      store_->put(entry->key(), std::move(record));
      puts_->inc();
    }
  }

  // A signature record from prefill: stored (keyed by the prompt it describes, which its tokens and
  // namespace determine: nothing to trust about the key) and indexed.
  void put_signature(const std::string& bytes) {
    auto record = reuse::decode_signature(bytes);
    if (!record || !index_signature(*record)) {
      refused_records_->inc();
      uint64_t suppressed = 0;
      if (refusal_log_.allow(suppressed))
        service_.log.warn(
            "signature_refused",
            {{"reason", record ? "dimension or tokens do not fit this model" : "malformed record"},
             {"suppressed", suppressed}});
      return;
    }
    // The block sums are for lookups over this prompt's prefixes: kept in memory, not stored.
    if (!record->block_sums.empty()) {
      const uint64_t ns = model::namespace_id(record->cache_namespace);
      const std::vector<uint64_t> chain =
          reuse::block_chain(record->tokens, model_->model_id(), ns);
      for (const auto& [block, sums] : record->block_sums)
        if (block < chain.size() && sums.sums.size() == block_sums_width_)
          remember_block_sums(chain[block], sums);
      record->block_sums.clear();
    }
    signatures_->put(reuse::signature_entry(donor_key(*record)), reuse::encode(*record));
    reconcile_index();
  }

  uint64_t donor_key(const reuse::SignatureRecord& record) const {
    const uint64_t ns = model::namespace_id(record.cache_namespace);
    const std::vector<uint64_t> chain = reuse::block_chain(record.tokens, model_->model_id(), ns);
    return reuse::prompt_key(record.tokens, chain, model_->model_id(), ns);
  }

  bool index_signature(const reuse::SignatureRecord& record) {
    if (static_cast<int>(record.signature.size()) != index_->options().dimension ||
        record.tokens.empty())
      return false;
    const int64_t vocab = model_->config().vocab_size;
    for (int32_t t : record.tokens)
      if (t < 0 || t >= vocab) return false;
    index_->add(record.cache_namespace, donor_key(record), record.signature);
    namespaces_.insert(record.cache_namespace);
    return true;
  }

  // A response-reuse shadow check's first-token distributions: when prefill stores the shadowed
  // prompt's record (its full computation's logits), against the donor's stored logits. (The
  // gateway judges the check by the first tokens; this measures how far apart they were.)
  void compare_first_tokens(uint64_t prompt_entry, const std::string& bytes) {
    auto pending = pending_kl_.find(prompt_entry);
    if (pending == pending_kl_.end()) return;
    const uint64_t donor = pending->second;
    pending_kl_.erase(pending);
    const auto vocab = static_cast<size_t>(model_->config().vocab_size);
    auto full = reuse::decode_prompt(bytes, vocab, block_bytes_);
    reuse::Value stored = store_->get(reuse::prompt_entry(donor));
    auto reused = stored ? reuse::decode_prompt(*stored, vocab, block_bytes_) : std::nullopt;
    if (!full || !reused) return;
    const double kl = reuse::softmax_kl(full->logits, reused->logits);
    const bool top1 = model::argmax(full->logits.data(), static_cast<int64_t>(vocab)) ==
                      model::argmax(reused->logits.data(), static_cast<int64_t>(vocab));
    shadow_kl_->observe(kl);
    top1_[top1 ? "agreed" : "disagreed"]->inc();
  }

  void expect_first_tokens(uint64_t prompt_key, uint64_t donor) {
    if (pending_kl_.size() >= 4096) pending_kl_.clear();  // bounded; a lost comparison is harmless
    pending_kl_[reuse::prompt_entry(prompt_key)] = donor;
  }

  void record_quality(uint64_t donor, const std::string& bytes) {
    auto quality = reuse::decode_quality(bytes);
    if (!quality) {
      refused_records_->inc();
      return;
    }
    rule_->record(quality->cell, donor, quality->correct);
    checks_[quality->correct ? "agreed" : "disagreed"]->inc();
    const double agreed = checks_["agreed"]->value();
    agreement_->set(agreed / (agreed + checks_["disagreed"]->value()));
    double best = 1.0;
    for (const auto& [cell, counts] : rule_->cells())
      best = std::min(best, rule_->error_bound(cell));
    error_estimate_->set(best);
    service_.log.info("shadow_check", {{"donor", donor},
                                       {"cell", rule_->cell_name(quality->cell)},
                                       {"correct", quality->correct},
                                       {"kl", static_cast<double>(quality->kl)},
                                       {"error_bound", rule_->error_bound(quality->cell)}});
  }

  // Two signatures of `tokens` from one partial forward (the first layers only): pooled over
  // positions from `from` on (past the exact prefix hit, so that a shared template does not
  // dominate) and over the whole prompt. Stored signatures were pooled past whatever prefix hit
  // their own prefill had — none for a prompt computed cold — so a lookup asks with both.
  struct LookupSignatures {
    std::vector<float> past_prefix, whole;
    std::vector<std::set<int32_t>> past_prefix_sets, whole_sets;
  };
  //
  // When the exact prefix's blocks are at hand (`prefix_blocks`, the prefix plan's) and an earlier
  // lookup left their router sums, the prefix is not recomputed: its blocks' KV is imported (the
  // signature layers of each record) and their sums added to the whole-prompt pool; only the rest
  // of the prompt runs. Either way the full blocks computed here leave their sums for later.
  LookupSignatures lookup_signatures(const std::vector<int32_t>& tokens, int64_t from,
                                     const std::vector<uint64_t>& chain,
                                     const std::vector<reuse::Value>& prefix_blocks) {
    LookupSignatures out;
    if (static_cast<int64_t>(tokens.size()) > max_signature_tokens_ || signature_layers_ == 0)
      return out;
    const auto start = Clock::now();
    const auto covered = static_cast<size_t>(from / model::kBlockTokens);
    std::vector<const reuse::RouterSums*> cached_sums;
    bool import = from > 0 && prefix_blocks.size() >= covered;
    for (size_t b = 0; import && b < covered; ++b) {
      auto it = block_sums_.find(chain[b]);
      if (it == block_sums_.end())
        import = false;
      else
        cached_sums.push_back(&it->second);
    }
    const uint64_t id = next_sequence_id_++;
    model::Sequence sequence(id, model_->model_id(), 0);
    model::BlockPool& pool = cache_->pool();
    if (import) {
      // The cache serves one lookup at a time and holds the longest prompt: there is room.
      for (size_t b = 0; b < covered; ++b) {
        const int32_t block = *pool.allocate();
        cache_->import_block(block, prefix_blocks[b]->data());
        sequence.share_block(pool, block);
        pool.release(block);
      }
      sequence.commit(std::span(tokens.data(), static_cast<size_t>(from)));
      prefix_imports_->inc();
    }
    accumulator_->watch(id, from);
    whole_accumulator_->watch(id, import ? from : 0, /*per_block=*/true);
    for (const reuse::RouterSums* sums : cached_sums) whole_accumulator_->add(id, *sums);
    const std::span<const int32_t> run =
        import ? std::span(tokens).subspan(static_cast<size_t>(from)) : std::span(tokens);
    const model::SequenceInput input{&sequence, run, false};
    moeline::Status status = engine_->forward_layers(std::span(&input, 1), signature_layers_);
    if (status.ok()) {
      out.past_prefix = accumulator_->signature(id);
      out.past_prefix_sets = accumulator_->expert_sets(id);
      if (from > 0) {
        out.whole = whole_accumulator_->signature(id);
        out.whole_sets = whole_accumulator_->expert_sets(id);
      }
      for (const auto& [block, sums] : whole_accumulator_->block_sums(id))
        if (static_cast<size_t>(block) < chain.size() &&
            std::all_of(sums.tokens.begin(), sums.tokens.end(),
                        [](int64_t n) { return n == model::kBlockTokens; }))
          remember_block_sums(chain[static_cast<size_t>(block)], sums);
    }
    accumulator_->forget(id);
    whole_accumulator_->forget(id);
    sequence.release(pool);
    signature_seconds_->observe(std::chrono::duration<double>(Clock::now() - start).count());
    return out;
  }

  // Router sums of full blocks by block key (bounded, oldest first out: a lost entry only means
  // recomputing that prefix once more).
  void remember_block_sums(uint64_t block_key, const reuse::RouterSums& sums) {
    if (!block_sums_.emplace(block_key, sums).second) return;
    block_sums_order_.push_back(block_key);
    // A byte budget: each entry holds a sum per expert of each signature layer.
    const size_t limit =
        std::max<size_t>(1024, kRememberedBytes / (block_sums_width_ * sizeof(double) + 128));
    while (block_sums_order_.size() > limit) {
      block_sums_.erase(block_sums_order_.front());
      block_sums_order_.pop_front();
    }
  }

  // The similarity of a lookup to a stored prompt in the configured metric (Euclidean as
  // 1 - distance / 2, so that every metric reads "higher is closer", up to 1): the better of the
  // two poolings.
  float similarity(const LookupSignatures& lookup, const reuse::SignatureRecord& donor) const {
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

  std::string token_text(int32_t token) {
    auto it = token_texts_.find(token);
    if (it != token_texts_.end()) return it->second;
    auto text = tokenizer_->decode({token}, tokenizer::DecodeOptions{});
    return token_texts_[token] = text ? *text : std::string();
  }

  struct Donor {
    reuse::SimilarityIndex::Hit hit;  // score: the similarity in the configured metric
    reuse::SignatureRecord record;
    double changed = 1;  // changed_fraction against the lookup's prompt
  };

  // The index's nearest few (by cosine, both poolings) are the candidates; those at or above the
  // threshold in the configured metric qualify, and the one closest in tokens (smallest share
  // changed) is the donor: the signature finds the neighbourhood, the tokens pick within it.
  std::optional<Donor> nearest_donor(const std::vector<int32_t>& tokens,
                                     const std::string& name_space, uint64_t key,
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

  // The nearest cached prompt of the namespace that has what a mode needs, and what the decision
  // rule makes of it. `from`: the exact prefix hit's length (pooled signatures leave it out).
  ApproximateOutcome approximate(const std::vector<int32_t>& tokens, const std::string& name_space,
                                 uint64_t key, const model::SamplingParams& sampling,
                                 uint32_t allowed, int64_t from, const std::vector<uint64_t>& chain,
                                 const std::vector<reuse::Value>& prefix_blocks) {
    ApproximateOutcome result;
    result.outcome = "no_candidate";
    const LookupSignatures lookup = lookup_signatures(tokens, from, chain, prefix_blocks);
    if (lookup.past_prefix.empty() && lookup.whole.empty()) return result;
    const std::optional<Donor> best = nearest_donor(tokens, name_space, key, lookup);
    if (!best) return result;
    const reuse::SimilarityIndex::Hit& hit = best->hit;
    const reuse::SignatureRecord& donor = best->record;
    std::optional<reuse::ResultRecord> answer;
    if (allowed & reuse::kResponse) {
      if (reuse::Value value = store_->get(reuse::result_entry(hit.id, sampling)))
        answer = reuse::decode_result(*value);
      if (answer && answer->tokens.empty()) answer.reset();
    }
    std::vector<uint8_t> kv, mask;
    if (!answer && (allowed & reuse::kBlend)) blend_kv(tokens, from, donor, hit.id, kv, mask);
    if (!answer && kv.empty()) return result;  // nothing of it that this request could use
    const char* mode = answer ? "response" : "blend";
    candidates_[mode]->inc();
    const reuse::DifferenceKind kind = reuse::classify_difference(
        tokens, donor.tokens, [this](int32_t t) { return token_text(t); });
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
        result.outcome = mode;
        served_[mode]->inc();
        break;
      case reuse::Decision::kShadow:
        result.outcome = "shadow";
        result.shadow_mode = mode;
        result.sampled = std::string_view(decision.reason) == "sampled";
        break;
      case reuse::Decision::kReject:
        result.outcome = "rejected";
        break;
    }
    service_.log.info("approximate_candidate", {{"donor", hit.id},
                                                {"similarity", static_cast<double>(hit.score)},
                                                {"changed", best->changed},
                                                {"mode", mode},
                                                {"difference", reuse::difference_name(kind)},
                                                {"cell", rule_->cell_name(decision.cell)},
                                                {"decision", result.outcome},
                                                {"reason", decision.reason},
                                                {"error_bound", decision.error_bound}});
    return result;
  }

  // The donor's KV moved to this prompt's aligned positions, if the donor's whole prompt is
  // cached (its blocks, and the prompt record's partial last block) and covers at least a block
  // past the exact prefix hit (`from` tokens). Less would save almost nothing over prefilling past
  // the prefix, and the blend costs its transplant and its full early layers: same-context
  // prompts with another question went from TTFT p50 4.5 to 6.6 ms when blended.
  void blend_kv(const std::vector<int32_t>& tokens, int64_t from,
                const reuse::SignatureRecord& donor, uint64_t donor_key, std::vector<uint8_t>& kv,
                std::vector<uint8_t>& mask) {
    const std::vector<int32_t> alignment = reuse::align_tokens(tokens, donor.tokens);
    const auto past_prefix = alignment.begin() + std::clamp<int64_t>(from, 0, alignment.size());
    if (std::count_if(past_prefix, alignment.end(), [](int32_t a) { return a >= 0; }) <
        model::kBlockTokens)
      return;
    const uint64_t ns = model::namespace_id(donor.cache_namespace);
    const std::vector<uint64_t> chain = reuse::block_chain(donor.tokens, model_->model_id(), ns);
    std::vector<reuse::Value> blocks = cached_prefix(chain, chain.size());
    if (blocks.size() != chain.size()) return;
    if (donor.tokens.size() % model::kBlockTokens != 0) {
      reuse::Value value = store_->get(reuse::prompt_entry(donor_key));
      auto prompt =
          value ? reuse::decode_prompt(*value, static_cast<size_t>(model_->config().vocab_size),
                                       block_bytes_)
                : std::nullopt;
      if (!prompt || prompt->tail_kv.empty()) return;
      blocks.push_back(std::make_shared<const std::string>(std::move(prompt->tail_kv)));
    }
    std::vector<uint8_t> donor_kv;
    donor_kv.reserve(blocks.size() * block_bytes_);
    for (const reuse::Value& block : blocks)
      donor_kv.insert(donor_kv.end(), block->begin(), block->end());
    const model::ModelConfig& cfg = model_->config();
    const reuse::KvGeometry geometry = reuse::KvGeometry::of(cfg);
    kv = reuse::transplant_kv(donor_kv, alignment, geometry);
    mask.resize(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) mask[i] = alignment[i] >= 0 ? 1 : 0;
  }

  // The longest run of cached blocks from the start (values in order). The blocks are read
  // deepest first, so that the head of the chain is the most recently used: a chain is only
  // useful from its first block on, so its first blocks are the last ones to evict.
  std::vector<reuse::Value> cached_prefix(const std::vector<uint64_t>& chain, size_t limit) {
    size_t run = 0;
    while (run < chain.size() && run < limit && store_->contains(reuse::block_entry(chain[run])))
      ++run;
    std::vector<reuse::Value> blocks(run);
    for (size_t b = run; b-- > 0;) blocks[b] = store_->get(reuse::block_entry(chain[b]));
    // A record that failed its checksum on disk ends the run there.
    for (size_t b = 0; b < run; ++b) {
      if (!blocks[b] || blocks[b]->size() != block_bytes_) {
        blocks.resize(b);
        break;
      }
    }
    return blocks;
  }

  flatbuffers::Offset<wire::KvLayout> layout(flatbuffers::FlatBufferBuilder& builder,
                                             size_t blocks) const {
    return kv_layout(builder, model_->config(), blocks);
  }

  // One bulk frame holding the blocks' KV in order, and its descriptor.
  static zmq::message_t concatenate(const std::vector<reuse::Value>& blocks, uint64_t& checksum) {
    size_t total = 0;
    for (const reuse::Value& block : blocks) total += block->size();
    zmq::message_t frame(total);
    auto* out = static_cast<uint8_t*>(frame.data());
    for (const reuse::Value& block : blocks) {
      std::copy(block->begin(), block->end(), reinterpret_cast<char*>(out));
      out += block->size();
    }
    checksum = wire::checksum({static_cast<const uint8_t*>(frame.data()), frame.size()});
    return frame;
  }

  void lookup(const wire::ProbeJob& job) {
    const auto start = Clock::now();
    std::vector<int32_t> tokens;
    if (job.tokens()) tokens.assign(job.tokens()->begin(), job.tokens()->end());
    const std::string name_space = job.cache_namespace() ? job.cache_namespace()->str() : "";
    const uint64_t ns = model::namespace_id(name_space);
    const uint64_t model_id = model_->model_id();
    const std::vector<uint64_t> chain = reuse::block_chain(tokens, model_id, ns);
    const uint64_t key = reuse::prompt_key(tokens, chain, model_id, ns);
    const uint32_t allowed = job.allowed_levels();
    const model::SamplingParams sampling = from_wire(job.sampling());
    lookups_->inc();
    lookup_tokens_->inc(static_cast<double>(tokens.size()));

    std::string level = "none";
    if (!tokens.empty() && (allowed & reuse::kResult)) {
      if (reuse::Value value = store_->get(reuse::result_entry(key, sampling))) {
        if (auto result = reuse::decode_result(*value); result && !result->tokens.empty()) {
          answer_result(job, tokens, *result);
          return done("result", tokens.size(), start);
        }
      }
    }
    if (!tokens.empty() && (allowed & reuse::kFull)) {
      if (reuse::Value value = store_->get(reuse::prompt_entry(key))) {
        auto prompt = reuse::decode_prompt(*value, static_cast<size_t>(model_->config().vocab_size),
                                           block_bytes_);
        std::vector<reuse::Value> blocks =
            prompt ? cached_prefix(chain, chain.size()) : std::vector<reuse::Value>{};
        if (prompt && blocks.size() == chain.size()) {
          answer_full(job, tokens, sampling, *prompt, std::move(blocks));
          return done("full", tokens.size(), start);
        }
      }
    }
    size_t reused_blocks = 0;
    std::vector<reuse::Value> blocks;
    if (allowed & reuse::kPrefix) {
      // Prefill must compute at least the last token (it samples from its logits).
      const size_t limit = tokens.empty() ? 0 : (tokens.size() - 1) / model::kBlockTokens;
      blocks = cached_prefix(chain, limit);
      reused_blocks = blocks.size();
      if (reused_blocks > 0) level = "prefix";
    }
    ApproximateOutcome approximate_outcome;
    if (!tokens.empty() && (allowed & reuse::kApproximateLevels)) {
      approximate_outcome =
          approximate(tokens, name_space, key, sampling, allowed,
                      static_cast<int64_t>(reused_blocks * model::kBlockTokens), chain, blocks);
      approximate_[approximate_outcome.outcome]->inc();
      const ApproximateOutcome& a = approximate_outcome;
      if (a.outcome == "shadow" && a.shadow_mode == "response") expect_first_tokens(key, a.donor);
      if (a.outcome == "response") {
        answer_result(job, tokens, a.donor_result, &a);
        return done("response", tokens.size(), start);
      }
      if (a.outcome == "blend" || (a.outcome == "shadow" && a.shadow_mode == "blend")) {
        send_blend(job, approximate_outcome, start, blocks,
                   reused_blocks > 0 ? chain[reused_blocks - 1] : a.donor);
        // How many tokens a blend reuses is prefill's to decide; a blend's plan carries no exact
        // prefix (a shadowed blend is computed in full).
        return done(a.outcome == "blend" ? "blend" : "none", 0, start, tokens.size());
      }
    }
    flatbuffers::FlatBufferBuilder builder(256);
    std::vector<zmq::message_t> bulk;
    flatbuffers::Offset<wire::KvLayout> kv_layout = 0;
    flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
    if (reused_blocks > 0) {
      uint64_t sum = 0;
      bulk.push_back(concatenate(blocks, sum));
      frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
          wire::CreateBulkFrame(builder, bulk.back().size(), sum)});
      kv_layout = layout(builder, reused_blocks);
    }
    const auto reused = static_cast<uint32_t>(reused_blocks * model::kBlockTokens);
    const auto took = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
    // A shadow of response reuse: computed in full as usual, with the donor's answer to compare.
    const ApproximateOutcome& a = approximate_outcome;
    flatbuffers::Offset<flatbuffers::Vector<int32_t>> completion = 0;
    if (a.outcome == "shadow") completion = builder.CreateVector(a.donor_result.tokens);
    wire::ProbePlanBuilder plan(builder);
    auto level_text = builder.CreateString(level);
    auto approximate_text = builder.CreateString(a.outcome);
    auto shadow_mode = builder.CreateString(a.shadow_mode);
    plan.add_request_id(job.request_id());
    plan.add_attempt(job.attempt());
    plan.add_reuse_level(level_text);
    plan.add_reused_tokens(reused);
    plan.add_probe_us(static_cast<uint32_t>(took.count()));
    if (!frames.IsNull()) plan.add_frames(frames);
    if (!kv_layout.IsNull()) plan.add_layout(kv_layout);
    if (!completion.IsNull()) plan.add_completion(completion);
    plan.add_prefix_key(reused_blocks > 0 ? chain[reused_blocks - 1] : 0);
    plan.add_approximate(approximate_text);
    plan.add_shadow_mode(shadow_mode);
    plan.add_donor_key(a.donor);
    plan.add_similarity(a.similarity);
    plan.add_cell(a.cell);
    plan.add_shadow_sampled(a.sampled);
    builder.Finish(plan.Finish(), wire::PrefillJobIdentifier());
    router_->send_plan(job, wire::encode(wire::MessageType::ProbePlan, builder, std::move(bulk)));
    done(level, reused, start, tokens.size());
  }

  void done(const std::string& level, size_t reused, Clock::time_point start,
            size_t prompt_tokens = 0) {
    link_->grant(1);
    hits_[level]->inc();
    outcomes_[level]->inc();
    hit_tokens_[level]->inc(static_cast<double>(level == "none" ? prompt_tokens : reused));
    if (level != "none" && prompt_tokens > reused)
      hit_tokens_["none"]->inc(static_cast<double>(prompt_tokens - reused));
    latency_->observe(std::chrono::duration<double>(Clock::now() - start).count());
  }

  // A finished completion to replay: the prompt's own (result level) or, for response reuse
  // (`approximate` given), the donor's.
  void answer_result(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                     const reuse::ResultRecord& result,
                     const ApproximateOutcome* approximate = nullptr) {
    flatbuffers::FlatBufferBuilder builder(256 + result.tokens.size() * 4);
    auto completion = builder.CreateVector(result.tokens);
    auto finish = builder.CreateString(result.finish_reason);
    auto level = builder.CreateString(approximate ? "response" : "result");
    auto outcome = builder.CreateString(approximate ? approximate->outcome : "");
    builder.Finish(
        wire::CreateProbePlan(builder, job.request_id(), job.attempt(), level,
                              approximate ? 0 : static_cast<uint32_t>(tokens.size()), 0, 0, 0,
                              completion, finish, 0, outcome, approximate ? approximate->donor : 0,
                              approximate ? approximate->similarity : 0.0f,
                              approximate ? approximate->cell : 0),
        wire::PrefillJobIdentifier());
    link_->send(wire::encode(wire::MessageType::ProbePlan, builder));
  }

  // Blended reuse (served, or shadowed: prefill then also computes in full, serves that and
  // reports how the blend compared): the prompt's blocks — the exact prefix's, then the donor's
  // KV moved into place — and the mask. The affinity key (the exact prefix's last block, or the
  // donor) sends jobs over one template, or from one donor, to one prefill replica.
  void send_blend(const wire::ProbeJob& job, ApproximateOutcome& a, Clock::time_point start,
                  const std::vector<reuse::Value>& prefix, uint64_t affinity) {
    // The exact prefix's blocks replace the transplant's first blocks: prefill imports them as
    // they are and never recomputes them (and jobs over one template share them).
    std::vector<uint8_t>& kv = a.kv;
    for (size_t b = 0; b < prefix.size() && (b + 1) * block_bytes_ <= kv.size(); ++b)
      std::copy(prefix[b]->begin(), prefix[b]->end(), kv.begin() + b * block_bytes_);
    flatbuffers::FlatBufferBuilder builder(512 + a.mask.size());
    std::vector<zmq::message_t> bulk;
    bulk.emplace_back(kv.data(), kv.size());
    auto frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
        wire::CreateBulkFrame(builder, kv.size(), wire::checksum(kv))});
    auto kv_layout = layout(builder, kv.size() / block_bytes_);
    auto mask = builder.CreateVector(a.mask);
    auto level = builder.CreateString("blend");
    auto outcome = builder.CreateString(a.outcome);
    auto shadow_mode = builder.CreateString(a.shadow_mode);
    const auto took = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
    builder.Finish(
        wire::CreateProbePlan(builder, job.request_id(), job.attempt(), level,
                              static_cast<uint32_t>(prefix.size() * model::kBlockTokens),
                              static_cast<uint32_t>(took.count()), frames, kv_layout, 0, 0,
                              affinity, outcome, a.donor, a.similarity, a.cell, mask,
                              static_cast<float>(recompute_fraction_), shadow_mode, a.sampled),
        wire::PrefillJobIdentifier());
    router_->send_plan(job, wire::encode(wire::MessageType::ProbePlan, builder, std::move(bulk)));
  }

  // A full hit: what prefill would have answered, from the store.
  void answer_full(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                   const model::SamplingParams& sampling, const reuse::PromptRecord& prompt,
                   std::vector<reuse::Value> blocks) {
    const model::ModelConfig& cfg = model_->config();
    model::Sampler sampler(sampling);
    sampler.set_prompt(tokens);
    const int32_t first = sampler.sample(prompt.logits.data(), cfg.vocab_size);
    const std::string finish = model::finish_after(first, 1, static_cast<int64_t>(tokens.size()),
                                                   sampling, eos_, cfg.max_position_embeddings);
    zmq::message_t kv;  // shared by the messages that carry it (zmq_msg_copy: no copy)
    uint64_t sum = 0;
    const bool goes_on = finish.empty();
    if (goes_on) {
      if (!prompt.tail_kv.empty())
        blocks.push_back(std::make_shared<const std::string>(prompt.tail_kv));
      kv = concatenate(blocks, sum);
    }
    const size_t kv_blocks = blocks.size();
    // The PrefillDone with the KV (for decode, or a gateway without routes) or without it.
    auto build = [&](bool with_kv, const flatbuffers::Vector<uint8_t>* ticket) {
      flatbuffers::FlatBufferBuilder builder(512 + tokens.size() * 4);
      std::vector<zmq::message_t> bulk;
      flatbuffers::Offset<wire::KvLayout> kv_layout = 0;
      flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
      if (with_kv && goes_on) {
        bulk.emplace_back().copy(kv);
        frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
            wire::CreateBulkFrame(builder, kv.size(), sum)});
        kv_layout = layout(builder, kv_blocks);
      }
      auto token_vector = with_kv ? builder.CreateVector(tokens) : 0;
      auto finish_text = builder.CreateString(finish);
      auto sampling_offset = to_wire(builder, sampling);
      auto name_space =
          builder.CreateString(job.cache_namespace() ? job.cache_namespace()->str() : "");
      auto replica = builder.CreateString(service_.log.replica());
      auto level = builder.CreateString("full");
      auto logprobs =
          logprobs_to_wire(builder, prompt.logits.data(), cfg.vocab_size, first, sampling);
      auto ticket_vector = ticket ? builder.CreateVector(ticket->data(), ticket->size()) : 0;
      builder.Finish(
          wire::CreatePrefillDone(builder, job.request_id(), job.attempt(), token_vector, first,
                                  finish_text, sampling_offset, name_space, kv_layout, frames, 0,
                                  replica, level, static_cast<uint32_t>(tokens.size()), 0, false,
                                  0.0f, false, logprobs, ticket_vector),
          wire::PrefillJobIdentifier());
      return wire::encode(wire::MessageType::PrefillDone, builder, std::move(bulk));
    };
    router_->send_done(job, goes_on, build);
  }

  runtime::StageService service_;
  runtime::Registry& metrics_;
  zmq::context_t context_{1};
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<reuse::SnapshotStore> store_;
  std::unique_ptr<runtime::HubLink> link_;
  std::unique_ptr<runtime::ZapHandler> zap_;  // with Curve; outlives the intake
  std::unique_ptr<runtime::Intake> intake_;
  std::unique_ptr<runtime::PeerSender> peers_;
  std::unique_ptr<PlanRouter> router_;
  size_t block_bytes_ = 0;
  std::vector<int32_t> eos_;
  uint32_t credits_ = 64;
  runtime::Counter *lookups_ = nullptr, *lookup_tokens_ = nullptr, *puts_ = nullptr;
  std::map<std::string, runtime::Counter*> hits_, hit_tokens_, outcomes_;
  std::map<std::string, runtime::Gauge*> bytes_, entries_, store_counters_;
  runtime::Histogram *latency_ = nullptr, *batch_ = nullptr;
  runtime::Gauge* queue_depth_ = nullptr;

  // Approximate reuse.
  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  std::unordered_map<int32_t, std::string> token_texts_;
  reuse::SignatureOptions signature_options_;
  int64_t signature_layers_ = 0, max_signature_tokens_ = 0;
  int signature_dimension_ = 0;
  double recompute_fraction_ = 0.15;
  Metric metric_ = Metric::kCosine;
  std::unique_ptr<kernels::ThreadPool> pool_;
  std::unique_ptr<offload::ResidentExpertProvider> experts_;
  std::unique_ptr<model::KvCache> cache_;
  std::unique_ptr<model::Engine> engine_;
  std::unique_ptr<reuse::SignatureAccumulator> accumulator_, whole_accumulator_;
  model::RouterFanout observers_;
  std::unique_ptr<reuse::SimilarityIndex> index_;
  std::unique_ptr<reuse::SnapshotStore> signatures_;
  std::unique_ptr<reuse::DecisionRule> rule_;
  std::set<std::string> namespaces_;
  uint64_t next_sequence_id_ = 1;
  runtime::RateLimited refusal_log_, spill_failure_log_;
  uint64_t spill_failures_logged_ = 0;
  std::map<std::string, runtime::Counter*> approximate_, candidates_, served_, checks_;
  runtime::Gauge *agreement_ = nullptr, *error_estimate_ = nullptr, *index_entries_ = nullptr,
                 *index_tombstones_ = nullptr, *index_rebuilds_ = nullptr;
  runtime::Histogram *signature_seconds_ = nullptr, *shadow_kl_ = nullptr;
  std::map<std::string, runtime::Counter*> top1_;
  std::unordered_map<uint64_t, uint64_t> pending_kl_;  // shadowed prompt's entry -> donor
  std::unordered_map<uint64_t, reuse::RouterSums> block_sums_;
  std::deque<uint64_t> block_sums_order_;
  size_t block_sums_width_ = 1;  // values per block's sums: signature layers x experts
  uint64_t signature_puts_ = 0;
  runtime::Counter* prefix_imports_ = nullptr;
  runtime::Counter* refused_records_ = nullptr;
};

std::vector<runtime::ConfigKey> probe_keys() {
  std::vector<runtime::ConfigKey> keys = worker_keys();
  for (const runtime::ConfigKey& key : intake_keys()) keys.push_back(key);
  keys.push_back({"queue", "64", "jobs this probe accepts at once (its credit)"});
  keys.push_back({"store-ram-bytes", "256MiB", "RAM tier budget of the snapshot store"});
  keys.push_back({"store-disk-bytes", "4GiB", "disk tier budget (RocksDB)"});
  keys.push_back({"store-disk-reserve", "64MiB",
                  "free space the disk tier leaves on its file system: below it nothing spills, "
                  "and a store is opened without its disk tier"});
  keys.push_back({"store-path", "",
                  "disk tier folder (empty: no disk tier); {replica} becomes the replica's name "
                  "(one folder each where probes share a volume)"});
  keys.push_back(
      {"store-policy", "slru", "RAM eviction: slru (segmented LRU, scan-resistant) or lru"});
  for (const runtime::ConfigKey& key : signature_keys()) keys.push_back(key);
  keys.push_back(
      {"signature-max-tokens", "4096",
       "longest prompt a lookup computes a signature for (longer: no approximate reuse)"});
  keys.push_back({"signature-store-bytes", "64MiB",
                  "RAM budget of the signature records (disk: store-path/signatures)"});
  keys.push_back({"index-m", "32", "HNSW M (links per node)"});
  keys.push_back({"index-ef-construction", "200", "HNSW efConstruction"});
  keys.push_back({"index-ef-search", "64", "HNSW efSearch"});
  keys.push_back({"approximate-metric", "cosine",
                  "signature similarity: cosine, euclidean (as 1 - distance / 2) or jaccard (over "
                  "the chosen experts per layer)"});
  keys.push_back({"approximate-threshold", "0.93",
                  "candidates at signature similarity >= this (in --approximate-metric)"});
  keys.push_back({"approximate-max-error", "0.01",
                  "delta: serve a cell's candidates only while the upper 95% bound of its "
                  "false-reuse rate is at most this"});
  keys.push_back({"approximate-shadow-fraction", "0.05",
                  "share of served approximate hits also computed in full and compared"});
  keys.push_back({"approximate-bin-width", "0.01", "similarity bins of the decision rule's cells"});
  keys.push_back({"approximate-recompute-fraction", "0.15",
                  "blended reuse recomputes this share of the donor's tokens (most deviating)"});
  return keys;
}

int probe_body(const runtime::Config& config) {
  return Probe(config).run();
}

}  // namespace

int probe_main(int argc, char** argv) {
  return run_stage("probe", probe_keys(), argc, argv, probe_body);
}

}  // namespace moeline::stages
