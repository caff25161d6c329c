#include "stages/gateway/broker.h"

#include <algorithm>

#include "stages/runtime/intake.h"

namespace moeline::stages {

// Messages a kind of stage may send: a probe does not hand out expert plans, an offload manager
// does not store snapshots.
bool Broker::from_stage(const std::string& from, wire::MessageType type,
                        std::initializer_list<wire::StageKind> kinds) {
  const runtime::Peer* peer = hub_.peer(from);
  if (peer != nullptr && std::find(kinds.begin(), kinds.end(), peer->stage) != kinds.end())
    return true;
  refuse(from, type, "wrong_stage");
  return false;
}

void Broker::refuse(const std::string& from, wire::MessageType type, const char* reason) {
  const runtime::Peer* peer = hub_.peer(from);
  metrics_.stage_refused(reason, type).inc();
  if (uint64_t suppressed = 0; stage_refusal_log_.allow(suppressed))
    log_.warn("stage_message_refused", {{"peer", peer ? peer->replica : std::string("?")},
                                        {"stage", peer ? wire::stage_name(peer->stage) : "?"},
                                        {"type", wire::message_type_name(type)},
                                        {"reason", reason},
                                        {"suppressed", suppressed}});
}

// Tells the prefill or decode replica holding the request to drop it (a probe answers at once,
// there is nothing to cancel there).
void Broker::cancel_at_owner(Request& r) {
  release_reservations(r);
  const runtime::Peer* owner = r.owner.empty() ? nullptr : hub_.peer(r.owner);
  if (owner == nullptr || owner->stage == wire::StageKind::Probe) {
    r.owner.clear();
    return;
  }
  send_cancel(r.owner, r.id, r.attempt);
  r.owner.clear();
}

void Broker::cancel_orphan(const std::string& peer, uint64_t id, uint32_t attempt) {
  const runtime::Peer* replica = hub_.peer(peer);
  if (replica == nullptr || replica->stage != wire::StageKind::Decode) return;
  send_cancel(peer, id, attempt);
  metrics_.orphan_streams_cancelled->inc();
}

void Broker::send_cancel(const std::string& peer, uint64_t id, uint32_t attempt) {
  flatbuffers::FlatBufferBuilder builder(64);
  builder.Finish(wire::CreateCancelJob(builder, id, attempt), wire::PrefillJobIdentifier());
  hub_.send(peer, wire::encode(wire::MessageType::CancelJob, builder), false);
}

// The prefill credit held for a job the probe was to send on. `may_still_come`: the probe may
// yet send it (the request was retried, bypassed or cancelled meanwhile); prefill will then
// return a credit for it that was already given back here, which its result takes again.
void Broker::release_prefill(Request& r, bool may_still_come) {
  if (!r.prefill_reserved) return;
  r.prefill_reserved = false;
  hub_.restore_credit(r.handed_by);
  if (may_still_come) {
    if (stale_prefill_.size() > 4096) stale_prefill_.clear();
    stale_prefill_[{r.id, r.attempt}] = r.handed_by;
  }
}

// A result of a prefill job the gateway had given up on (release_prefill): its credit once more.
void Broker::settle_stale_prefill(uint64_t id, uint32_t attempt, const std::string& from) {
  auto it = stale_prefill_.find({id, attempt});
  if (it == stale_prefill_.end() || it->second != from) return;
  hub_.spend_credit(from);
  stale_prefill_.erase(it);
}

// The credits held for this attempt's transfers that will not be confirmed go back: the
// prefill replica's (see release_prefill) and the decode replica's. Should a hand-over reach
// decode after all, its HandoverAccepted finds no request: the gateway cancels it there and
// takes that credit again (on_handover_accepted), so none is counted twice.
void Broker::release_reservations(Request& r) {
  release_prefill(r, true);
  if (r.decode_reserved) hub_.restore_credit(r.decode_target);
  r.decode_reserved = r.handover_pending = r.handover_confirmed = false;
  r.decode_target.clear();
  r.handed_by.clear();
}

// Entries every probe keeps (each has its own store).
void Broker::forward_to_probes(std::vector<zmq::message_t>&& frames) {
  std::vector<std::string> probes;
  for (const auto& [identity, peer] : hub_.peers())
    if (peer.stage == wire::StageKind::Probe) probes.push_back(identity);
  for (size_t i = 0; i < probes.size(); ++i) {
    std::vector<zmq::message_t> copy;
    if (i + 1 < probes.size()) {
      for (zmq::message_t& frame : frames) copy.emplace_back().copy(frame);  // shares the data
    } else {
      copy = std::move(frames);
    }
    hub_.send(probes[i], copy, false);
  }
}

// One SnapshotPut entry, its record as the bulk frame, to the probe that owns `cache_namespace`
// (every probe when null).
void Broker::put_to_probes(uint64_t key, wire::SnapshotKind kind, const std::string& record,
                           const std::string* cache_namespace) {
  flatbuffers::FlatBufferBuilder builder(256);
  std::vector<flatbuffers::Offset<wire::SnapshotEntry>> entries = {
      wire::CreateSnapshotEntry(builder, key, kind)};
  std::vector<flatbuffers::Offset<wire::BulkFrame>> frames = {wire::CreateBulkFrame(
      builder, record.size(),
      wire::checksum({reinterpret_cast<const uint8_t*>(record.data()), record.size()}))};
  builder.Finish(
      wire::CreateSnapshotPut(builder, builder.CreateVector(entries), builder.CreateVector(frames)),
      wire::PrefillJobIdentifier());
  std::vector<zmq::message_t> bulk;
  bulk.emplace_back(record.data(), record.size());
  std::vector<zmq::message_t> put =
      wire::encode(wire::MessageType::SnapshotPut, builder, std::move(bulk));
  if (cache_namespace == nullptr) return forward_to_probes(std::move(put));
  if (runtime::Peer* probe = probe_for(*cache_namespace)) hub_.send(probe->identity, put, false);
}

runtime::Peer* Broker::pick_with_intake(wire::StageKind stage) {
  runtime::Peer* peer = hub_.pick(stage);
  if (peer == nullptr || peer->intake.empty()) return nullptr;  // an older build: no intake
  hub_.spend_credit(peer->identity);
  return peer;
}

runtime::Peer* Broker::probe_for(const std::string& cache_namespace) {
  std::vector<std::string> replicas;
  for (const auto& [identity, peer] : hub_.peers())
    if (peer.stage == wire::StageKind::Probe && !peer.draining) replicas.push_back(peer.replica);
  probe_ring_.update(std::move(replicas));
  const std::string& owner = probe_ring_.owner(cache_namespace);
  for (const auto& [identity, peer] : hub_.peers())
    if (peer.stage == wire::StageKind::Probe && !peer.draining && peer.replica == owner)
      return hub_.peer(identity);
  return nullptr;
}

const runtime::Peer* Broker::store_for(const std::string& cache_namespace) {
  const runtime::Peer* probe = probe_for(cache_namespace);
  return probe != nullptr && !probe->intake.empty() ? probe : nullptr;
}

flatbuffers::Offset<wire::PeerRoute> Broker::route_to(flatbuffers::FlatBufferBuilder& builder,
                                                      const runtime::Peer& peer, const Request& r) {
  const runtime::Ticket ticket = runtime::handover_ticket(peer.handover_key, r.id, r.attempt);
  return wire::CreatePeerRoute(
      builder, builder.CreateString(peer.replica), builder.CreateString(peer.intake),
      builder.CreateString(peer.intake_key), builder.CreateVector(ticket.data(), ticket.size()),
      builder.CreateString(peer.intake_node));
}

void Broker::forward_to_offload(wire::Message& message) {
  runtime::Peer* offload = hub_.pick(wire::StageKind::OffloadManager);
  if (offload == nullptr) return;  // compute stages ask again; usage is advisory
  const std::string identity = offload->identity;
  hub_.send(identity, message.release_frames(), false);
}

runtime::Peer* Broker::prefill_for(uint64_t prefix_key) {
  if (prefix_key != 0)
    if (auto it = prefix_affinity_.find(prefix_key); it != prefix_affinity_.end())
      if (runtime::Peer* preferred = hub_.peer(it->second);
          preferred != nullptr && preferred->credits > 0)
        return preferred;
  return hub_.pick(wire::StageKind::Prefill);
}

void Broker::remember_prefix(uint64_t prefix_key, const std::string& identity) {
  if (prefix_key == 0) return;
  if (prefix_affinity_.size() > 65536) prefix_affinity_.clear();
  prefix_affinity_[prefix_key] = identity;
}

}  // namespace moeline::stages
