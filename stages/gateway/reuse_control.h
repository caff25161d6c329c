#pragma once
// The reuse policy (reuse/policy.h) as the gateway runs it: with its metrics, its log lines, its
// state on /healthz, and the shadow checks' outcomes sent on to the probes' decision rules.

#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "reuse/policy.h"
#include "stages/gateway/broker.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/request.h"
#include "stages/runtime/log.h"

namespace moeline::stages {

class ReuseControl {
 public:
  ReuseControl(reuse::PolicySettings settings, GatewayMetrics& metrics, runtime::Logger& log,
               Broker& broker);

  reuse::ReusePolicy& policy() { return policy_; }
  // The rollback controller, evaluated every loop iteration (cheap). A change takes effect for
  // the next request the gateway takes in: it strips the approximate levels at intake, so every
  // probe sees it at once.
  void update();
  // An operator's switch.
  void set_enabled(bool enabled);
  // A probe's lookup of a request that asked for approximate reuse, and what it did.
  void on_lookup(wire::ApproximateOutcome outcome);
  // A shadow check's outcome: to every probe's decision rule, and — for a check of a hit the rule
  // would have served — to the controller (checks of unproven candidates are how the rule learns;
  // they fail often by design and say nothing about what is served).
  void report_shadow(const Request& r, bool correct, float kl);
  void on_feedback(const std::string& client, uint64_t client_request_id, float score);

  nlohmann::json controller_json();
  nlohmann::json policy_json() const;
  // What /healthz shows (called from the HTTP thread).
  nlohmann::json health() const;

 private:
  void announce();

  reuse::ReusePolicy policy_;
  GatewayMetrics& metrics_;
  runtime::Logger& log_;
  Broker& broker_;
  mutable std::mutex health_mutex_;
  nlohmann::json health_;
};

}  // namespace moeline::stages
