#pragma once
// The gateway's broker: which replica does what. It places work on the stages' replicas (the
// probe that owns a namespace by consistent hashing, prefill and decode replicas by credit,
// prefill by cached-prefix affinity), signs the routes to their intakes, holds and gives back the
// credits of the transfers it arranged, and checks that a stage may send what it sent. The hub
// carries the messages; the request tracker decides when.

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "schemas/wire.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/probe_ring.h"
#include "stages/gateway/request.h"
#include "stages/runtime/hub.h"
#include "stages/runtime/log.h"

namespace moeline::stages {

class Broker {
 public:
  Broker(runtime::Hub& hub, GatewayMetrics& metrics, runtime::Logger& log)
      : hub_(hub), metrics_(metrics), log_(log) {}

  // ---- placement ----
  // The peer of this kind with the most credit among those with an intake, whose credit is spent
  // here (Hub::pick only chooses; the job that travels with it goes to another stage).
  runtime::Peer* pick_with_intake(wire::StageKind stage);
  // The probe replica that owns a namespace (its lookups and its store), by consistent hashing
  // over the live probes; nullptr when none is connected.
  runtime::Peer* probe_for(const std::string& cache_namespace);
  // Where prefill puts a namespace's entries: its probe, when it has an intake.
  const runtime::Peer* store_for(const std::string& cache_namespace);
  // A prefill replica for a job that reuses the cached prefix `prefix_key` (0: none): the one
  // that took that prefix last while it has credit, so that one batch holds its blocks once.
  runtime::Peer* prefill_for(uint64_t prefix_key);
  void remember_prefix(uint64_t prefix_key, const std::string& identity);
  // A route to `peer`'s intake for this attempt of the request, signed with the peer's key.
  flatbuffers::Offset<wire::PeerRoute> route_to(flatbuffers::FlatBufferBuilder& builder,
                                                const runtime::Peer& peer, const Request& r);

  // ---- credits of the transfers the gateway arranged ----
  void release_prefill(Request& r, bool may_still_come);
  void settle_stale_prefill(uint64_t id, uint32_t attempt, const std::string& from);
  void release_reservations(Request& r);
  void cancel_at_owner(Request& r);
  // Tells a decode replica that streams tokens for an attempt no request here has (a previous
  // gateway life's, which the replicas outlive, or an attempt since retried or ended) to drop it,
  // so that it frees the sequence's slot and KV instead of decoding for nobody.
  void cancel_orphan(const std::string& peer, uint64_t id, uint32_t attempt);

  // ---- entitlement ----
  bool from_stage(const std::string& from, wire::MessageType type,
                  std::initializer_list<wire::StageKind> kinds);
  void refuse(const std::string& from, wire::MessageType type, const char* reason);

  // ---- what the gateway itself sends on ----
  void forward_to_probes(std::vector<zmq::message_t>&& frames);
  void put_to_probes(uint64_t key, wire::SnapshotKind kind, const std::string& record,
                     const std::string* cache_namespace);
  void forward_to_offload(wire::Message& message);

 private:
  void send_cancel(const std::string& peer, uint64_t id, uint32_t attempt);

  runtime::Hub& hub_;
  GatewayMetrics& metrics_;
  runtime::Logger& log_;
  runtime::RateLimited stage_refusal_log_;
  ProbeRing probe_ring_;
  std::unordered_map<uint64_t, std::string> prefix_affinity_;
  // Prefill jobs given up on whose results may still come (release_prefill), by job.
  std::map<JobKey, std::string> stale_prefill_;
};

}  // namespace moeline::stages
