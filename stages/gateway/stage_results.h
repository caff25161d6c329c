#pragma once
// What the stages send the gateway on the hub, through a handler table: the probe's plans,
// prefill's first tokens, decode's hand-over confirmations and token batches, failures, and the
// expert-plan traffic between the compute stages and the offload manager. Each result counts
// only from the replica that holds the request (RequestTracker::owned).

#include "stages/gateway/broker.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/reuse_control.h"
#include "stages/gateway/tracker.h"
#include "stages/runtime/hub.h"
#include "stages/runtime/log.h"

namespace moeline::stages {

class StageResults {
 public:
  StageResults(RequestTracker& tracker, Broker& broker, ReuseControl& reuse, runtime::Hub& hub,
               GatewayMetrics& metrics, runtime::Logger& log, double blend_max_kl)
      : tracker_(tracker),
        broker_(broker),
        reuse_(reuse),
        hub_(hub),
        metrics_(metrics),
        log_(log),
        blend_max_kl_(blend_max_kl) {}

  void on_stage(runtime::Hub::Incoming& incoming);

 private:
  void on_probe_plan(runtime::Hub::Incoming& incoming);
  void on_prefill_done(runtime::Hub::Incoming& incoming);
  void on_handover_accepted(runtime::Hub::Incoming& incoming);
  void on_token_batch(runtime::Hub::Incoming& incoming);
  void on_job_failed(runtime::Hub::Incoming& incoming);
  void on_expert_traffic(runtime::Hub::Incoming& incoming);
  void on_snapshot_put(runtime::Hub::Incoming& incoming);
  void on_expert_plan(runtime::Hub::Incoming& incoming);
  void on_stage_error(runtime::Hub::Incoming& incoming);
  void replay_early(uint64_t id, uint32_t attempt);

  RequestTracker& tracker_;
  Broker& broker_;
  ReuseControl& reuse_;
  runtime::Hub& hub_;
  GatewayMetrics& metrics_;
  runtime::Logger& log_;
  double blend_max_kl_;
};

}  // namespace moeline::stages
