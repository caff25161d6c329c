#pragma once
// Where the probe's answers go. A ProbeJob that names the prefill and decode replicas the gateway
// picked (1.7) is answered on the shortest path: a plan that needs a forward pass goes to the
// prefill replica's intake as its PrefillJob (with the cached prefix's KV), and the gateway gets
// only a notice of the plan; a full hit's KV goes to the decode replica's intake and the gateway
// gets its PrefillDone without it. A job without routes (`moeline load`, an older gateway), and a
// route that cannot take the message, gets the answer the gateway dispatches itself, as before.

#include <functional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "schemas/wire.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/link.h"

namespace moeline::stages {

class PlanRouter {
 public:
  PlanRouter(runtime::HubLink& link, runtime::PeerSender& peers, runtime::Intake& intake)
      : link_(link), peers_(peers), intake_(intake) {}

  // A plan as the probe built it for the gateway (a ProbePlan with its bulk frames).
  void send_plan(const wire::ProbeJob& job, std::vector<zmq::message_t>&& plan);

  // A full hit's PrefillDone: `build(with_kv, ticket)` encodes it, with the KV or without.
  using BuildDone = std::function<std::vector<zmq::message_t>(
      bool with_kv, const flatbuffers::Vector<uint8_t>* ticket)>;
  void send_done(const wire::ProbeJob& job, bool sequence_goes_on, const BuildDone& build);

 private:
  std::vector<zmq::message_t> prefill_job(const wire::ProbeJob& job, wire::Message& plan);
  static std::vector<zmq::message_t> notice(const wire::ProbePlan& plan);

  runtime::HubLink& link_;
  runtime::PeerSender& peers_;
  runtime::Intake& intake_;
};

}  // namespace moeline::stages
