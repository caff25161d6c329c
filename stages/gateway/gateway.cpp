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
#include "model/model.h"
#include "model/model_text.h"
#include "reuse/approximate.h"
#include "reuse/policy.h"
#include "reuse/records.h"
#include "stages/common/common.h"
#include "stages/gateway/broker.h"
#include "stages/gateway/client_front.h"
#include "stages/gateway/control.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/probe_ring.h"
#include "stages/gateway/request.h"
#include "stages/gateway/reuse_control.h"
#include "stages/gateway/tenant_limits.h"
#include "stages/runtime/api_keys.h"
#include "stages/runtime/dispatch.h"
#include "stages/runtime/hub.h"
#include "stages/runtime/security.h"
#include "stages/runtime/service.h"
#include "stages/runtime/trace.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages {
namespace {

// The reuse policy's settings: --reuse-levels, --shared-tenants, --approximate-*, --shadow-tokens.
reuse::PolicySettings reuse_settings(const runtime::Config& config) {
  reuse::PolicySettings policy;
  policy.shared_tenants = runtime::parse_list(config.text("shared-tenants"));
  try {
    policy.default_levels = reuse::parse_levels(config.text("reuse-levels"));
  } catch (const std::invalid_argument& e) {
    throw runtime::ConfigError(std::string("--reuse-levels: ") + e.what());
  }
  reuse::RollbackOptions& rollback = policy.rollback;
  rollback.hit_window_s = config.number("approximate-hit-window-s");
  rollback.min_hit_rate = config.number("approximate-min-hit-rate");
  rollback.min_lookups = static_cast<uint64_t>(config.integer("approximate-min-lookups"));
  rollback.agreement_window_s = config.number("approximate-agreement-window-s");
  rollback.max_agreement_drop = config.number("approximate-max-agreement-drop");
  rollback.min_checks = static_cast<uint64_t>(config.integer("approximate-min-checks"));
  rollback.feedback_window_s = config.number("approximate-feedback-window-s");
  rollback.max_negative_feedback = config.number("approximate-max-negative-feedback");
  rollback.min_served = static_cast<uint64_t>(config.integer("approximate-min-served"));
  rollback.probation_s = config.number("approximate-probation-s");
  policy.approximate_enabled = config.flag("approximate-enabled");
  policy.shadow_tokens = static_cast<size_t>(std::max<int64_t>(1, config.integer("shadow-tokens")));
  return policy;
}

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
    max_retries_ = static_cast<uint32_t>(config.integer("max-retries"));
    probe_timeout_ = std::chrono::milliseconds(config.integer("probe-timeout-ms"));
    handover_timeout_ = std::chrono::milliseconds(config.integer("handover-timeout-ms"));
    max_in_flight_ = static_cast<size_t>(config.integer("max-in-flight"));
    max_decode_backlog_ = static_cast<size_t>(config.integer("max-decode-backlog"));
    limits_.max_body_bytes = runtime::parse_bytes(config.text("max-message-bytes"));
    blend_max_kl_ = config.number("blend-max-kl");

    configure_io_threads(context_zmq_, config);
    curve_ = runtime::load_curve_settings(config.text("curve-dir"), "gateway");
    if (curve_.enabled())
      zap_ = std::make_unique<runtime::ZapHandler>(context_zmq_, log_, registry_);
    client_ = std::make_unique<ClientChannel>(context_zmq_, config, curve_, zap_.get(),
                                              limits_.max_body_bytes, log_);
    hub_ = std::make_unique<runtime::Hub>(
        context_zmq_, config.text("hub-bind"), settings_hash(model_.model_id),
        static_cast<int>(config.integer("heartbeat-ms")),
        static_cast<int>(config.integer("peer-timeout-ms")), log_, registry_,
        runtime::HubSecurity{.max_message_bytes = max_stage_message_bytes(cfg),
                             .curve = &curve_,
                             .zap = zap_.get()});
    broker_ = std::make_unique<Broker>(*hub_, metrics_, log_);
    reuse_ = std::make_unique<ReuseControl>(reuse_settings(config), metrics_, log_, *broker_);
    control_ = std::make_unique<ControlCommands>(
        *reuse_, *hub_, log_,
        ControlHooks{.requests = [this] { return requests_json(); },
                     .drain_gateway =
                         [this] {
                           if (!draining_) begin_drain("operator");
                           return "the gateway is draining (" + std::to_string(requests_.size()) +
                                  " in flight)";
                         }});
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
      // Bounded bursts keep one side from starving the other.
      for (int i = 0; i < 256; ++i) {
        auto frames = wire::receive(client_->socket(), true);
        if (!frames) break;
        const std::string client = frames->empty() ? "" : frames->front().to_string();
        if (!service_.guard("client", [&] { on_client(std::move(*frames)); }) && !client.empty())
          service_.guard("client_error_reply", [&] {
            client_->reply_error(client, wire::ErrorCode::Internal,
                                 "the gateway could not handle it");
          });
      }
      for (int i = 0; i < 256; ++i) {
        auto incoming = hub_->receive();
        if (!incoming) break;
        service_.guard("stage", [&] { on_stage(*incoming); });
      }
      for (const runtime::Peer& dead : hub_->tick()) on_peer_lost(dead);
      if (auto error = validator_->reload_keys())
        log_.error("api_keys_not_reloaded", {{"error", *error}});
      expire_deadlines();
      bypass_slow_probes();
      reuse_->update();
      dispatch();
      service_.set_ready(true);
      update_gauges();
      if (drained()) break;
    }
    log_.info("stopped", {{"in_flight", requests_.size()}});
    return 0;
  }

  // SIGTERM or the `drain` command: no new requests; those in flight finish within the grace
  // period; the rest end with an explicit Draining error. True when the gateway may exit.
  bool drained() {
    if (!draining_ && runtime::StageService::drain_requested()) begin_drain("signal");
    if (!draining_) return false;
    if (!requests_.empty() && Clock::now() < drain_until_) return false;
    std::vector<uint64_t> left;
    for (const auto& [id, r] : requests_) left.push_back(id);
    for (uint64_t id : left)
      fail(requests_.at(id), wire::ErrorCode::Draining, "drained",
           "the gateway is shutting down and the request did not finish in its grace period");
    log_.info("drained", {{"failed", left.size()}});
    return true;
  }

  void begin_drain(const char* by) {
    draining_ = true;
    drain_until_ = Clock::now() + drain_grace_;
    log_.info("drain_started",
              {{"by", by}, {"in_flight", requests_.size()}, {"grace_ms", drain_grace_.count()}});
  }

 private:
  void update_gauges() {
    metrics_.probe_queue->set(static_cast<double>(probe_queue_.size()));
    metrics_.prefill_queue->set(static_cast<double>(prefill_queue_.size()));
    metrics_.decode_queue->set(static_cast<double>(decode_queue_.size()));
    metrics_.in_flight->set(static_cast<double>(requests_.size()));
    in_flight_.store(requests_.size());
    double used = 0, free = 0;
    for (const auto& [identity, peer] : hub_->peers()) {
      if (peer.stage != wire::StageKind::Decode) continue;
      used += peer.kv_used;
      free += peer.kv_free;
    }
    metrics_.kv_used->set(used);
    metrics_.kv_free->set(free);
  }

  // ---- to clients ----

  void reject(const std::string& client, uint64_t client_request_id, wire::ErrorCode code,
              const std::string& reason, const std::string& text) {
    metrics_.rejected(reason).inc();
    metrics_.outcome("rejected").inc();
    if (uint64_t suppressed = 0; reject_log_.allow(suppressed))
      log_.warn("request_rejected",
                {{"reason", reason}, {"detail", text}, {"suppressed", suppressed}});
    client_->send_event(client, client_request_id, 0, wire::EventKind::Error, {}, {}, {}, code,
                        text);
  }

  // ---- from clients ----

  void on_client(std::vector<zmq::message_t>&& frames) {
    if (frames.empty()) return;
    const std::string client = frames.front().to_string();
    frames.erase(frames.begin());
    wire::Decoded decoded = wire::decode(std::move(frames), limits_);
    if (decoded.error) {
      metrics_.rejected("frame_" + decoded.error->reason).inc();
      runtime::report_rejected_frame(registry_, log_, frame_log_, "client", *decoded.error);
      client_->reply_error(client,
                           decoded.error->reason == "version" ? wire::ErrorCode::VersionMismatch
                                                              : wire::ErrorCode::MalformedMessage,
                           decoded.error->detail);
      return;
    }
    static constexpr runtime::HandlerTable<Gateway, 4, const std::string&, wire::Message&>
        kClientHandlers({
            {wire::MessageType::GenerateRequest, &Gateway::on_generate_message},
            {wire::MessageType::CancelRequest, &Gateway::on_cancel_message},
            {wire::MessageType::Feedback, &Gateway::on_feedback},
            {wire::MessageType::ControlCommand, &Gateway::on_control_message},
        });
    wire::Message& message = *decoded.message;
    if (kClientHandlers.dispatch(*this, message.type, client, message)) return;
    metrics_.rejected("unexpected_type").inc();
    client_->reply_error(
        client, wire::ErrorCode::InvalidRequest,
        std::string("a client may not send ") + wire::message_type_name(message.type));
  }

  void on_generate_message(const std::string& client, wire::Message& message) {
    return on_generate(client, *message.as<wire::GenerateRequest>());
  }

  void on_cancel_message(const std::string& client, wire::Message& message) {
    return on_cancel(client, message.as<wire::CancelRequest>()->client_request_id());
  }

  void on_feedback(const std::string& client, wire::Message& message) {
    const auto* feedback = message.as<wire::Feedback>();
    log_.info("feedback", {{"client_request_id", feedback->client_request_id()},
                           {"score", static_cast<double>(feedback->score())}});
    reuse_->on_feedback(client, feedback->client_request_id(), feedback->score());
  }

  void on_control_message(const std::string& client, wire::Message& message) {
    return on_control(client, *message.as<wire::ControlCommand>());
  }

  void on_generate(const std::string& client, const wire::GenerateRequest& request) {
    const uint64_t crid = request.client_request_id();
    if (draining_)
      return reject(client, crid, wire::ErrorCode::Draining, "draining",
                    "the gateway is shutting down: send the request to another gateway");
    if (by_client_.count({client, crid}))
      return reject(client, crid, wire::ErrorCode::InvalidRequest, "duplicate_id",
                    "client_request_id " + std::to_string(crid) + " is already in flight");
    if (requests_.size() >= max_in_flight_)
      return reject(client, crid, wire::ErrorCode::Overloaded, "overloaded",
                    "the gateway has " + std::to_string(requests_.size()) +
                        " requests in flight (limit " + std::to_string(max_in_flight_) + ")");
    auto validated = validator_->validate(request);
    if (const auto* refused = std::get_if<Refusal>(&validated))
      return reject(client, crid, refused->code, refused->reason, refused->text);
    ValidRequest& valid = std::get<ValidRequest>(validated);
    if (auto over =
            tenant_limiter_.admit(valid.tenant, valid.limits, valid.prompt.size(), seconds_now()))
      return reject(client, crid, wire::ErrorCode::Overloaded, "tenant_over_limit", *over);
    // Every sampled request gets a seed, so that a retry after a replica dies replays the
    // tokens the client already has instead of diverging from them.
    model::SamplingParams& sampling = valid.sampling;
    const bool client_seeded = sampling.seed.has_value();
    if (sampling.temperature > 0 && !sampling.seed) sampling.seed = seed_source_();

    Request r;
    r.id = next_request_id_++;
    runtime::trace_message(log_, "GenerateRequest", r.id, 1, "client");
    r.client = client;
    r.tenant = valid.tenant;
    r.client_request_id = crid;
    r.prompt = std::move(valid.prompt);
    r.sampling = std::move(sampling);
    // Server-derived: a client names its tenant, never the namespace its cache entries live in.
    r.client_deterministic = r.sampling.temperature == 0 || client_seeded;
    reuse::Admission admitted = reuse_->policy().admit(r.tenant, valid.asked_levels,
                                                       r.client_deterministic, r.sampling.logprobs);
    r.cache_namespace = std::move(admitted.cache_namespace);
    r.namespace_levels = admitted.namespace_levels;
    r.allowed_levels = admitted.allowed_levels;
    if (!admitted.approximate_refused.empty()) {
      r.approximate = admitted.approximate_refused;
      metrics_.approximate(r.approximate).inc();
    }
    const uint64_t ns = model::namespace_id(r.cache_namespace);
    r.prompt_key = reuse::prompt_key(r.prompt, reuse::block_chain(r.prompt, model_.model_id, ns),
                                     model_.model_id, ns);
    r.received = Clock::now();
    r.deadline = r.received + valid.deadline;
    r.text = std::make_unique<tokenizer::DecodeStream>(
        validator_->tokenizer(), tokenizer::DecodeOptions{.skip_special_tokens = true});
    // With its usage: the prompt's token count, which a front end that ends the request itself
    // (an HTTP stop string) still reports.
    client_->send_event(client, crid, r.id, wire::EventKind::Accepted, {}, {}, {},
                        wire::ErrorCode::None, {}, &r);
    by_client_[{client, crid}] = r.id;
    const uint64_t id = r.id;
    requests_.emplace(id, std::move(r));
    queue_for_probe(requests_.at(id));
  }

  void on_cancel(const std::string& client, uint64_t crid) {
    auto it = by_client_.find({client, crid});
    if (it == by_client_.end()) return;  // already finished: nothing to do
    Request& r = requests_.at(it->second);
    log_.info("request_cancelled", {{"request_id", r.id}, {"tokens", r.sent.size()}});
    finish(r, "cancelled");
  }

  void on_control(const std::string& client, const wire::ControlCommand& command) {
    const std::string name = command.command() ? command.command()->str() : "";
    std::string key_id;
    if (auto refused = validator_->authorize_operator(command, key_id)) {
      metrics_.rejected(refused->reason).inc();
      log_.warn("control_refused", {{"command", name.substr(0, 64)}, {"key", key_id}});
      return client_->reply_error(client, refused->code, refused->text);
    }
    const ControlResult result =
        control_->run(name, command.arguments() ? command.arguments()->str() : "{}");
    client_->reply_control(client, result.ok, result.text, result.body.dump());
  }

  // For `status`: the requests in flight, where each is (waiting in the gateway, or held by a
  // replica of some stage), and the gateway's queues.
  nlohmann::json requests_json() const {
    std::map<std::string, size_t> where = {
        {"queued", 0}, {"probe", 0}, {"prefill", 0}, {"decode", 0}};
    for (const auto& [id, r] : requests_) {
      const runtime::Peer* owner = r.owner.empty() ? nullptr : hub_->peer(r.owner);
      ++where[owner ? wire::stage_name(owner->stage) : "queued"];
    }
    return {{"in_flight", requests_.size()},
            {"requests", where},
            {"queues",
             {{"probe", probe_queue_.size()},
              {"prefill", prefill_queue_.size()},
              {"decode", decode_queue_.size()}}}};
  }

  // ---- request lifecycle ----

  Request* find(uint64_t id, uint32_t attempt) {
    auto it = requests_.find(id);
    if (it == requests_.end() || it->second.attempt != attempt) return nullptr;
    return &it->second;
  }

  // A result counts only from the replica the job was given to. Another peer's answer for it (a
  // stage answering jobs it never got, to put its tokens in someone else's stream) is dropped
  // and counted; a stale attempt's is simply ignored, as before.
  Request* owned(uint64_t id, uint32_t attempt, const std::string& from, wire::MessageType type) {
    Request* r = find(id, attempt);
    if (r == nullptr) return nullptr;
    if (r->owner == from) return r;
    broker_->refuse(from, type, "not_owner");
    return nullptr;
  }

  // A result from the prefill replica the probe sent the job to, for a request still waiting for
  // the probe's notice (which it overtook): from now on that replica holds it.
  Request* from_prefill(uint64_t id, uint32_t attempt, const std::string& from,
                        wire::MessageType type) {
    Request* r = find(id, attempt);
    if (r == nullptr) {
      broker_->settle_stale_prefill(id, attempt, from);
      return nullptr;
    }
    if (r->at_probe && r->prefill_reserved && r->handed_by == from) took_job_from_probe(*r);
    return owned(id, attempt, from, type);
  }

  void took_job_from_probe(Request& r) {
    r.owner = r.handed_by;
    r.at_probe = false;
    r.prefill_reserved = false;  // the replica returns it when the job is done
    if (r.prefill_dispatched == Clock::time_point{}) {
      r.prefill_dispatched = Clock::now();
      metrics_.queue_time->observe(
          std::chrono::duration<double>(r.prefill_dispatched - r.received).count());
    }
  }

  void erase(Request& r) {
    tenant_limiter_.release(r.tenant);
    by_client_.erase({r.client, r.client_request_id});
    requests_.erase(r.id);  // queue entries for it are skipped when they come up
  }

  void finish(Request& r, const std::string& reason) {
    broker_->cancel_at_owner(r);
    const bool approximate_answer = r.reuse_level == "response" || r.reuse_level == "blend";
    // Only what was computed for this very prompt becomes its result.
    if ((reason == "stop" || reason == "length") && (r.allowed_levels & reuse::kResult) &&
        r.reuse_level != "result" && !approximate_answer && !r.sent.empty())
      store_result(r, reason);
    if ((reason == "stop" || reason == "length") && r.shadow_mode == "response")
      reuse_->report_shadow(r, reuse_->policy().same_answer(r.sent, r.donor_completion), 0.0f);
    if (approximate_answer) reuse_->policy().served_approximately(r.client, r.client_request_id);

    std::string tail;
    if (auto rest = r.text->finish(); rest) tail = std::move(*rest);
    const auto now = Clock::now();
    metrics_.e2e->observe(std::chrono::duration<double>(now - r.received).count());
    if (r.sent.size() > 1 && r.has_first_token)
      metrics_.tpot->observe(std::chrono::duration<double>(now - r.first_token).count() /
                             static_cast<double>(r.sent.size() - 1));
    metrics_.outcome(reason).inc();
    client_->send_event(r.client, r.client_request_id, r.id, wire::EventKind::Finished, tail, {},
                        reason, wire::ErrorCode::None, {}, &r);
    erase(r);
  }

  void fail(Request& r, wire::ErrorCode code, const std::string& outcome, const std::string& text) {
    broker_->cancel_at_owner(r);
    metrics_.outcome(outcome).inc();
    metrics_.e2e->observe(std::chrono::duration<double>(Clock::now() - r.received).count());
    log_.warn("request_failed", {{"request_id", r.id}, {"outcome", outcome}, {"detail", text}});
    client_->send_event(r.client, r.client_request_id, r.id, wire::EventKind::Error, {}, {}, {},
                        code, text, &r);
    erase(r);
  }

  // A token of the current attempt. Tokens the client already has (from an attempt that died)
  // must match; new ones are streamed.
  void on_token(Request& r, int32_t token, const std::string& finish_reason,
                const wire::TokenLogprobs* logprobs = nullptr) {
    const size_t index = r.position++;
    if (index < r.sent.size()) {
      if (r.sent[index] != token)
        return fail(r, wire::ErrorCode::StageFailed, "stage_failed",
                    "the retried request diverged from the tokens already streamed");
    } else {
      r.sent.push_back(token);
      if (!r.has_first_token) {
        r.has_first_token = true;
        r.first_token = Clock::now();
        metrics_.ttft->observe(std::chrono::duration<double>(r.first_token - r.received).count());
      }
      std::string delta;
      if (validator_->tokenizer().id_to_token(token)) {
        auto piece = r.text->step(token);
        if (piece) delta = std::move(*piece);
      }
      // Where the request asked for log-probabilities, every token the client gets has them.
      if (r.sampling.logprobs && logprobs == nullptr)
        return fail(r, wire::ErrorCode::StageFailed, "stage_failed",
                    "a stage sent a token without the log-probabilities the request asked for");
      if (!client_->send_event(r.client, r.client_request_id, r.id, wire::EventKind::Delta, delta,
                               {token}, {}, wire::ErrorCode::None, {}, nullptr, logprobs)) {
        // Nobody is listening any more: stop spending compute on it.
        log_.info("client_gone", {{"request_id", r.id}, {"tokens", r.sent.size()}});
        broker_->cancel_at_owner(r);
        metrics_.outcome("client_gone").inc();
        return erase(r);
      }
    }
    if (!finish_reason.empty()) {
      r.owner.clear();  // the replica has already let it go
      finish(r, finish_reason);
    }
  }

  void retry_or_fail(Request& r, const std::string& why) {
    if (r.attempt - r.free_attempts > max_retries_)
      return fail(r, wire::ErrorCode::StageFailed, "stage_failed",
                  why + "; gave up after " + std::to_string(r.attempt) + " attempts");
    metrics_.retries->inc();
    log_.warn("request_retry", {{"request_id", r.id}, {"attempt", r.attempt + 1}, {"reason", why}});
    broker_->release_reservations(r);
    r.owner.clear();
    ++r.attempt;
    r.position = 0;
    r.prefix_plan.reset();
    r.reuse_level = "none";
    r.reused_tokens = 0;
    r.prefix_key = 0;
    r.blend_plan = r.blend_shadow = false;
    r.shadow_mode.clear();
    queue_for_probe(r);
  }

  void queue_for_probe(Request& r) {
    r.at_probe = true;
    r.probe_since = Clock::now();
    probe_queue_.push_back({r.id, r.attempt});
  }

  // Reuse is an optimisation: a request whose probe has not answered within --probe-timeout-ms
  // (a probe that is down, restarting, stopped, or stuck on a full disk) goes to prefill without
  // reuse, as a new attempt, so that the probe's late answer is ignored.
  void bypass_slow_probes() {
    const auto now = Clock::now();
    if (probe_timeout_.count() <= 0 || now - last_bypass_scan_ < std::chrono::milliseconds(20))
      return;
    last_bypass_scan_ = now;
    std::vector<uint64_t> late;
    // Waiting for a probe that was sent the job, or for any probe at all (none is connected); a
    // job queued behind busy probes is not late.
    const bool no_probe = !hub_->any(wire::StageKind::Probe);
    for (auto& [id, r] : requests_)
      if (r.at_probe && (!r.owner.empty() || no_probe) && now - r.probe_since > probe_timeout_)
        late.push_back(id);
    for (uint64_t id : late) {
      Request& r = requests_.at(id);
      r.at_probe = false;
      broker_->release_reservations(r);
      r.owner.clear();
      ++r.attempt;
      ++r.free_attempts;
      r.position = 0;
      metrics_.probe_bypassed->inc();
      if (uint64_t suppressed = 0; bypass_log_.allow(suppressed))
        log_.warn("probe_bypassed", {{"request_id", r.id},
                                     {"waited_ms", ms_between(r.probe_since, now)},
                                     {"suppressed", suppressed}});
      prefill_queue_.push_back({r.id, r.attempt});
    }
  }

  void on_peer_lost(const runtime::Peer& dead) {
    std::vector<uint64_t> held;
    for (auto& [id, r] : requests_)
      if (r.owner == dead.identity) held.push_back(id);
    for (uint64_t id : held) {
      Request& r = requests_.at(id);
      r.owner.clear();
      retry_or_fail(
          r, std::string(wire::stage_name(dead.stage)) + " replica " + dead.replica + " died");
    }
    // Plans and expert usage waiting on a lost offload manager are simply asked again by the
    // compute stages; nothing else is held per peer.
  }

  void expire_deadlines() {
    const auto now = Clock::now();
    if (now - last_deadline_scan_ < std::chrono::milliseconds(20)) return;
    last_deadline_scan_ = now;
    std::vector<uint64_t> expired;
    for (auto& [id, r] : requests_)
      if (now >= r.deadline) expired.push_back(id);
    std::vector<uint64_t> unconfirmed;
    for (auto& [id, r] : requests_)
      if (r.handover_pending && now - r.handover_since > handover_timeout_ && now < r.deadline)
        unconfirmed.push_back(id);
    for (uint64_t id : unconfirmed) {
      Request& r = requests_.at(id);
      metrics_.handover_timeouts->inc();
      const std::string target = r.decode_target;
      broker_->cancel_at_owner(r);
      retry_or_fail(r, "decode replica " + target + " did not confirm the hand-over");
    }
    for (uint64_t id : expired) {
      Request& r = requests_.at(id);
      fail(r, wire::ErrorCode::DeadlineExceeded, "deadline_exceeded",
           "deadline of " +
               std::to_string(static_cast<int64_t>(ms_between(r.received, r.deadline))) +
               " ms exceeded after " + std::to_string(r.sent.size()) + " tokens");
    }
  }

  // ---- reuse ----

  // A deterministic request's completion, for an identical request to replay.
  void store_result(const Request& r, const std::string& reason) {
    broker_->put_to_probes(reuse::result_entry(r.prompt_key, r.sampling), 'R',
                           reuse::encode(reuse::ResultRecord{r.sent, reason}), &r.cache_namespace);
  }

  // ---- to and from stages ----

  // Prefill stores the prompt's blocks and record as allowed, and its signature where the
  // namespace allows approximate reuse (so that later prompts find it).
  static uint32_t store_levels_of(const Request& r) {
    return (r.allowed_levels & (reuse::kPrefix | reuse::kFull)) |
           (r.namespace_levels & reuse::kApproximateLevels);
  }

  void dispatch() {
    while (!probe_queue_.empty()) {
      auto [id, attempt] = probe_queue_.front();
      Request* r = find(id, attempt);
      if (r == nullptr) {
        probe_queue_.pop_front();
        continue;
      }
      // The namespace's own probe, once it has room (a job waits rather than go to a probe that
      // does not hold its namespace).
      runtime::Peer* probe = broker_->probe_for(r->cache_namespace);
      if (probe == nullptr || probe->credits == 0) break;
      // The shortest path: the probe sends the job on to a prefill replica picked now, and the KV
      // goes on to a decode replica picked now. Without room in both, the probe's plan comes back
      // here and waits for prefill as before.
      runtime::Peer* prefill = broker_->pick_with_intake(wire::StageKind::Prefill);
      runtime::Peer* decode =
          prefill ? broker_->pick_with_intake(wire::StageKind::Decode) : nullptr;
      if (prefill != nullptr && decode == nullptr) {
        hub_->restore_credit(prefill->identity);
        prefill = nullptr;
      }
      flatbuffers::FlatBufferBuilder builder(256 + r->prompt.size() * 4);
      auto tokens = builder.CreateVector(r->prompt);
      auto name_space = builder.CreateString(r->cache_namespace);
      auto sampling = to_wire(builder, r->sampling);
      auto prefill_route = prefill ? broker_->route_to(builder, *prefill, *r) : 0;
      auto decode_route = decode ? broker_->route_to(builder, *decode, *r) : 0;
      builder.Finish(
          wire::CreateProbeJob(builder, r->id, r->attempt, tokens, name_space, sampling,
                               r->allowed_levels, prefill_route, decode_route, store_levels_of(*r)),
          wire::PrefillJobIdentifier());
      const std::string identity = probe->identity;
      const std::string prefill_identity = prefill ? prefill->identity : "";
      const std::string decode_identity = decode ? decode->identity : "";
      if (!hub_->send(identity, wire::encode(wire::MessageType::ProbeJob, builder), true)) {
        if (prefill) hub_->restore_credit(prefill_identity);
        if (decode) hub_->restore_credit(decode_identity);
        break;
      }
      r->owner = identity;
      r->probe_since = Clock::now();
      if (prefill) {
        r->handed_by = prefill_identity;
        r->prefill_reserved = true;
        r->decode_target = decode_identity;
        r->decode_reserved = true;
      }
      probe_queue_.pop_front();
    }
    while (!prefill_queue_.empty() && decode_queue_.size() < max_decode_backlog_) {
      auto [id, attempt] = prefill_queue_.front();
      Request* r = find(id, attempt);
      if (r == nullptr) {
        prefill_queue_.pop_front();
        continue;
      }
      runtime::Peer* prefill = broker_->prefill_for(r->prefix_key);
      if (prefill == nullptr) break;
      // The decode replica is chosen now, so that prefill sends it the KV directly: a prefill
      // starts only when a decode replica has room for the sequence.
      runtime::Peer* decode = broker_->pick_with_intake(wire::StageKind::Decode);
      if (decode == nullptr) break;  // the prefill replica was only chosen: nothing to give back
      flatbuffers::FlatBufferBuilder builder(512 + r->prompt.size() * 4);
      auto decode_route = broker_->route_to(builder, *decode, *r);
      const runtime::Peer* store = broker_->store_for(r->cache_namespace);
      auto store_route = store != nullptr ? broker_->route_to(builder, *store, *r) : 0;
      auto tokens = builder.CreateVector(r->prompt);
      auto sampling = to_wire(builder, r->sampling);
      flatbuffers::Offset<wire::KvLayout> layout = 0;
      flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
      std::vector<zmq::message_t> bulk;
      if (r->prefix_plan) {
        // The prefix's KV moves on to prefill without a copy.
        const auto* plan = r->prefix_plan->as<wire::ProbePlan>();
        const wire::KvLayout* l = plan->layout();
        layout = wire::CreateKvLayout(builder, l->layers(), l->kv_heads(), l->head_dim(),
                                      l->block_tokens(), builder.CreateString("f32"), l->blocks(),
                                      l->values());
        std::vector<flatbuffers::Offset<wire::BulkFrame>> described;
        for (const wire::BulkFrame* frame : *plan->frames())
          described.push_back(wire::CreateBulkFrame(builder, frame->bytes(), frame->xxh3()));
        frames = builder.CreateVector(described);
        for (wire::AlignedFrame& frame : r->prefix_plan->bulk)
          bulk.push_back(std::move(frame.message()));
      }
      // Prefill stores the prompt's blocks and record as allowed, and its signature where the
      // namespace allows approximate reuse (so that later prompts find it).
      const uint32_t store_levels = store_levels_of(*r);
      flatbuffers::Offset<flatbuffers::Vector<uint8_t>> mask = 0;
      float recompute = 0;
      if (r->blend_plan && r->prefix_plan) {
        const auto* plan = r->prefix_plan->as<wire::ProbePlan>();
        mask = builder.CreateVector(plan->blend_mask()->data(), plan->blend_mask()->size());
        recompute = plan->recompute_fraction();
      }
      const std::string level = r->blend_plan ? "blend" : r->reuse_level;
      builder.Finish(
          wire::CreatePrefillJob(builder, r->id, r->attempt, tokens, sampling,
                                 builder.CreateString(r->cache_namespace),
                                 builder.CreateString(level), r->prefix_plan ? r->reused_tokens : 0,
                                 frames, layout, store_levels, r->prefix_key, mask, recompute,
                                 r->blend_shadow, decode_route, store_route),
          wire::PrefillJobIdentifier());
      const std::string identity = prefill->identity;
      const std::string decode_identity = decode->identity;
      std::vector<zmq::message_t> job =
          wire::encode(wire::MessageType::PrefillJob, builder, std::move(bulk));
      if (!hub_->send(identity, job, true)) {
        hub_->restore_credit(decode_identity);
        // That replica is gone; the next try recomputes the prefix rather than keep its KV here.
        r->prefix_plan.reset();
        r->reuse_level = "none";
        r->reused_tokens = 0;
        r->blend_plan = r->blend_shadow = false;
        break;
      }
      r->prefix_plan.reset();
      broker_->remember_prefix(r->prefix_key, identity);
      r->owner = identity;
      r->handed_by = identity;
      r->decode_target = decode_identity;
      r->decode_reserved = true;
      if (r->attempt == 1 || r->prefill_dispatched == Clock::time_point{}) {
        r->prefill_dispatched = Clock::now();
        metrics_.queue_time->observe(
            std::chrono::duration<double>(r->prefill_dispatched - r->received).count());
      }
      prefill_queue_.pop_front();
    }
    while (!decode_queue_.empty()) {
      Handoff& handoff = decode_queue_.front();
      Request* r = find(handoff.id, handoff.attempt);
      if (r == nullptr) {
        decode_queue_.pop_front();
        continue;
      }
      runtime::Peer* decode = hub_->pick(wire::StageKind::Decode);
      if (decode == nullptr) break;
      const std::string identity = decode->identity;
      // The KV frame moves on without a copy.
      std::vector<zmq::message_t> frames = handoff.message.release_frames();
      if (!hub_->send(identity, frames, true)) {
        // That replica is gone; the handoff waits for another (the frames were not sent).
        wire::Decoded again = wire::decode(std::move(frames));
        if (!again.message) {
          decode_queue_.pop_front();
          retry_or_fail(*r, "decode replica unreachable");
          continue;
        }
        handoff.message = std::move(*again.message);
        break;
      }
      r->owner = identity;
      decode_queue_.pop_front();
    }
  }

  void on_stage(runtime::Hub::Incoming& incoming) {
    static constexpr runtime::HandlerTable<Gateway, 10, runtime::Hub::Incoming&> kStageHandlers({
        {wire::MessageType::ProbePlan, &Gateway::on_probe_plan},
        {wire::MessageType::PrefillDone, &Gateway::on_prefill_done},
        {wire::MessageType::HandoverAccepted, &Gateway::on_handover_accepted},
        {wire::MessageType::TokenBatch, &Gateway::on_token_batch},
        {wire::MessageType::JobFailed, &Gateway::on_job_failed},
        {wire::MessageType::ExpertPlanRequest, &Gateway::on_expert_traffic},
        {wire::MessageType::ExpertUsage, &Gateway::on_expert_traffic},
        {wire::MessageType::SnapshotPut, &Gateway::on_snapshot_put},
        {wire::MessageType::ExpertPlan, &Gateway::on_expert_plan},
        {wire::MessageType::ErrorReply, &Gateway::on_stage_error},
    });
    if (kStageHandlers.dispatch(*this, incoming.message.type, incoming)) return;
    log_.warn("unexpected_message", {{"peer", incoming.identity},
                                     {"type", wire::message_type_name(incoming.message.type)}});
  }

  void on_probe_plan(runtime::Hub::Incoming& incoming) {
    wire::Message& message = incoming.message;
    const auto* plan = message.as<wire::ProbePlan>();
    Request* r = find(plan->request_id(), plan->attempt());
    // The notice of a plan sent on to prefill, overtaken by prefill's own answer: only the
    // bookkeeping is left to do.
    const bool overtaken =
        r != nullptr && plan->forwarded() && !r->at_probe &&
        broker_->from_stage(incoming.identity, message.type, {wire::StageKind::Probe});
    if (!overtaken) r = owned(plan->request_id(), plan->attempt(), incoming.identity, message.type);
    if (r == nullptr) return;
    if (plan->forwarded() && !overtaken) {
      if (!r->prefill_reserved || hub_->peer(r->handed_by) == nullptr)
        return retry_or_fail(*r, "the prefill replica the probe sent the job to is gone");
      took_job_from_probe(*r);
    } else if (!plan->forwarded()) {
      r->owner.clear();
      r->at_probe = false;
      // The plan comes here: prefill and decode are picked when it runs.
      broker_->release_prefill(*r, false);
      broker_->release_reservations(*r);
    }
    r->probe_us = plan->probe_us();
    const std::string level = plan->reuse_level() ? plan->reuse_level()->str() : "none";
    const std::string outcome = plan->approximate() ? plan->approximate()->str() : "";
    if (!outcome.empty()) {
      r->approximate = outcome;
      r->similarity = plan->similarity();
      r->donor = plan->donor_key();
      r->cell = plan->cell();
      r->shadow_sampled = plan->shadow_sampled();
      reuse_->on_lookup(outcome);
      if (outcome == "shadow" && plan->shadow_mode() && plan->shadow_mode()->str() == "response" &&
          plan->completion()) {
        r->shadow_mode = "response";
        r->donor_completion.assign(plan->completion()->begin(), plan->completion()->end());
      }
    }
    if (plan->forwarded()) {
      // Prefill has the job: what the plan reused is known here for the request's usage.
      if (level == "blend") {
        r->blend_plan = true;
        r->blend_shadow = outcome == "shadow";
        r->reused_tokens = plan->reused_tokens();
      } else if (level == "prefix") {
        r->reuse_level = level;
        r->reused_tokens = plan->reused_tokens();
      }
      return;
    }
    if (level == "blend" && plan->layout() != nullptr && plan->blend_mask() != nullptr &&
        plan->blend_mask()->size() == r->prompt.size()) {
      if (auto bad = wire::check_bulk(plan->frames(), message.bulk)) {
        log_.warn("probe_plan_refused", {{"request_id", r->id}, {"reason", *bad}});
      } else {
        r->blend_plan = true;
        r->blend_shadow = outcome == "shadow";
        r->reused_tokens = plan->reused_tokens();  // the exact prefix the blend continues
        r->prefix_key = plan->prefix_key();        // same template or donor, same replica
        r->prefix_plan = std::move(message);
      }
      prefill_queue_.push_back({r->id, r->attempt});
      return;
    }
    if ((level == "result" || level == "response") && plan->completion() &&
        plan->completion()->size() > 0) {
      // A finished completion replayed, nothing computed: an identical deterministic
      // request's (result), or a near-identical one's that the decision rule let through
      // (response).
      r->reuse_level = level;
      r->reused_tokens = plan->reused_tokens();
      const std::string finish = plan->finish_reason() ? plan->finish_reason()->str() : "stop";
      const uint64_t id = r->id;
      const uint32_t attempt = r->attempt;
      const auto* completion = plan->completion();
      for (flatbuffers::uoffset_t i = 0; i < completion->size(); ++i) {
        Request* live = find(id, attempt);
        if (live == nullptr) break;
        on_token(*live, completion->Get(i), i + 1 == completion->size() ? finish : "");
      }
      return;
    }
    if (level == "prefix" && plan->reused_tokens() > 0 && plan->layout() != nullptr) {
      if (auto bad = wire::check_bulk(plan->frames(), message.bulk)) {
        log_.warn("probe_plan_refused", {{"request_id", r->id}, {"reason", *bad}});
      } else {
        r->reuse_level = level;
        r->reused_tokens = plan->reused_tokens();
        r->prefix_key = plan->prefix_key();
        r->prefix_plan = std::move(message);
      }
    }
    prefill_queue_.push_back({r->id, r->attempt});
  }

  void on_prefill_done(runtime::Hub::Incoming& incoming) {
    wire::Message& message = incoming.message;
    const auto* done = message.as<wire::PrefillDone>();
    Request* r = from_prefill(done->request_id(), done->attempt(), incoming.identity, message.type);
    if (r == nullptr) return;
    if (r->at_probe) {
      // The probe answered a full hit itself: the prefill replica picked for it had nothing to do.
      r->at_probe = false;
      broker_->release_prefill(*r, false);
      r->handed_by = incoming.identity;  // who sends the KV on to decode
    }
    r->owner.clear();
    r->prefill_ms = static_cast<double>(done->prefill_us()) / 1000.0;
    if (done->prefill_us() > 0 && r->probe_us > 0)
      metrics_.probe_fraction->observe(static_cast<double>(r->probe_us) /
                                       static_cast<double>(done->prefill_us()));
    if (done->reuse_level() && done->reuse_level()->size() > 0) {
      r->reuse_level = done->reuse_level()->str();
      r->reused_tokens = done->reused_tokens();
    }
    if (done->shadow_checked() && r->blend_shadow) {
      r->blend_shadow = false;
      reuse_->report_shadow(*r, done->shadow_top1() && done->shadow_kl() <= blend_max_kl_,
                            done->shadow_kl());
    }
    const std::string finish = done->finish_reason() ? done->finish_reason()->str() : "";
    const uint64_t id = r->id;
    const uint32_t attempt = r->attempt;
    const bool carries_kv = done->frames() != nullptr && done->frames()->size() > 0;
    if (!finish.empty() || carries_kv) broker_->release_reservations(*r);  // no hand-over will come
    if (finish.empty() && !carries_kv) {
      // Prefill hands the KV to the decode replica picked at dispatch; from now on the request's
      // tokens come from there.
      if (r->decode_target.empty() || hub_->peer(r->decode_target) == nullptr)
        return retry_or_fail(*r, "the decode replica picked for the hand-over is gone");
      r->owner = r->decode_target;
      r->handover_pending = !r->handover_confirmed;
      if (r->handover_confirmed) r->decode_reserved = false;
      r->handover_since = Clock::now();
    }
    on_token(*r, done->first_token(), finish, done->first_logprobs());
    // A PrefillDone with the KV (a full hit answered by the probe): relayed to a decode replica.
    if (finish.empty() && carries_kv && find(id, attempt) != nullptr)
      decode_queue_.push_back({id, attempt, std::move(message)});
  }

  // Decode holds a sequence prefill handed to it: its tokens follow on this connection.
  void on_handover_accepted(runtime::Hub::Incoming& incoming) {
    const auto* accepted = incoming.message.as<wire::HandoverAccepted>();
    Request* r = find(accepted->request_id(), accepted->attempt());
    if (r != nullptr && r->decode_target == incoming.identity && r->decode_reserved) {
      if (r->handover_pending) {
        r->handover_pending = false;
        r->decode_reserved = false;  // the replica returns the credit when the sequence ends
      } else {
        r->handover_confirmed = true;  // before prefill's PrefillDone: noted for it
      }
      return;
    }
    // A hand-over the gateway gave up on (retried, cancelled, finished): the replica drops it,
    // and the credit it will return for it was already given back (release_reservations).
    flatbuffers::FlatBufferBuilder builder(64);
    builder.Finish(wire::CreateCancelJob(builder, accepted->request_id(), accepted->attempt()),
                   wire::PrefillJobIdentifier());
    if (hub_->send(incoming.identity, wire::encode(wire::MessageType::CancelJob, builder), false))
      hub_->spend_credit(incoming.identity);
  }

  void on_token_batch(runtime::Hub::Incoming& incoming) {
    wire::Message& message = incoming.message;
    const auto* batch = message.as<wire::TokenBatch>();
    metrics_.batch_size->observe(batch->batch_size());
    if (batch->updates() == nullptr) return;
    for (const wire::TokenUpdate* update : *batch->updates()) {
      if (Request* early = find(update->request_id(), update->attempt());
          early != nullptr && early->decode_target == incoming.identity &&
          early->owner != incoming.identity) {
        // Decode's tokens overtook prefill's PrefillDone (the first token): rather than stream
        // out of order, the attempt starts again.
        broker_->cancel_at_owner(*early);
        retry_or_fail(*early, "decode's tokens arrived before prefill's first token");
        continue;
      }
      Request* r = owned(update->request_id(), update->attempt(), incoming.identity, message.type);
      if (r == nullptr) continue;  // cancelled or retried meanwhile, or not this peer's
      on_token(*r, update->token(), update->finish_reason() ? update->finish_reason()->str() : "",
               update->logprobs());
    }
  }

  void on_job_failed(runtime::Hub::Incoming& incoming) {
    wire::Message& message = incoming.message;
    const auto* failed = message.as<wire::JobFailed>();
    Request* r = find(failed->request_id(), failed->attempt());
    if (r == nullptr)
      broker_->settle_stale_prefill(failed->request_id(), failed->attempt(), incoming.identity);
    if (r != nullptr && r->at_probe && r->prefill_reserved && r->handed_by == incoming.identity)
      took_job_from_probe(*r);
    // Prefill reports a hand-over the decode replica would not take after its PrefillDone.
    if (r != nullptr && r->handover_pending && r->handed_by == incoming.identity) {
      broker_->cancel_at_owner(*r);
      return retry_or_fail(*r, failed->message() ? failed->message()->str() : "hand-over failed");
    }
    r = owned(failed->request_id(), failed->attempt(), incoming.identity, message.type);
    if (r == nullptr) return;
    broker_->release_reservations(*r);
    r->owner.clear();
    if (failed->code() == wire::ErrorCode::Draining) {
      // Handed back by a draining replica: another one takes it (not a failure).
      ++r->free_attempts;
      metrics_.handed_back->inc();
      return retry_or_fail(*r, "replica draining");
    }
    return fail(*r, failed->code(), "failed",
                failed->message() ? failed->message()->str() : "a stage refused the job");
  }

  void on_expert_traffic(runtime::Hub::Incoming& incoming) {
    wire::Message& message = incoming.message;
    if (!broker_->from_stage(incoming.identity, message.type,
                             {wire::StageKind::Prefill, wire::StageKind::Decode}))
      return;
    return broker_->forward_to_offload(message);
  }

  // Prefill sends its puts to the probe's intake; the gateway carries no snapshot byte.
  void on_snapshot_put(runtime::Hub::Incoming& incoming) {
    broker_->refuse(incoming.identity, incoming.message.type, "sent_to_the_gateway");
  }

  void on_expert_plan(runtime::Hub::Incoming& incoming) {
    wire::Message& message = incoming.message;
    if (!broker_->from_stage(incoming.identity, message.type, {wire::StageKind::OffloadManager}))
      return;
    const auto* plan = message.as<wire::ExpertPlan>();
    const std::string requester = plan->requester() ? plan->requester()->str() : "";
    const runtime::Peer* to = hub_->peer(requester);
    if (to == nullptr ||
        (to->stage != wire::StageKind::Prefill && to->stage != wire::StageKind::Decode))
      return;
    hub_->send(requester, message.release_frames(), false);
  }

  void on_stage_error(runtime::Hub::Incoming& incoming) {
    wire::Message& message = incoming.message;
    log_.warn("stage_error", {{"peer", incoming.identity},
                              {"detail", message.as<wire::ErrorReply>()->message()
                                             ? message.as<wire::ErrorReply>()->message()->str()
                                             : ""}});
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
  size_t max_in_flight_ = 0, max_decode_backlog_ = 0;
  uint32_t max_retries_ = 2;
  std::chrono::milliseconds probe_timeout_{0}, drain_grace_{0}, handover_timeout_{10000};
  bool draining_ = false;
  Clock::time_point drain_until_;
  runtime::RateLimited bypass_log_;
  std::mt19937_64 seed_source_{std::random_device{}()};

  std::unordered_map<uint64_t, Request> requests_;
  std::map<std::pair<std::string, uint64_t>, uint64_t> by_client_;
  std::deque<std::pair<uint64_t, uint32_t>> probe_queue_, prefill_queue_;
  std::deque<Handoff> decode_queue_;
  uint64_t next_request_id_ = 1;
  Clock::time_point last_deadline_scan_, last_bypass_scan_;
  std::atomic<size_t> in_flight_{0};

  runtime::RateLimited reject_log_, frame_log_;

  std::unique_ptr<ReuseControl> reuse_;
  std::unique_ptr<ControlCommands> control_;
  double blend_max_kl_ = 0.05;
};

std::vector<runtime::ConfigKey> gateway_keys() {
  std::vector<runtime::ConfigKey> keys = common_keys();
  keys.push_back({"client-bind", "tcp://127.0.0.1:5555", "client endpoint (ROUTER)"});
  keys.push_back({"hub-bind", "tcp://127.0.0.1:5556", "endpoint the stage processes connect to"});
  keys.push_back({"max-prompt-tokens", "0", "longest prompt accepted (0: the context minus one)"});
  keys.push_back({"max-prompt-bytes", "1MiB", "longest prompt text accepted"});
  keys.push_back({"max-message-bytes", "4MiB", "largest client message accepted"});
  keys.push_back({"default-deadline-ms", "300000", "deadline of a request that sets none"});
  keys.push_back({"max-deadline-ms", "3600000", "upper bound on any request's deadline"});
  keys.push_back({"max-retries", "2", "restarts of a request whose replica died"});
  keys.push_back({"probe-timeout-ms", "2000",
                  "a request whose probe has not answered this long goes to prefill without "
                  "reuse (0: wait for the probe)"});
  keys.push_back({"handover-timeout-ms", "10000",
                  "a decode replica that has not confirmed a hand-over this long after prefill "
                  "sent it: the request is retried"});
  keys.push_back({"max-in-flight", "4096", "requests in flight before new ones are refused"});
  keys.push_back({"max-decode-backlog", "64",
                  "prefilled requests waiting for a decode replica before prefill pauses"});
  keys.push_back({"tenants", "", "comma-separated tenant names accepted (empty: any)"});
  keys.push_back({"api-keys", "",
                  "keys file (moeline keys add): every request needs an API key, which names its "
                  "tenant and role; control commands need the operator role. Empty: open (the "
                  "client names its tenant)"});
  keys.push_back({"tenant-max-in-flight", "1024",
                  "requests one tenant may have in flight (0: no limit; a key may set its own)"});
  keys.push_back({"tenant-prompt-tokens-per-s", "0",
                  "prompt tokens one tenant may submit per second (0: no limit; a key may set "
                  "its own)"});
  keys.push_back({"shared-tenants", "",
                  "tenants whose cache entries are shared with each other (default: none; every "
                  "tenant reuses only its own work)"});
  keys.push_back({"reuse-levels", "prefix,full,result",
                  "reuse levels a namespace allows by default (prefix, full, result, response, "
                  "blend; exact, approximate, all, none); approximate modes also need the "
                  "request to opt in; change at run time with `moeline client reuse`"});
  keys.push_back({"approximate-enabled", "true",
                  "approximate reuse on at start (the rollback controller may turn it off)"});
  keys.push_back(
      {"approximate-hit-window-s", "300", "rollback: the served hit rate over this window..."});
  keys.push_back({"approximate-min-hit-rate", "0.05", "...must not stay under this"});
  keys.push_back({"approximate-min-lookups", "20", "...judged with at least this many lookups"});
  keys.push_back(
      {"approximate-agreement-window-s", "300", "rollback: shadow agreement over this window..."});
  keys.push_back({"approximate-max-agreement-drop", "0.03",
                  "...must not fall more than this below its baseline (the first checks)"});
  keys.push_back({"approximate-min-checks", "20",
                  "...judged with at least this many checks (also the baseline's size)"});
  keys.push_back({"approximate-feedback-window-s", "300",
                  "rollback: negative feedback on reused answers over this window..."});
  keys.push_back({"approximate-max-negative-feedback", "0.005",
                  "...must not pass this share of reused answers"});
  keys.push_back({"approximate-min-served", "20", "...judged with this much feedback"});
  keys.push_back({"approximate-probation-s", "0",
                  "after a rollback, on again after this long (0: only an operator turns it on)"});
  keys.push_back(
      {"shadow-tokens", "8", "response reuse's shadow check compares this many first tokens"});
  keys.push_back({"blend-max-kl", "0.05",
                  "a blend's shadow check agrees when the top token matches and KL(full||blend) "
                  "is at most this (nats)"});
  return keys;
}

int gateway_body(const runtime::Config& config) {
  return Gateway(config).run();
}

}  // namespace

int gateway_main(int argc, char** argv) {
  return run_stage("gateway", gateway_keys(), argc, argv, gateway_body);
}

}  // namespace moeline::stages
