#include "stages/offload_manager/offload_manager.h"

#include <unistd.h>
#include <cmath>
#include <functional>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <type_traits>

#include "offload/expert_pool.h"
#include "offload/router_health.h"

#include "model/model.h"
#include "stages/common/common.h"
#include "stages/offload_manager/offload_metrics.h"
#include "stages/offload_manager/offload_settings.h"
#include "stages/runtime/dispatch.h"
#include "stages/runtime/link.h"
#include "stages/runtime/service.h"

namespace moeline::stages {
namespace {

// The node's pool name when none is configured: one per model and hub, so two stacks on a node
// (another model, or the same model behind another gateway) never share or fight over a pool.
std::string default_pool_name(uint64_t model_id, const std::string& hub) {
  std::ostringstream name;
  name << "/moeline-pool-" << std::hex << std::setw(16) << std::setfill('0') << model_id << '-'
       << std::setw(8) << (std::hash<std::string>{}(hub)&0xffffffffu);
  return name.str();
}

// The pool's node-wide counters on /metrics: monotonic totals become counter increments.
class PoolMetrics {
 public:
  PoolMetrics(runtime::Registry& metrics, int64_t layers) {
    const runtime::Labels host = {{"tier", "host"}};
    hits_ = &metrics.counter(offload_metric::kExpertHitsTotal, host);
    misses_ = &metrics.counter(offload_metric::kExpertMissesTotal, host);
    joined_ = &metrics.counter(offload_metric::kExpertJoinedTotal, host);
    loads_ = &metrics.counter(offload_metric::kExpertLoadsTotal, host);
    evictions_ = &metrics.counter(offload_metric::kExpertEvictionsTotal, host);
    bytes_ =
        &metrics.counter(offload_metric::kBytesMovedTotal, {{"tier", "host"}, {"from", "disk"}});
    load_seconds_ = &metrics.counter(offload_metric::kExpertLoadSecondsTotal, host);
    stall_seconds_ = &metrics.counter(offload_metric::kStallSecondsTotal, host);
    prefetch_requests_ = &metrics.counter(offload_metric::kPrefetchRequestsTotal);
    prefetch_used_ = &metrics.counter(offload_metric::kPrefetchUsedTotal);
    prefetch_late_ = &metrics.counter(offload_metric::kPrefetchLateTotal);
    prefetch_dropped_ = &metrics.counter(offload_metric::kPrefetchDroppedTotal);
    reclaimed_ = &metrics.counter(offload_metric::kClientsReclaimedTotal);
    hit_ratio_ = &metrics.gauge(offload_metric::kExpertHitRatio, host);
    precision_ = &metrics.gauge(offload_metric::kPrefetchPrecision);
    resident_ = &metrics.gauge(offload_metric::kExpertsResident, host);
    slots_ = &metrics.gauge(offload_metric::kExpertSlots, host);
    std::vector<double> bounds;  // the pool's buckets: powers of two microseconds
    for (int i = 0; i < offload::PoolStats::kLoadBuckets - 1; ++i)
      bounds.push_back(std::ldexp(1.0, i) * 1e-6);
    load_time_ = &metrics.histogram(offload_metric::kExpertLoadSeconds, bounds, host);
    recall_ = &metrics.gauge(offload_metric::kPrefetchRecall);
    bytes_per_token_ = &metrics.gauge(offload_metric::kBytesPerToken, host);
    stall_per_token_ = &metrics.gauge(offload_metric::kStallSecondsPerToken);
    experts_per_token_ = &metrics.gauge(offload_metric::kExpertsPerToken);
    direct_ = &metrics.gauge(offload_metric::kDirectIo);
    for (int64_t l = 0; l < layers; ++l)
      layer_ratio_.push_back(&metrics.gauge(offload_metric::kLayerHitRatio,
                                            {{"tier", "host"}, {"layer", std::to_string(l)}}));
  }

  void update(const offload::PoolStats& s, double routed_tokens) {
    auto delta = [](runtime::Counter* counter, uint64_t now, uint64_t& before) {
      if (now > before) counter->inc(static_cast<double>(now - before));
      before = now;
    };
    delta(hits_, s.hits, last_.hits);
    delta(misses_, s.misses, last_.misses);
    delta(joined_, s.joined, last_.joined);
    delta(loads_, s.loads, last_.loads);
    delta(evictions_, s.evictions, last_.evictions);
    delta(bytes_, s.bytes_loaded, last_.bytes_loaded);
    delta(prefetch_requests_, s.prefetch_requests, last_.prefetch_requests);
    delta(prefetch_used_, s.prefetch_used, last_.prefetch_used);
    delta(prefetch_late_, s.prefetch_late, last_.prefetch_late);
    delta(prefetch_dropped_, s.prefetch_dropped, last_.prefetch_dropped);
    delta(reclaimed_, s.clients_reclaimed, last_.clients_reclaimed);
    if (s.load_ns > last_.load_ns)
      load_seconds_->inc(static_cast<double>(s.load_ns - last_.load_ns) * 1e-9);
    if (s.stall_ns > last_.stall_ns)
      stall_seconds_->inc(static_cast<double>(s.stall_ns - last_.stall_ns) * 1e-9);
    last_.load_ns = s.load_ns;
    last_.stall_ns = s.stall_ns;
    hit_ratio_->set(s.hit_ratio());
    precision_->set(s.prefetch_loads ? static_cast<double>(s.prefetch_used) /
                                           static_cast<double>(s.prefetch_loads)
                                     : 0.0);
    resident_->set(static_cast<double>(s.resident));
    slots_->set(static_cast<double>(s.slots));
    for (size_t i = 0; i < s.load_us_buckets.size(); ++i) {
      // New loads of bucket i, observed at the bucket's middle (1.5 * 2^(i-1) µs).
      const double value = (i == 0 ? 0.5 : 0.75 * std::ldexp(1.0, static_cast<int>(i))) * 1e-6;
      for (uint64_t n = last_buckets_[i]; n < s.load_us_buckets[i]; ++n) load_time_->observe(value);
      last_buckets_[i] = s.load_us_buckets[i];
    }
    const uint64_t needed = s.misses + s.prefetch_used - std::min(s.prefetch_late, s.misses);
    recall_->set(needed ? static_cast<double>(s.prefetch_used) / static_cast<double>(needed) : 0.0);
    if (routed_tokens > 0) {
      bytes_per_token_->set(static_cast<double>(s.bytes_loaded) / routed_tokens);
      stall_per_token_->set(static_cast<double>(s.stall_ns) * 1e-9 / routed_tokens);
      experts_per_token_->set(static_cast<double>(s.hits + s.misses) / routed_tokens);
    }
    direct_->set(static_cast<double>(s.direct_io));
    for (size_t l = 0; l < layer_ratio_.size() && l < s.layer_hits.size(); ++l) {
      const uint64_t total = s.layer_hits[l] + s.layer_misses[l];
      layer_ratio_[l]->set(total ? static_cast<double>(s.layer_hits[l]) / static_cast<double>(total)
                                 : 1.0);
    }
  }

 private:
  offload::PoolStats last_;
  runtime::Counter *hits_, *misses_, *joined_, *loads_, *evictions_, *bytes_, *load_seconds_,
      *stall_seconds_, *prefetch_requests_, *prefetch_used_, *prefetch_late_, *prefetch_dropped_,
      *reclaimed_;
  runtime::Gauge *hit_ratio_, *precision_, *resident_, *slots_, *direct_, *recall_,
      *bytes_per_token_, *stall_per_token_, *experts_per_token_;
  runtime::Histogram* load_time_;
  std::array<uint64_t, offload::PoolStats::kLoadBuckets> last_buckets_{};
  std::vector<runtime::Gauge*> layer_ratio_;
};

// Router health from the compute processes' usage reports: per layer and expert counters, the
// health of each layer (logged when it changes) and its gauges; read by /healthz from the HTTP
// thread, hence the lock.
class RouterHealthMonitor {
 public:
  RouterHealthMonitor(runtime::Registry& metrics, runtime::Logger& log, int64_t layers,
                      int64_t experts, const offload::RouterHealthOptions& options)
      : log_(log),
        layers_(layers),
        experts_(experts),
        health_(static_cast<int>(layers), static_cast<int>(experts), options),
        routed_(&metrics.counter(offload_metric::kRoutedTokensTotal)) {
    per_expert_.resize(static_cast<size_t>(layers * experts));
    for (int64_t l = 0; l < layers; ++l) {
      const runtime::Labels layer_label = {{"layer", std::to_string(l)}};
      imbalance_.push_back(&metrics.gauge(offload_metric::kLoadImbalance, layer_label));
      confidence_.push_back(&metrics.gauge(offload_metric::kRouterConfidence, layer_label));
      state_.push_back(&metrics.gauge(offload_metric::kRouterHealth, layer_label));
      router_seconds_.push_back(&metrics.counter(offload_metric::kRouterSecondsTotal, layer_label));
      for (int64_t e = 0; e < experts; ++e)
        per_expert_[static_cast<size_t>(l * experts + e)] =
            &metrics.counter(offload_metric::kExpertTokensTotal,
                             {{"layer", std::to_string(l)}, {"expert", std::to_string(e)}});
    }
  }

  double routed_tokens() const { return routed_->value(); }

  void record(const wire::ExpertUsage& usage) {
    if (usage.layers() != layers_ || usage.experts() != experts_ || !usage.counts() ||
        usage.counts()->size() != per_expert_.size()) {
      log_.warn("usage_shape_mismatch", {{"layers", usage.layers()}});
      return;
    }
    const std::vector<uint64_t> counts(usage.counts()->begin(), usage.counts()->end());
    for (size_t i = 0; i < counts.size(); ++i) per_expert_[i]->inc(static_cast<double>(counts[i]));
    routed_->inc(static_cast<double>(usage.tokens()));
    auto to_vector = [](const auto* v) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(v)>>;
      return v ? std::vector<typename T::return_type>(v->begin(), v->end())
               : std::vector<typename T::return_type>{};
    };
    const auto layer_tokens = to_vector(usage.layer_tokens());
    const auto confidence_sum = to_vector(usage.confidence_sum());
    const auto seconds = to_vector(usage.router_seconds());
    std::lock_guard lock(mutex_);
    for (int l : health_.add(counts, layer_tokens, confidence_sum, seconds)) {
      const offload::LayerHealth& h = health_.layers()[static_cast<size_t>(l)];
      const std::initializer_list<runtime::LogField> fields = {
          {"layer", l},
          {"state", offload::health_state_name(h.state)},
          {"reason", h.reason},
          {"imbalance", h.imbalance()},
          {"confidence", h.confidence()}};
      if (h.state == offload::HealthState::kOk) {
        log_.info("router_health", fields);
      } else {
        log_.warn("router_health", fields);
      }
    }
    for (size_t l = 0; l < health_.layers().size(); ++l) {
      const offload::LayerHealth& h = health_.layers()[l];
      imbalance_[l]->set(h.imbalance());
      confidence_[l]->set(h.confidence());
      state_[l]->set(static_cast<double>(h.state));
      if (l < seconds.size() && seconds[l] > 0) router_seconds_[l]->inc(seconds[l]);
    }
  }

  // The router health as /healthz shows it (and `moeline experts` draws it).
  nlohmann::json json() const {
    std::lock_guard lock(mutex_);
    nlohmann::json router = nlohmann::json::array();
    for (const offload::LayerHealth& h : health_.layers())
      router.push_back({{"counts", h.counts},
                        {"tokens", h.total_tokens},
                        {"imbalance", h.imbalance()},
                        {"confidence", h.confidence()},
                        {"router_seconds", h.total_router_seconds},
                        {"state", offload::health_state_name(h.state)},
                        {"reason", h.reason}});
    return router;
  }

 private:
  runtime::Logger& log_;
  const int64_t layers_, experts_;
  mutable std::mutex mutex_;
  offload::RouterHealth health_;
  runtime::Counter* routed_;
  std::vector<runtime::Counter*> per_expert_, router_seconds_;
  std::vector<runtime::Gauge*> imbalance_, confidence_, state_;
};

// What the offload manager answers on its link, through a handler table: an expert plan for a
// compute process that joins, and the usage reports compute processes send.
class ExpertRequests {
 public:
  ExpertRequests(runtime::HubLink& link, RouterHealthMonitor& health, runtime::Counter& plans,
                 std::function<flatbuffers::Offset<wire::ExpertPlan>(
                     flatbuffers::FlatBufferBuilder&, const std::string& requester)>
                     make_plan)
      : link_(link), health_(health), plans_(plans), make_plan_(std::move(make_plan)) {}

  // False when the message is not one the offload manager takes.
  bool dispatch(wire::Message& message) {
    static constexpr runtime::HandlerTable<ExpertRequests, 2, wire::Message&> kHandlers({
        {wire::MessageType::ExpertPlanRequest, &ExpertRequests::on_plan_request},
        {wire::MessageType::ExpertUsage, &ExpertRequests::on_usage},
    });
    return kHandlers.dispatch(*this, message.type, message);
  }

 private:
  void on_plan_request(wire::Message& message) {
    const auto* request = message.as<wire::ExpertPlanRequest>();
    flatbuffers::FlatBufferBuilder builder(256);
    builder.Finish(make_plan_(builder, request->replica() ? request->replica()->str() : ""),
                   wire::ExpertPlanIdentifier());
    link_.send(wire::encode(wire::MessageType::ExpertPlan, builder));
    plans_.inc();
  }

  // Through the hub: from a compute process of an earlier minor, or one that has no plan yet.
  void on_usage(wire::Message& message) { health_.record(*message.as<wire::ExpertUsage>()); }

 public:
  // From the intake: a report counts only with the ticket of the plan its reporter was given
  // (whoever reaches the intake cannot skew the router statistics).
  void on_direct(runtime::Intake& intake, const runtime::HandoverKey& key, wire::Message& message) {
    if (message.type != wire::MessageType::ExpertUsage)
      return intake.refuse(message.type, "not_taken_here");
    const auto* usage = message.as<wire::ExpertUsage>();
    if (usage->reporter() == nullptr || usage->ticket() == nullptr ||
        !runtime::valid_reporter_ticket(key, usage->reporter()->string_view(),
                                        {usage->ticket()->data(), usage->ticket()->size()}))
      return intake.refuse(message.type, "bad_ticket");
    health_.record(*usage);
  }

 private:
  runtime::HubLink& link_;
  RouterHealthMonitor& health_;
  runtime::Counter& plans_;
  std::function<flatbuffers::Offset<wire::ExpertPlan>(flatbuffers::FlatBufferBuilder&,
                                                      const std::string&)>
      make_plan_;
};

int offload_body(const runtime::Config& config) {
  runtime::StageService::install_signal_handlers();
  runtime::StageService service("offload", replica_name(config, "offload"));
  service.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
  auto loaded = model::Model::load(config.text("model"));
  if (!loaded) throw std::runtime_error(loaded.error().message);
  const model::Model& model = **loaded;
  const model::ModelConfig& cfg = model.config();
  size_t expert_bytes = 0;
  for (const auto& layer : model.experts())
    for (const offload::ExpertWeights& expert : layer) expert_bytes += expert.bytes();
  // The host pool, when a budget is set; otherwise every compute process keeps every expert in
  // its own mapping of the checkpoint.
  std::unique_ptr<offload::ExpertPool> pool;
  uint64_t pool_bytes = 0;
  const OffloadSettings offload_settings = OffloadSettings::from(config);
  const uint32_t prefetch_depth = offload_settings.prefetch_depth;
  if (!offload_settings.expert_budget.empty()) {
    const offload::ExpertCatalog catalog = model.expert_catalog();
    pool_bytes =
        offload::parse_expert_budget(offload_settings.expert_budget, catalog.pool_bytes_for_all());
    std::string name = offload_settings.expert_pool;
    if (name.empty()) name = default_pool_name(model.model_id(), config.text("hub"));
    auto created =
        offload::ExpertPool::create(catalog, {.name = name,
                                              .budget_bytes = pool_bytes,
                                              .loader_threads = offload_settings.loader_threads,
                                              .direct_io = offload_settings.direct_io});
    if (!created) {
      const std::string reason = "--expert-budget: " + created.error().message;
      if (created.error().code == StatusCode::kInvalidArgument) throw runtime::ConfigError(reason);
      throw std::runtime_error(reason);
    }
    pool = std::move(*created);
    const offload::PoolStats stats = pool->stats();
    service.log.info("expert_pool", {{"name", name},
                                     {"budget_bytes", pool_bytes},
                                     {"expert_bytes", static_cast<uint64_t>(expert_bytes)},
                                     {"slots", stats.slots},
                                     {"slot_bytes", stats.slot_bytes},
                                     {"direct_io", stats.direct_io != 0},
                                     {"prefetch_depth", prefetch_depth}});
  }
  const int64_t layers = cfg.num_layers;
  const int64_t experts = std::max<int64_t>(1, cfg.num_experts);
  RouterHealthMonitor health(service.metrics, service.log, layers, experts,
                             offload_settings.router_health);
  service.start_http(config.text("http"), config.text("port-file"), [&] {
    nlohmann::json detail = {{"expert_pool", nullptr}};
    if (pool) {
      const offload::PoolStats s = pool->stats();
      detail["expert_pool"] = {
          {"name", pool->name()},       {"slots", s.slots},
          {"slot_bytes", s.slot_bytes}, {"resident", s.resident},
          {"pinned", s.pinned},         {"clients_reclaimed", s.clients_reclaimed},
          {"hit_ratio", s.hit_ratio()}, {"loads", s.loads},
          {"evictions", s.evictions},   {"direct_io", s.direct_io != 0},
          {"layer_hits", s.layer_hits}, {"layer_misses", s.layer_misses}};
    }
    detail["router"] = health.json();
    detail["router_decay"] = offload_settings.router_health.decay;
    detail["model"] = model_name(config.text("model"));
    return detail;
  });
  auto& metrics = service.metrics;
  metrics.gauge(offload_metric::kExpertBytes, {{"tier", "resident"}})
      .set(static_cast<double>(expert_bytes));
  std::unique_ptr<PoolMetrics> pool_metrics;
  if (pool) {
    metrics.gauge(offload_metric::kTierBudgetBytes, {{"tier", "host"}})
        .set(static_cast<double>(pool_bytes));
    pool_metrics = std::make_unique<PoolMetrics>(metrics, cfg.num_layers);
  }
  PrefetchSwitch prefetch_switch(offload_settings.prefetch_switch,
                                 pool != nullptr && prefetch_depth > 0, service.log, metrics);
  auto last_pool_update = std::chrono::steady_clock::now();
  auto& plans = metrics.counter(offload_metric::kPlansTotal);

  zmq::context_t context(1);
  configure_io_threads(context, config);
  runtime::LinkSettings settings = link_settings(config, wire::StageKind::OffloadManager,
                                                 service.log.replica(), model, service.http_port());
  runtime::HubLink link(context, settings, service.log, metrics);
  // Usage reports come straight from the compute processes (a plan names this intake and gives
  // each its ticket), so they never load the gateway.
  std::unique_ptr<runtime::ZapHandler> zap;
  if (settings.curve_keys)
    zap = std::make_unique<runtime::ZapHandler>(context, service.log, service.metrics);
  std::unique_ptr<runtime::Intake> intake =
      open_intake(context, config, settings, "offload", service.log, metrics, zap.get());
  service.advertise("intake", intake->endpoint());
  const runtime::HandoverKey usage_key = runtime::new_handover_key();
  ExpertRequests requests(
      link, health, plans,
      [&](flatbuffers::FlatBufferBuilder& builder, const std::string& requester) {
        const runtime::Ticket ticket = runtime::reporter_ticket(usage_key, requester);
        const std::vector<uint8_t> ticket_bytes(ticket.begin(), ticket.end());
        auto route = wire::CreatePeerRouteDirect(
            builder, service.log.replica().c_str(), intake->endpoint().c_str(),
            intake->public_key().c_str(), &ticket_bytes, intake->node().c_str());
        return wire::CreateExpertPlan(
            builder, model.model_id(), !pool, static_cast<uint32_t>(layers),
            static_cast<uint32_t>(experts), expert_bytes,
            builder.CreateString(pool ? "host_pool" : "resident"), builder.CreateString(requester),
            builder.CreateString(pool ? pool->name() : ""), pool_bytes, prefetch_depth, route);
      });

  while (!runtime::StageService::stop_requested()) {
    service.tick();
    if (link.rejected()) return 3;
    if (pool_metrics &&
        std::chrono::steady_clock::now() - last_pool_update > std::chrono::milliseconds(500)) {
      const offload::PoolStats stats = pool->stats();
      pool_metrics->update(stats, health.routed_tokens());
      last_pool_update = std::chrono::steady_clock::now();
      prefetch_switch.update(stats, *pool, last_pool_update);
    }
    if (link.needs_hello()) link.hello(1u << 20);
    service.set_ready(link.accepted());
    while (auto report = intake->receive())
      service.guard("offload_intake", [&] { requests.on_direct(*intake, usage_key, *report); });
    auto message = link.receive(100, &intake->socket());
    if (!message) continue;
    service.guard("offload", [&] {
      if (!requests.dispatch(*message))
        service.log.warn("unexpected_message", {{"type", wire::message_type_name(message->type)}});
    });
  }
  service.stop_http();  // /healthz reads `health`, which dies first
  service.log.info("stopped");
  return 0;
}

}  // namespace

int offload_main(int argc, char** argv) {
  return run_stage("offload", offload_keys(), argc, argv, offload_body);
}

}  // namespace moeline::stages
