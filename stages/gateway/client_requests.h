#pragma once
// What clients send the gateway, each message type to its handler: a GenerateRequest becomes a
// Request for the tracker (validated, admitted by the tenant's limits and the reuse policy,
// seeded so that a retry replays what the client already has), a cancel ends one, feedback goes
// to the reuse policy, an operator's command to the control commands. Every refusal is an Error
// event to the client, counted by reason.

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "model/model_info.h"
#include "schemas/wire.h"
#include "stages/gateway/client_front.h"
#include "stages/gateway/control.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/reuse_control.h"
#include "stages/gateway/tenant_limits.h"
#include "stages/gateway/tracker.h"
#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"

namespace moeline::stages {

// The first request id of a gateway started at `started`. Decode and prefill replicas outlive a
// gateway that dies: the sequences its requests left there go on streaming to the next one, so a
// restarted gateway must never hand out an id its previous life did (their tokens would be
// taken for the new request's). Ids begin at the start millisecond times 2^11: an earlier life
// would have had to issue over two million requests for every second it ran to reach them (a
// restart within the second of the last start included, which a start second could not tell
// apart), and ids stay below 2^53 (exact in JSON readers that use doubles) until 2109.
uint64_t first_request_id(std::chrono::system_clock::time_point started);

class ClientRequests {
 public:
  struct Parts {
    ClientChannel& client;
    RequestValidator& validator;
    TenantLimiter& tenant_limiter;
    ReuseControl& reuse;
    ControlCommands& control;
    RequestTracker& tracker;
    GatewayMetrics& metrics;
    runtime::Registry& registry;
    runtime::Logger& log;
  };
  ClientRequests(Parts parts, const model::ModelInfo& model, const wire::Limits& limits,
                 size_t max_in_flight)
      : p_(parts), model_(model), limits_(limits), max_in_flight_(max_in_flight) {}

  // One client message as it came off the socket (its routing identity first).
  void on_frames(std::vector<zmq::message_t>&& frames);
  // From now on new requests are refused (Draining); those in flight go on.
  void stop_admitting() { draining_ = true; }

 private:
  void reject(const std::string& client, uint64_t client_request_id, wire::ErrorCode code,
              const std::string& reason, const std::string& text);
  void on_generate(const std::string& client, wire::Message& message);
  void on_cancel(const std::string& client, wire::Message& message);
  void on_feedback(const std::string& client, wire::Message& message);
  void on_control(const std::string& client, wire::Message& message);

  Parts p_;
  const model::ModelInfo& model_;
  wire::Limits limits_;
  size_t max_in_flight_;
  bool draining_ = false;
  std::mt19937_64 seed_source_{std::random_device{}()};
  uint64_t next_request_id_ = first_request_id(std::chrono::system_clock::now());
  runtime::RateLimited reject_log_, frame_log_;
};

}  // namespace moeline::stages
