#include "stages/gateway/gateway.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>

#include "model/kv_cache.h"
#include "model/model_info.h"
#include "model/model_text.h"
#include "reuse/approximate.h"
#include "reuse/policy.h"
#include "reuse/records.h"
#include "stages/common/common.h"
#include "stages/gateway/broker.h"
#include "stages/gateway/client_front.h"
#include "stages/gateway/client_requests.h"
#include "stages/gateway/control.h"
#include "stages/gateway/dispatcher.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/gateway_settings.h"
#include "stages/gateway/probe_ring.h"
#include "stages/gateway/request.h"
#include "stages/gateway/reuse_control.h"
#include "stages/gateway/stage_results.h"
#include "stages/gateway/tenant_limits.h"
#include "stages/gateway/tracker.h"
#include "stages/runtime/api_keys.h"
#include "stages/runtime/dispatch.h"
#include "stages/runtime/hub.h"
#include "stages/runtime/security.h"
#include "stages/runtime/service.h"
#include "stages/runtime/trace.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages {
namespace {

class Gateway {
 public:
  // /healthz reads members that die before `service_`.
  ~Gateway() { service_.stop_http(); }
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  explicit Gateway(const runtime::Config& config)
      : service_("gateway", replica_name(config, "gateway")),
        registry_(service_.metrics),
        metrics_(registry_),
        log_(service_.log),
        tenant_limiter_(registry_) {
    runtime::StageService::install_signal_handlers();
    runtime::StageService::set_drains(true);
    drain_grace_ =
        std::chrono::milliseconds(std::max<int64_t>(0, config.integer("drain-grace-ms")));
    service_.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
    // The config and the id only: the gateway runs no forward pass, so it binds no weight.
    auto loaded = model::load_model_info(config.text("model"));
    if (!loaded) throw std::runtime_error(loaded.error().message);
    model_ = std::move(*loaded);
    validator_ = std::make_unique<RequestValidator>(config, model_);
    const model::ModelConfig& cfg = model_.config;
    limits_.max_body_bytes = runtime::parse_bytes(config.text("max-message-bytes"));

    configure_io_threads(context_zmq_, config);
    curve_ = runtime::load_curve_settings(config.text("curve-dir"), "gateway");
    if (curve_.enabled())
      zap_ = std::make_unique<runtime::ZapHandler>(context_zmq_, log_, registry_);
    client_ = std::make_unique<ClientChannel>(context_zmq_, config, curve_, zap_.get(),
                                              limits_.max_body_bytes, metrics_, log_);
    hub_ = std::make_unique<runtime::Hub>(
        context_zmq_, config.text("hub-bind"), settings_hash(model_.model_id),
        static_cast<int>(config.integer("heartbeat-ms")),
        static_cast<int>(config.integer("peer-timeout-ms")), log_, registry_,
        runtime::HubSecurity{.max_message_bytes = max_stage_message_bytes(cfg),
                             .curve = &curve_,
                             .zap = zap_.get()});
    broker_ = std::make_unique<Broker>(*hub_, metrics_, log_);
    reuse_ = std::make_unique<ReuseControl>(reuse_settings(config), metrics_, log_, *broker_);
    tracker_ = std::make_unique<RequestTracker>(
        TrackerSettings{
            .max_retries = static_cast<uint32_t>(config.integer("max-retries")),
            .probe_timeout = std::chrono::milliseconds(config.integer("probe-timeout-ms")),
            .handover_timeout = std::chrono::milliseconds(config.integer("handover-timeout-ms"))},
        RequestTracker::Parts{*hub_, *broker_, *client_, *reuse_, tenant_limiter_,
                              validator_->tokenizer(), metrics_, log_});
    dispatcher_ =
        std::make_unique<Dispatcher>(*tracker_, *broker_, *hub_, metrics_,
                                     static_cast<size_t>(config.integer("max-decode-backlog")));
    results_ = std::make_unique<StageResults>(*tracker_, *broker_, *reuse_, *hub_, metrics_, log_,
                                              config.number("blend-max-kl"));
    control_ = std::make_unique<ControlCommands>(
        *reuse_, *hub_, log_,
        ControlHooks{.requests = [this] { return requests_json(); },
                     .drain_gateway =
                         [this] {
                           if (!draining_) begin_drain("operator");
                           return "the gateway is draining (" + std::to_string(tracker_->size()) +
                                  " in flight)";
                         }});
    requests_ = std::make_unique<ClientRequests>(
        ClientRequests::Parts{*client_, *validator_, tenant_limiter_, *reuse_, *control_, *tracker_,
                              metrics_, registry_, log_},
        model_, limits_, static_cast<size_t>(config.integer("max-in-flight")));
    for (const char* key : {"client-bind", "hub-bind"})
      if (runtime::is_tcp(config.text(key)) && !curve_.enabled())
        log_.warn("open_endpoint",
                  {{"endpoint", config.text(key)},
                   {"detail", "tcp:// without --curve-dir: anyone who reaches it may connect"}});
    metrics_.authenticated->set(curve_.enabled() ? 1 : 0);
    security_state_ = {{"curve", curve_.enabled()},
                       {"api_keys", validator_->keys_required()},
                       {"open", !validator_->keys_required()}};
    log_.info("listening", {{"client", config.text("client-bind")},
                            {"hub", config.text("hub-bind")},
                            {"model_id", model_.model_id},
                            {"settings_hash", settings_hash(model_.model_id)},
                            {"hub_max_message_bytes", max_stage_message_bytes(cfg)},
                            {"curve", curve_.enabled()},
                            {"api_keys", validator_->key_count()},
                            {"max_prompt_tokens", validator_->max_prompt_tokens()}});
    // Last: /healthz (another thread) reads what the lines above set.
    service_.start_http(config.text("http"), config.text("port-file"), [this] {
      return nlohmann::json{{"in_flight", in_flight_.load()},
                            {"approximate", reuse_->health()},
                            {"security", security_state_}};
    });
  }

  int run() {
    while (!runtime::StageService::stop_requested()) {
      service_.tick();
      zmq::pollitem_t items[] = {{client_->socket().handle(), 0, ZMQ_POLLIN, 0},
                                 {hub_->socket().handle(), 0, ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 2, std::chrono::milliseconds(10));
      } catch (const zmq::error_t&) {
        continue;  // a signal; the loop condition decides
      }
      // What this iteration makes for one client connection leaves as one message at its end.
      client_->hold_events();
      // Bounded bursts keep one side from starving the other.
      for (int i = 0; i < 256; ++i) {
        auto frames = wire::receive(client_->socket(), true);
        if (!frames) break;
        const std::string client = frames->empty() ? "" : frames->front().to_string();
        if (!service_.guard("client", [&] { requests_->on_frames(std::move(*frames)); }) &&
            !client.empty())
          service_.guard("client_error_reply", [&] {
            client_->reply_error(client, wire::ErrorCode::Internal,
                                 "the gateway could not handle it");
          });
      }
      for (int i = 0; i < 256; ++i) {
        auto incoming = hub_->receive();
        if (!incoming) break;
        service_.guard("stage", [&] { results_->on_stage(*incoming); });
      }
      for (const runtime::Peer& dead : hub_->tick()) tracker_->on_peer_lost(dead);
      if (auto error = validator_->reload_keys())
        log_.error("api_keys_not_reloaded", {{"error", *error}});
      tracker_->expire_deadlines();
      tracker_->bypass_slow_probes();
      reuse_->update();
      dispatcher_->dispatch();
      service_.set_ready(true);
      const bool done = drained();
      for (uint64_t gone : client_->flush_events()) tracker_->on_client_gone(gone);
      update_gauges();
      if (done) break;
    }
    log_.info("stopped", {{"in_flight", tracker_->size()}});
    return 0;
  }

  // SIGTERM or the `drain` command: no new requests; those in flight finish within the grace
  // period; the rest end with an explicit Draining error. True when the gateway may exit.
  bool drained() {
    if (!draining_ && runtime::StageService::drain_requested()) begin_drain("signal");
    if (!draining_) return false;
    if (tracker_->size() > 0 && Clock::now() < drain_until_) return false;
    const size_t left = tracker_->size();
    tracker_->fail_all(
        wire::ErrorCode::Draining, "drained",
        "the gateway is shutting down and the request did not finish in its grace period");
    log_.info("drained", {{"failed", left}});
    return true;
  }

  void begin_drain(const char* by) {
    draining_ = true;
    requests_->stop_admitting();
    drain_until_ = Clock::now() + drain_grace_;
    log_.info("drain_started",
              {{"by", by}, {"in_flight", tracker_->size()}, {"grace_ms", drain_grace_.count()}});
  }

 private:
  void update_gauges() {
    metrics_.probe_queue->set(static_cast<double>(tracker_->probe_queue.size()));
    metrics_.prefill_queue->set(static_cast<double>(tracker_->prefill_queue.size()));
    metrics_.decode_queue->set(static_cast<double>(tracker_->decode_queue.size()));
    metrics_.in_flight->set(static_cast<double>(tracker_->size()));
    in_flight_.store(tracker_->size());
    double used = 0, free = 0;
    for (const auto& [identity, peer] : hub_->peers()) {
      if (peer.stage != wire::StageKind::Decode) continue;
      used += peer.kv_used;
      free += peer.kv_free;
    }
    metrics_.kv_used->set(used);
    metrics_.kv_free->set(free);
  }

  // For `status`: the requests in flight, where each is (waiting in the gateway, or held by a
  // replica of some stage), and the gateway's queues.
  nlohmann::json requests_json() const {
    std::map<std::string, size_t> where = {
        {"queued", 0}, {"probe", 0}, {"prefill", 0}, {"decode", 0}};
    for (const auto& [id, r] : tracker_->requests()) {
      const runtime::Peer* owner = r.owner.empty() ? nullptr : hub_->peer(r.owner);
      ++where[owner ? wire::stage_name(owner->stage) : "queued"];
    }
    return {{"in_flight", tracker_->size()},
            {"requests", where},
            {"queues",
             {{"probe", tracker_->probe_queue.size()},
              {"prefill", tracker_->prefill_queue.size()},
              {"decode", tracker_->decode_queue.size()}}}};
  }

  runtime::StageService service_;
  runtime::Registry& registry_;
  GatewayMetrics metrics_;
  runtime::Logger& log_;
  TenantLimiter tenant_limiter_;
  nlohmann::json security_state_;  // set before /healthz starts, constant after
  zmq::context_t context_zmq_{1};
  runtime::CurveSettings curve_;
  std::unique_ptr<runtime::ZapHandler> zap_;  // before the sockets it admits: outlives them
  std::unique_ptr<ClientChannel> client_;
  std::unique_ptr<runtime::Hub> hub_;
  std::unique_ptr<Broker> broker_;
  model::ModelInfo model_;
  wire::Limits limits_;
  std::unique_ptr<RequestValidator> validator_;
  std::chrono::milliseconds drain_grace_{0};
  bool draining_ = false;
  Clock::time_point drain_until_;
  std::atomic<size_t> in_flight_{0};  // what /healthz reports

  // The parts, each after what it uses (and destroyed before it).
  std::unique_ptr<ReuseControl> reuse_;
  std::unique_ptr<ControlCommands> control_;
  std::unique_ptr<RequestTracker> tracker_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<StageResults> results_;
  std::unique_ptr<ClientRequests> requests_;
};

int gateway_body(const runtime::Config& config) {
  return Gateway(config).run();
}

}  // namespace

int gateway_main(int argc, char** argv) {
  return run_stage("gateway", gateway_keys(), argc, argv, gateway_body);
}

}  // namespace moeline::stages
