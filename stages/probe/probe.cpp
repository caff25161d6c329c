#include "stages/probe/probe.h"
#include "stages/probe/answers.h"
#include "stages/probe/approximate_lookup.h"
#include "stages/probe/probe_metrics.h"
#include "stages/probe/probe_settings.h"
#include "stages/probe/routing.h"
#include "stages/probe/store_intake.h"
#include "stages/probe/stored_kv.h"

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

class Probe {
 public:
  explicit Probe(const runtime::Config& config)
      : service_("probe", replica_name(config, "probe")),
        registry_(service_.metrics),
        metrics_(registry_) {
    runtime::StageService::install_signal_handlers();
    service_.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
    auto loaded = model::Model::load(config.text("model"));
    if (!loaded) throw std::runtime_error(loaded.error().message);
    model_ = std::move(*loaded);
    const model::ModelConfig& cfg = model_->config();
    block_bytes_ = model::KvCache::bytes_per_token(cfg) * model::kBlockTokens;

    const probe::ProbeSettings settings =
        probe::ProbeSettings::from(config, service_.log.replica());
    const reuse::StoreOptions& options = settings.store;
    store_ = open_store(options, "snapshots", registry_, service_.log);
    service_.log.info("store_opened",
                      {{"ram_bytes", options.ram_bytes},
                       {"disk_bytes", options.disk_bytes},
                       {"disk_path", options.disk_path.empty() ? "(none)" : options.disk_path},
                       {"disk_entries", store_->stats().disk_entries},
                       {"policy", settings.store_policy}});

    approximate_ = std::make_unique<ApproximateLookup>(config, *model_, *store_, options, metrics_,
                                                       registry_, service_.log);

    service_.start_http(config.text("http"), config.text("port-file"));
    credits_ = settings.queue_capacity;
    configure_io_threads(context_, config);
    const runtime::LinkSettings link = link_settings(
        config, wire::StageKind::Probe, service_.log.replica(), *model_, service_.http_port());
    link_ = std::make_unique<runtime::HubLink>(context_, link, service_.log, registry_);
    // Snapshot puts come from prefill straight to this intake (the gateway never relays them).
    if (link.curve_keys)
      zap_ = std::make_unique<runtime::ZapHandler>(context_, service_.log, registry_);
    intake_ = open_intake(context_, config, link, "probe", service_.log, registry_, zap_.get());
    link_->set_intake(intake_->endpoint(), intake_->public_key(), intake_->node());
    service_.advertise("intake", intake_->endpoint());
    peers_ = std::make_unique<runtime::PeerSender>(
        context_, link.curve_keys, shared_bulk_settings(config), registry_, service_.log);
    router_ = std::make_unique<PlanRouter>(*link_, *peers_, *intake_);
    answers_ = std::make_unique<ProbeAnswers>(*model_, *router_, *link_, service_.log.replica(),
                                              approximate_->recompute_fraction());
    store_intake_ = std::make_unique<StoreIntake>(*store_, *approximate_, *intake_, *link_,
                                                  metrics_, service_.log, block_bytes_);
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
        while (auto put = intake_->receive())
          service_.guard("probe", [&] { store_intake_->on_intake(*put); });
        auto message = link_->receive(wait_ms, &intake_->socket());
        if (!message) {
          if (intake_->pending()) continue;
          break;
        }
        service_.guard("probe", [&] { dispatch(*message); });
        ++handled;
      }
      if (handled) metrics_.batch->observe(handled);
      update_gauges();
    }
    store_->flush();
    approximate_->flush();
    service_.log.info("stopped", {{"disk_entries", store_->stats().disk_entries}});
    return 0;
  }

 private:
  void update_gauges() {
    const reuse::StoreStats& s = store_->stats();
    metrics_.bytes["ram"]->set(static_cast<double>(s.ram_bytes));
    metrics_.bytes["disk"]->set(static_cast<double>(s.disk_bytes));
    metrics_.entries["ram"]->set(static_cast<double>(s.ram_entries));
    metrics_.entries["disk"]->set(static_cast<double>(s.disk_entries));
    metrics_.store_counters["evictions"]->set(static_cast<double>(s.evictions));
    metrics_.store_counters["spills"]->set(static_cast<double>(s.spills));
    metrics_.store_counters["restores"]->set(static_cast<double>(s.restores));
    metrics_.store_counters["disk_evictions"]->set(static_cast<double>(s.disk_evictions));
    metrics_.store_counters["corrupt_entries"]->set(static_cast<double>(s.corrupt));
    metrics_.store_counters["spill_failures"]->set(static_cast<double>(s.spill_failures));
    // A directory walk each: every few seconds, not every turn of the loop.
    if (const auto now = Clock::now(); now >= next_disk_walk_) {
      next_disk_walk_ = now + kDiskWalkInterval;
      metrics_.disk_file_bytes["snapshots"]->set(static_cast<double>(store_->disk_file_bytes()));
      metrics_.disk_file_bytes["signatures"]->set(
          static_cast<double>(approximate_->signatures().disk_file_bytes()));
    }
    // A failed spill drops its entry (the disk refused it); said once per new failure, at most
    // once a second.
    const uint64_t failures = s.spill_failures + approximate_->signatures().stats().spill_failures;
    if (failures > spill_failures_logged_) {
      if (uint64_t suppressed = 0; spill_failure_log_.allow(suppressed)) {
        const reuse::SnapshotStore& failing =
            s.spill_failures > 0 ? *store_ : approximate_->signatures();
        service_.log.error("store_spill_failed", {{"path", failing.options().disk_path},
                                                  {"failures", failures},
                                                  {"error", failing.disk_error()}});
        spill_failures_logged_ = failures;
      }
    }
    metrics_.queue_depth->set(0);
    approximate_->update_gauges();
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

  void on_probe_job(wire::Message& message) { lookup(*message.as<wire::ProbeJob>()); }
  void on_snapshot_put(wire::Message& message) { store_intake_->put(message); }
  void ignore(wire::Message&) {}

  void lookup(const wire::ProbeJob& job) {
    const auto start = Clock::now();
    // The job's credit rides on its answer (or goes back when the probe next waits, whatever the
    // lookup does, an exception included).
    link_->grant(1);
    std::vector<int32_t> tokens;
    if (job.tokens()) tokens.assign(job.tokens()->begin(), job.tokens()->end());
    const std::string name_space = job.cache_namespace() ? job.cache_namespace()->str() : "";
    const uint64_t ns = model::namespace_id(name_space);
    const uint64_t model_id = reuse_model_key(model_->model_id());
    const std::vector<uint64_t> chain = reuse::block_chain(tokens, model_id, ns);
    const uint64_t key = reuse::prompt_key(tokens, chain, model_id, ns);
    const uint32_t allowed = job.allowed_levels();
    const model::SamplingParams sampling = from_wire(job.sampling());
    metrics_.lookups->inc();
    metrics_.lookup_tokens->inc(static_cast<double>(tokens.size()));

    using wire::ApproximateOutcome, wire::ReuseLevel, wire::ShadowMode;
    ReuseLevel level = ReuseLevel::None;
    if (!tokens.empty() && (allowed & reuse::kResult)) {
      if (reuse::Value value = store_->get(reuse::result_entry(key, sampling))) {
        if (auto result = reuse::decode_result(*value); result && !result->tokens.empty()) {
          answers_->answer_result(job, tokens, *result);
          return done(ReuseLevel::Result, tokens.size(), start);
        }
      }
    }
    if (!tokens.empty() && (allowed & reuse::kFull)) {
      if (reuse::Value value = store_->get(reuse::prompt_entry(key))) {
        auto prompt = reuse::decode_prompt(*value, static_cast<size_t>(model_->config().vocab_size),
                                           block_bytes_);
        std::vector<reuse::Value> blocks =
            prompt ? cached_prefix(*store_, chain, chain.size(), block_bytes_)
                   : std::vector<reuse::Value>{};
        if (prompt && blocks.size() == chain.size() &&
            answers_->answer_full(job, tokens, sampling, *prompt, std::move(blocks)))
          return done(ReuseLevel::Full, tokens.size(), start);
      }
    }
    size_t reused_blocks = 0;
    std::vector<reuse::Value> blocks;
    if (allowed & reuse::kPrefix) {
      // Prefill must compute at least the last token (it samples from its logits).
      const size_t limit = tokens.empty() ? 0 : (tokens.size() - 1) / model::kBlockTokens;
      blocks = cached_prefix(*store_, chain, limit, block_bytes_);
      reused_blocks = blocks.size();
      if (reused_blocks > 0) level = ReuseLevel::Prefix;
    }
    ApproximateResult approximate_outcome;
    if (!tokens.empty() && (allowed & reuse::kApproximateLevels)) {
      approximate_outcome = approximate_->lookup(
          tokens, name_space, key, sampling, allowed,
          static_cast<int64_t>(reused_blocks * model::kBlockTokens), chain, blocks);
      metrics_.approximate[approximate_outcome.outcome]->inc();
      const ApproximateResult& a = approximate_outcome;
      const bool shadow = a.outcome == ApproximateOutcome::Shadow;
      if (shadow && a.shadow_mode == ShadowMode::Response)
        approximate_->expect_first_tokens(key, a.donor);
      if (a.outcome == ApproximateOutcome::Response) {
        answers_->answer_result(job, tokens, a.donor_result, &a);
        return done(ReuseLevel::Response, tokens.size(), start);
      }
      if (a.outcome == ApproximateOutcome::Blend ||
          (shadow && a.shadow_mode == ShadowMode::Blend)) {
        answers_->send_blend(job, approximate_outcome, start, blocks,
                             reused_blocks > 0 ? chain[reused_blocks - 1] : a.donor);
        // How many tokens a blend reuses is prefill's to decide; a blend's plan carries no exact
        // prefix (a shadowed blend is computed in full).
        return done(shadow ? ReuseLevel::None : ReuseLevel::Blend, 0, start, tokens.size());
      }
    }
    answers_->send_plan(job, level, blocks, reused_blocks > 0 ? chain[reused_blocks - 1] : 0,
                        approximate_outcome, start);
    done(level, reused_blocks * model::kBlockTokens, start, tokens.size());
  }

  void done(wire::ReuseLevel level, size_t reused, Clock::time_point start,
            size_t prompt_tokens = 0) {
    const bool none = level == wire::ReuseLevel::None;
    metrics_.hits[level]->inc();
    metrics_.outcomes[level]->inc();
    metrics_.hit_tokens[level]->inc(static_cast<double>(none ? prompt_tokens : reused));
    if (!none && prompt_tokens > reused)
      metrics_.hit_tokens[wire::ReuseLevel::None]->inc(static_cast<double>(prompt_tokens - reused));
    metrics_.latency->observe(std::chrono::duration<double>(Clock::now() - start).count());
  }

  runtime::StageService service_;
  runtime::Registry& registry_;
  ProbeMetrics metrics_;
  zmq::context_t context_{1};
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<reuse::SnapshotStore> store_;
  std::unique_ptr<runtime::HubLink> link_;
  std::unique_ptr<runtime::ZapHandler> zap_;  // with Curve; outlives the intake
  std::unique_ptr<runtime::Intake> intake_;
  std::unique_ptr<runtime::PeerSender> peers_;
  std::unique_ptr<PlanRouter> router_;
  size_t block_bytes_ = 0;
  uint32_t credits_ = 64;
  std::unique_ptr<ApproximateLookup> approximate_;
  std::unique_ptr<StoreIntake> store_intake_;
  std::unique_ptr<ProbeAnswers> answers_;
  runtime::RateLimited spill_failure_log_;
  uint64_t spill_failures_logged_ = 0;
  static constexpr auto kDiskWalkInterval = std::chrono::seconds(5);
  Clock::time_point next_disk_walk_{};
};

int probe_body(const runtime::Config& config) {
  return Probe(config).run();
}

}  // namespace

int probe_main(int argc, char** argv) {
  return run_stage("probe", probe::probe_keys(), argc, argv, probe_body);
}

}  // namespace moeline::stages
