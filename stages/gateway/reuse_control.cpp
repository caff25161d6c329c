#include "stages/gateway/reuse_control.h"

#include <chrono>

#include "reuse/records.h"

namespace moeline::stages {
namespace {

nlohmann::json or_null(const std::optional<double>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

}  // namespace

ReuseControl::ReuseControl(reuse::PolicySettings settings, GatewayMetrics& metrics,
                           runtime::Logger& log, Broker& broker)
    : policy_(std::move(settings), seconds_now()),
      metrics_(metrics),
      log_(log),
      broker_(broker),
      health_({{"enabled", policy_.controller().enabled()},
               {"reason", policy_.controller().reason()}}) {
  metrics_.approximate_enabled->set(policy_.controller().enabled() ? 1 : 0);
}

void ReuseControl::update() {
  if (policy_.update(seconds_now())) announce();
}

void ReuseControl::set_enabled(bool enabled) {
  if (policy_.set_enabled(seconds_now(), enabled)) announce();
}

void ReuseControl::announce() {
  reuse::RollbackController& controller = policy_.controller();
  metrics_.approximate_enabled->set(controller.enabled() ? 1 : 0);
  {
    std::lock_guard<std::mutex> lock(health_mutex_);
    health_ = {{"enabled", controller.enabled()},
               {"reason", controller.reason()},
               {"changed_unix_s",
                std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
                    .count()}};
  }
  metrics_.transition(controller.reason()).inc();
  const double now = seconds_now();
  const auto agreement = controller.agreement(now);
  const auto baseline = controller.baseline();
  log_.warn("approximate_reuse", {{"state", controller.enabled() ? "on" : "off"},
                                  {"reason", controller.reason()},
                                  {"hit_rate", controller.hit_rate(now)},
                                  {"agreement", agreement ? *agreement : -1.0},
                                  {"baseline", baseline ? *baseline : -1.0}});
}

void ReuseControl::on_lookup(wire::ApproximateOutcome outcome) {
  const std::string label(wire::name(outcome));
  metrics_.approximate(label).inc();
  policy_.on_lookup(seconds_now(), label);
}

void ReuseControl::report_shadow(const Request& r, bool correct, float kl) {
  policy_.on_shadow(seconds_now(), r.shadow_sampled, correct);
  if (r.shadow_sampled)
    if (const auto agreement = policy_.controller().agreement(seconds_now()))
      metrics_.shadow_agreement->set(*agreement);
  metrics_.shadow_check(correct).inc();
  // Every probe's decision rule learns from every check.
  broker_.put_to_probes(r.donor, wire::SnapshotKind::Quality,
                        reuse::encode(reuse::QualityRecord{r.cell, correct, kl}), nullptr);
  log_.info("shadow_check",
            {{"request_id", r.id},
             {"mode", r.shadow_mode == wire::ShadowMode::Response ? "response" : "blend"},
             {"donor", r.donor},
             {"correct", correct},
             {"kl", static_cast<double>(kl)}});
}

void ReuseControl::on_feedback(const std::string& client, uint64_t client_request_id, float score) {
  metrics_.feedback->inc();
  // Feedback on an answer approximate reuse served feeds the rollback controller.
  if (auto negative = policy_.on_feedback(seconds_now(), client, client_request_id, score))
    metrics_.approximate_feedback(*negative).inc();
}

nlohmann::json ReuseControl::controller_json() {
  reuse::RollbackController& controller = policy_.controller();
  const double now = seconds_now();
  return {{"enabled", controller.enabled()},
          {"reason", controller.reason()},
          {"changed_s_ago", now - controller.changed_at()},
          {"transitions", controller.transitions()},
          {"hit_rate", controller.hit_rate(now)},
          {"agreement", or_null(controller.agreement(now))},
          {"agreement_baseline", or_null(controller.baseline())},
          {"negative_feedback_rate", or_null(controller.negative_rate(now))}};
}

nlohmann::json ReuseControl::policy_json() const {
  nlohmann::json namespaces = nlohmann::json::object();
  for (const auto& [name, levels] : policy_.namespace_levels())
    namespaces[name] = reuse::levels_text(levels);
  return {{"default", reuse::levels_text(policy_.default_levels())},
          {"namespaces", namespaces},
          {"shared_tenants", policy_.shared_tenants()}};
}

nlohmann::json ReuseControl::health() const {
  std::lock_guard<std::mutex> lock(health_mutex_);
  return health_;
}

}  // namespace moeline::stages
