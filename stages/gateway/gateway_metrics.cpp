#include "stages/gateway/gateway_metrics.h"

namespace moeline::stages {

using namespace gateway_metric;

GatewayMetrics::GatewayMetrics(runtime::Registry& registry) : registry_(registry) {
  auto gauge = [&](const MetricName& m, runtime::Labels labels = {}) {
    return &registry.gauge(m.name, m.help, labels);
  };
  auto counter = [&](const MetricName& m, runtime::Labels labels = {}) {
    return &registry.counter(m.name, m.help, labels);
  };
  auto histogram = [&](const MetricName& m, std::vector<double> buckets) {
    return &registry.histogram(m.name, m.help, std::move(buckets));
  };
  probe_queue = gauge(kQueueDepth, {{"queue", "probe"}});
  prefill_queue = gauge(kQueueDepth, {{"queue", "prefill"}});
  decode_queue = gauge(kQueueDepth, {{"queue", "decode"}});
  in_flight = gauge(kInFlight);
  kv_used = gauge(kKvBlocks, {{"state", "used"}});
  kv_free = gauge(kKvBlocks, {{"state", "free"}});
  approximate_enabled = gauge(kApproximateEnabled);
  shadow_agreement = gauge(kShadowAgreement);
  authenticated = gauge(kAuthenticated);
  batch_size = histogram(kBatchSize, runtime::size_buckets());
  ttft = histogram(kTtft, runtime::latency_buckets());
  tpot = histogram(kTpot, runtime::latency_buckets());
  e2e = histogram(kE2e, runtime::latency_buckets());
  queue_time = histogram(kQueueTime, runtime::latency_buckets());
  probe_fraction = histogram(kProbeFraction, {0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2});
  retries = counter(kRetries);
  handover_timeouts = counter(kHandoverTimeouts);
  handed_back = counter(kHandedBack);
  orphan_streams_cancelled = counter(kOrphanStreamsCancelled);
  probe_bypassed = counter(kProbeBypassed);
  feedback = counter(kFeedback);
  stream_events = counter(kStreamEvents);
  stream_messages_single = counter(kStreamMessages, {{"kind", "event"}});
  stream_messages_batch = counter(kStreamMessages, {{"kind", "batch"}});
  shadow_checks_[0] = counter(kShadowChecks, {{"result", "disagreed"}});
  shadow_checks_[1] = counter(kShadowChecks, {{"result", "agreed"}});
  approximate_feedback_[0] = counter(kApproximateFeedback, {{"kind", "positive"}});
  approximate_feedback_[1] = counter(kApproximateFeedback, {{"kind", "negative"}});
  // The label values known in advance are exported at zero from the start; refusals' reasons
  // (the wire codec's among them) only when they happen, under a family declared now.
  registry.declare_counter(kRejected);
  for (const char* outcome :
       {"response", "blend", "shadow", "no_candidate", "rejected", "disabled", "not_allowed"})
    approximate(outcome);
  for (const char* reason :
       {"low_hit_rate", "agreement_drop", "negative_feedback", "operator", "probation_passed"})
    transition(reason);
  for (const char* outcome : {"stop", "length", "cancelled", "client_gone", "deadline_exceeded",
                              "stage_failed", "failed", "rejected", "drained"})
    this->outcome(outcome);
}

runtime::Counter& GatewayMetrics::labelled(std::map<std::string, runtime::Counter*>& family,
                                           const MetricName& metric, const char* label,
                                           const std::string& value) {
  runtime::Counter*& slot = family[value];
  if (slot == nullptr) slot = &registry_.counter(metric.name, metric.help, {{label, value}});
  return *slot;
}

runtime::Counter& GatewayMetrics::outcome(const std::string& outcome) {
  return labelled(outcomes_, kRequests, "outcome", outcome);
}

runtime::Counter& GatewayMetrics::approximate(const std::string& outcome) {
  return labelled(approximate_, kApproximateRequests, "outcome", outcome);
}

runtime::Counter& GatewayMetrics::transition(const std::string& reason) {
  return labelled(transitions_, kApproximateTransitions, "reason", reason);
}

runtime::Counter& GatewayMetrics::rejected(const std::string& reason) {
  return labelled(rejected_, kRejected, "reason", reason);
}

runtime::Counter& GatewayMetrics::stage_refused(const char* reason, wire::MessageType type) {
  const char* type_name = wire::message_type_name(type);
  runtime::Counter*& slot = stage_refused_[std::string(reason) + "/" + type_name];
  if (slot == nullptr)
    slot = &registry_.counter(kStageRefused.name, kStageRefused.help,
                              {{"reason", reason}, {"type", type_name}});
  return *slot;
}

}  // namespace moeline::stages
