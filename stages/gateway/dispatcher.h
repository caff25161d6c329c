#pragma once
// Sends the gateway's queued work to the stages once a replica has room: a request to the probe
// that owns its namespace (with the prefill and decode replicas picked for it), a plan the probe
// sent back to prefill, a full hit's KV to decode.

#include <cstddef>
#include <cstdint>

#include "stages/gateway/broker.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/request.h"
#include "stages/gateway/tracker.h"
#include "stages/runtime/hub.h"

namespace moeline::stages {

class Dispatcher {
 public:
  Dispatcher(RequestTracker& tracker, Broker& broker, runtime::Hub& hub, GatewayMetrics& metrics,
             size_t max_decode_backlog)
      : tracker_(tracker),
        broker_(broker),
        hub_(hub),
        metrics_(metrics),
        max_decode_backlog_(max_decode_backlog) {}

  // Each loop iteration: as much as the replicas' credits allow.
  void dispatch();

 private:
  void to_probes();
  void to_prefill();
  void to_decode();
  // Prefill stores the prompt's blocks and record as allowed, and its signature where the
  // namespace allows approximate reuse (so that later prompts find it).
  static uint32_t store_levels_of(const Request& r);

  RequestTracker& tracker_;
  Broker& broker_;
  runtime::Hub& hub_;
  GatewayMetrics& metrics_;
  size_t max_decode_backlog_;
};

}  // namespace moeline::stages
