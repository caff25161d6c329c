#pragma once
// The gateway's request tracker: every request from intake to its last event. It keeps the
// requests in flight and the gateway's queues (waiting for a probe, for prefill, for decode),
// streams each token to its client in order (tokens of a retried attempt are checked against what
// the client already has), and ends every request exactly once: finished, failed with a clear
// error, retried as a new attempt when the replica holding it dies or a hand-over is not
// confirmed, sent on without reuse when its probe is slow, or ended at its deadline.

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>

#include "schemas/wire.h"
#include "stages/gateway/broker.h"
#include "stages/gateway/client_front.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/request.h"
#include "stages/gateway/reuse_control.h"
#include "stages/gateway/tenant_limits.h"
#include "stages/runtime/hub.h"
#include "stages/runtime/log.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages {

struct TrackerSettings {
  uint32_t max_retries = 2;                           // --max-retries
  std::chrono::milliseconds probe_timeout{0};         // --probe-timeout-ms (0: wait for the probe)
  std::chrono::milliseconds handover_timeout{10000};  // --handover-timeout-ms
};

class RequestTracker {
 public:
  // What the tracker works with; owned by the gateway, outliving the tracker.
  struct Parts {
    runtime::Hub& hub;
    Broker& broker;
    ClientChannel& client;
    ReuseControl& reuse;
    TenantLimiter& limiter;
    const tokenizer::Tokenizer& tokenizer;
    GatewayMetrics& metrics;
    runtime::Logger& log;
  };
  RequestTracker(TrackerSettings settings, const Parts& parts);

  // A request the gateway took in (admitted by the tenant limiter), queued for a probe.
  Request& add(Request request);
  Request* of_client(const std::string& client, uint64_t client_request_id);
  // This attempt of a request, if it is still in flight.
  Request* find(uint64_t id, uint32_t attempt);
  // A result counts only from the replica the job was given to. Another peer's answer for it (a
  // stage answering jobs it never got, to put its tokens in someone else's stream) is dropped
  // and counted; a stale attempt's is simply ignored.
  Request* owned(uint64_t id, uint32_t attempt, const std::string& from, wire::MessageType type);
  // A result from the prefill replica the probe sent the job to, for a request still waiting for
  // the probe's notice (which it overtook): from now on that replica holds it.
  Request* from_prefill(uint64_t id, uint32_t attempt, const std::string& from,
                        wire::MessageType type);
  void took_job_from_probe(Request& r);

  // A token of the current attempt, with the finish reason of the last one.
  void on_token(Request& r, int32_t token, wire::FinishReason finish_reason,
                const wire::TokenLogprobs* logprobs = nullptr,
                const PromptLogprobs* prompt_logprobs = nullptr);
  void finish(Request& r, wire::FinishReason reason);
  void fail(Request& r, wire::ErrorCode code, const std::string& outcome, const std::string& text);
  void fail_all(wire::ErrorCode code, const std::string& outcome, const std::string& text);
  // Nobody reads the request's events any more (its connection is gone): stop spending compute on
  // it. Nothing for a request that has already ended.
  void on_client_gone(uint64_t id);
  // A new attempt from the probe on, or the request's end past --max-retries.
  void retry_or_fail(Request& r, const std::string& why);

  // Each loop iteration: the probes that do not answer, the replicas that died, the deadlines
  // and the hand-overs that were not confirmed.
  void bypass_slow_probes();
  void on_peer_lost(const runtime::Peer& dead);
  void expire_deadlines();

  size_t size() const { return requests_.size(); }
  const std::unordered_map<uint64_t, Request>& requests() const { return requests_; }

  // The gateway's queues, by request attempt (an entry whose attempt is gone is skipped).
  std::deque<JobKey> probe_queue, prefill_queue;
  std::deque<Handoff> decode_queue;

 private:
  void queue_for_probe(Request& r);
  void erase(Request& r);
  void store_result(const Request& r, wire::FinishReason reason);

  TrackerSettings settings_;
  runtime::Hub& hub_;
  Broker& broker_;
  ClientChannel& client_;
  ReuseControl& reuse_;
  TenantLimiter& limiter_;
  const tokenizer::Tokenizer& tokenizer_;
  GatewayMetrics& metrics_;
  runtime::Logger& log_;
  std::unordered_map<uint64_t, Request> requests_;
  std::map<std::pair<std::string, uint64_t>, uint64_t> by_client_;
  Clock::time_point last_deadline_scan_, last_bypass_scan_;
  runtime::RateLimited bypass_log_;
};

}  // namespace moeline::stages
