#pragma once
// Every metric the gateway exports, named in one place: the table below is what /metrics shows
// (the HTTP front and the dashboards read these names), and GatewayMetrics registers each one
// once, at start, so a scrape before the first request already lists them.

#include <map>
#include <string>

#include "schemas/wire.h"
#include "stages/runtime/metrics.h"

namespace moeline::stages {

using runtime::MetricName;

namespace gateway_metric {
inline constexpr MetricName kQueueDepth{"moeline_gateway_queue_depth",
                                        "Requests waiting in the gateway for a replica"};
inline constexpr MetricName kInFlight{"moeline_gateway_in_flight_requests", "Requests in flight"};
inline constexpr MetricName kKvBlocks{"moeline_gateway_kv_blocks",
                                      "KV blocks of all decode replicas (from heartbeats)"};
inline constexpr MetricName kBatchSize{"moeline_gateway_batch_size",
                                       "Decode batch size reported with each token batch"};
inline constexpr MetricName kTtft{"moeline_gateway_ttft_seconds",
                                  "Request received to first token sent"};
inline constexpr MetricName kTpot{"moeline_gateway_time_per_output_token_seconds",
                                  "Mean time between a request's tokens after the first"};
inline constexpr MetricName kE2e{"moeline_gateway_e2e_seconds",
                                 "Request received to its last event"};
inline constexpr MetricName kQueueTime{"moeline_gateway_queue_seconds",
                                       "Request received to dispatched to prefill"};
inline constexpr MetricName kRetries{"moeline_gateway_retries_total",
                                     "Requests restarted after the replica holding them died"};
inline constexpr MetricName kHandoverTimeouts{
    "moeline_gateway_handover_timeouts_total",
    "Hand-overs a decode replica did not confirm in time (retried)"};
inline constexpr MetricName kHandedBack{"moeline_gateway_handed_back_total",
                                        "Jobs handed back by draining replicas (sent to another)"};
inline constexpr MetricName kOrphanStreamsCancelled{
    "moeline_gateway_orphan_streams_cancelled_total",
    "Decode sequences no request here owns (a previous gateway's, or an attempt since retried or "
    "ended) that their replica was told to drop"};
inline constexpr MetricName kProbeBypassed{
    "moeline_gateway_probe_bypassed_total",
    "Requests sent to prefill without reuse because no probe answered in --probe-timeout-ms"};
inline constexpr MetricName kFeedback{"moeline_gateway_feedback_total",
                                      "Feedback messages received"};
inline constexpr MetricName kApproximateEnabled{
    "moeline_gateway_approximate_enabled",
    "1 while approximate reuse is on (the rollback controller or an operator turns it off)"};
inline constexpr MetricName kProbeFraction{
    "moeline_gateway_probe_prefill_ratio",
    "A request's probe lookup time over its prefill's forward time (requests prefilled)"};
inline constexpr MetricName kShadowAgreement{
    "moeline_gateway_shadow_agreement",
    "Sampled shadow checks (of hits the rule serves) that agreed, over the controller's window"};
inline constexpr MetricName kShadowChecks{"moeline_gateway_shadow_checks_total",
                                          "Shadow checks by result"};
inline constexpr MetricName kApproximateFeedback{"moeline_gateway_approximate_feedback_total",
                                                 "Feedback on answers served by approximate reuse"};
inline constexpr MetricName kApproximateRequests{
    "moeline_gateway_approximate_requests_total",
    "Requests that asked for approximate reuse, by outcome"};
inline constexpr MetricName kApproximateTransitions{
    "moeline_gateway_approximate_transitions_total",
    "Approximate reuse turned on or off, by reason"};
inline constexpr MetricName kRequests{"moeline_gateway_requests_total", "Requests by outcome"};
inline constexpr MetricName kRejected{"moeline_gateway_rejected_total",
                                      "Requests and frames refused at the gateway"};
inline constexpr MetricName kStageRefused{
    "moeline_gateway_stage_messages_refused_total",
    "Results and messages from a stage that was not entitled to send them"};
inline constexpr MetricName kStreamMessages{
    "moeline_gateway_stream_messages_total",
    "Messages of stream events sent to clients, by kind (event: one StreamEvent; batch: a "
    "StreamEventBatch of one connection's events)"};
inline constexpr MetricName kStreamEvents{"moeline_gateway_stream_events_total",
                                          "Stream events sent to clients"};
inline constexpr MetricName kAuthenticated{
    "moeline_gateway_authenticated",
    "1 when the tcp:// endpoints run Curve with the stage allow-list"};
}  // namespace gateway_metric

class GatewayMetrics {
 public:
  explicit GatewayMetrics(runtime::Registry& registry);

  runtime::Counter& outcome(const std::string& outcome);  // kRequests
  runtime::Counter& approximate(const std::string& outcome);
  runtime::Counter& transition(const std::string& reason);
  runtime::Counter& rejected(const std::string& reason);
  runtime::Counter& stage_refused(const char* reason, wire::MessageType type);
  runtime::Counter& shadow_check(bool agreed) { return *shadow_checks_[agreed ? 1 : 0]; }
  runtime::Counter& approximate_feedback(bool negative) {
    return *approximate_feedback_[negative ? 1 : 0];
  }

  runtime::Gauge *probe_queue, *prefill_queue, *decode_queue, *in_flight, *kv_used, *kv_free;
  runtime::Gauge *approximate_enabled, *shadow_agreement, *authenticated;
  runtime::Histogram *batch_size, *ttft, *tpot, *e2e, *queue_time, *probe_fraction;
  runtime::Counter *retries, *handover_timeouts, *handed_back, *probe_bypassed, *feedback;
  runtime::Counter* orphan_streams_cancelled;
  runtime::Counter *stream_events, *stream_messages_single, *stream_messages_batch;

 private:
  runtime::Counter& labelled(std::map<std::string, runtime::Counter*>& family,
                             const MetricName& metric, const char* label, const std::string& value);

  runtime::Registry& registry_;
  runtime::Counter* shadow_checks_[2];
  runtime::Counter* approximate_feedback_[2];
  std::map<std::string, runtime::Counter*> outcomes_, approximate_, transitions_, rejected_,
      stage_refused_;
};

}  // namespace moeline::stages
