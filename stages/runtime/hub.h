#pragma once
// The hub end of the stage links: a ROUTER that worker stages (probe, prefill, decode, offload)
// connect to. It answers hellos (refusing another schema major or settings hash, loudly), tracks
// each peer's credits and liveness from heartbeats, and picks the peer of a kind with the most
// free credit for the next job. A peer silent for longer than the timeout is dropped and returned
// by tick(), so its owner can retry or fail the jobs that peer held.
//
// The gateway is the hub of a stack; `moeline load` is a hub for one stage driven directly.
// Not thread-safe: the owning loop drives it.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "schemas/wire.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/link.h"
#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"
#include "stages/runtime/security.h"

namespace moeline::runtime {

struct Peer {
  std::string identity;
  wire::StageKind stage = wire::StageKind::Prefill;
  std::string replica;
  uint32_t credits = 0;
  uint32_t queue_depth = 0, active = 0, kv_used = 0, kv_free = 0;
  uint32_t pid = 0;
  uint16_t http_port = 0;
  std::chrono::steady_clock::time_point last_seen;
  uint64_t last_picked = 0;  // Hub::pick's turn when it last chose this peer (0: never)
  std::string key;           // the Curve key it connected with ("role:name"); empty without Curve
  bool draining = false;     // finishing what it holds; never picked for new work
  // Its intake (where peers send it bulk data directly; empty: none) and the key that signs the
  // transfers the hub's owner arranges to it (given to the peer in the HelloReply), and its node
  // token (senders of the same node hand bulk over through shared memory).
  std::string intake, intake_key, intake_node;
  HandoverKey handover_key{};
};

// What the hub's socket admits. With `curve` (the gateway's key pair and the stage allow-list,
// checked by `zap`), a peer is who its key says it is: a hello for a stage kind other than its
// key's role is refused, and every later message must come over a connection with that key.
struct HubSecurity {
  size_t max_message_bytes = 0;  // 0: no limit (ZMQ_MAXMSGSIZE drops the connection past it)
  const CurveSettings* curve = nullptr;
  ZapHandler* zap = nullptr;
};

// Credit a peer may hold: grants past it are clipped, so a peer cannot wrap the counter.
inline constexpr uint32_t kMaxCredits = 1u << 20;

class Hub {
 public:
  Hub(zmq::context_t& context, const std::string& bind, uint64_t settings_hash, int heartbeat_ms,
      int peer_timeout_ms, Logger& log, Registry& metrics, HubSecurity security = {});
  bool authenticated() const { return authenticated_; }

  zmq::socket_t& socket() { return socket_; }

  struct Incoming {
    std::string identity;
    wire::Message message;
  };
  // One waiting message for the owner (non-blocking). Hellos, heartbeats and credits (Credit
  // messages, and the credit in other messages' envelopes) are handled here; refused frames are
  // counted, logged and answered.
  std::optional<Incoming> receive();

  Peer* peer(const std::string& identity);
  // Sends no more work to this peer (an operator's drain); false if there is no such replica.
  bool drain(const std::string& replica);
  // The live peer of this kind with the most credit; among equals, the one picked longest ago (a
  // replica that hands its credit straight back must not take every job). nullptr when none has
  // any credit.
  Peer* pick(wire::StageKind stage);
  bool any(wire::StageKind stage) const;
  size_t count(wire::StageKind stage) const;
  // Sends to a peer; `job` spends one of its credits. False if the peer is gone: it is then
  // reported dead by the next tick() (no more work goes to it), and the frames not sent stay in
  // `frames`.
  bool send(const std::string& identity, std::vector<zmq::message_t>& frames, bool job);
  bool send(const std::string& identity, std::vector<zmq::message_t>&& frames, bool job) {
    return send(identity, frames, job);
  }
  // Credit the owner gives back for a job it had reserved on this peer that will never reach it
  // (clipped like a grant), or takes for one the peer will hand back twice.
  void restore_credit(const std::string& identity);
  void spend_credit(const std::string& identity);
  // Heartbeats to every peer when due; returns the peers that timed out or could not be reached
  // (now forgotten).
  std::vector<Peer> tick();
  const std::map<std::string, Peer>& peers() const { return peers_; }

 private:
  uint64_t picks_ = 0;
  void on_hello(const std::string& identity, const std::string& key, const wire::Message& message);
  void refuse_peer(const std::string& identity, const std::string& reason);
  // Credit granted back by a peer, counted by what carried it.
  void add_credits(Peer& peer, uint32_t credits, bool in_envelope);
  void reply_error(const std::string& identity, wire::ErrorCode code, const std::string& text);
  void update_gauges();

  zmq::socket_t socket_;
  uint64_t settings_hash_;
  std::chrono::milliseconds heartbeat_, timeout_;
  Logger& log_;
  Registry& metrics_;
  Counter& credits_in_envelopes_;
  Counter& credits_in_messages_;
  std::map<std::string, Peer> peers_;
  std::vector<std::string> unreachable_;
  std::chrono::steady_clock::time_point last_heartbeat_;
  RateLimited log_limit_;
  bool authenticated_ = false;
  // Everything that crosses the hub, by direction and message type (what the gateway carries:
  // with bulk data peer to peer, a request's share no longer grows with its prompt's KV).
  static std::pair<uint16_t, size_t> type_and_size(const std::vector<zmq::message_t>& frames);
  // Bytes and messages through the hub, by direction and message type.
  void count_traffic(bool in, uint16_t type, size_t bytes);
  struct TypeCounters {
    Counter* bytes = nullptr;
    Counter* messages = nullptr;
  };
  std::map<std::pair<bool, uint16_t>, TypeCounters> traffic_;
};

}  // namespace moeline::runtime
