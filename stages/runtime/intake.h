#pragma once
// Bulk data from peer to peer. A stage that receives bulk data (decode: a prompt's KV from
// prefill; probe: snapshot puts from prefill) binds an Intake, a ROUTER of its own, and announces
// its endpoint in its hello; the gateway, which arranges each transfer, names that endpoint in
// the job (a PeerRoute) together with a ticket, and the sender connects there with a PeerSender.
// So the gateway only brokers: it never carries a KV or snapshot byte.
//
// Who may send: the intake takes a message only with a valid ticket, an HMAC-SHA-512-256 of the
// request id and attempt under a key the gateway gave this replica at hello (HelloReply), so only
// a transfer the gateway arranged is accepted, whoever connects. With Curve (--curve-dir) the
// intake is a Curve server with the stage's own key pair (its public key travels in the hello and
// the route), so the channel is encrypted and the receiver authenticated; without Curve an ipc://
// intake is readable and writable by its owner alone, like the hub's socket.
//
// On one node the bulk frames of a transfer go through shared memory instead of the socket
// (shared_bulk.h, --shm-handover): the intake announces its node token, and a sender whose token
// is the same copies them into its shared-memory arena, and the intake copies them out.
//
// The endpoint (--intake-bind): "auto" derives it from the hub's: next to an ipc:// hub, a socket
// file in the same folder; for a tcp:// hub, a free port on the address this host reaches the
// hub from (what another host can reach too). --intake-advertise overrides what peers are told.
//
// Not thread-safe: the stage loop owns both.

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "schemas/wire.h"
#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"
#include "stages/runtime/security.h"
#include "stages/runtime/shared_bulk.h"

namespace moeline::runtime {

inline constexpr size_t kHandoverKeyBytes = 32;
inline constexpr size_t kTicketBytes = 32;
using HandoverKey = std::array<uint8_t, kHandoverKeyBytes>;
using Ticket = std::array<uint8_t, kTicketBytes>;
inline constexpr const char* kIntakeDomain = "moeline-intake";

HandoverKey new_handover_key();
Ticket handover_ticket(const HandoverKey& key, uint64_t request_id, uint32_t attempt);
// Constant-time comparison against the ticket the key gives for this job.
bool valid_ticket(const HandoverKey& key, uint64_t request_id, uint32_t attempt,
                  std::span<const uint8_t> ticket);

// A process's standing ticket for reports that belong to no request (compute stages' expert-usage
// reports to the offload manager): `key` over the routing identity that the issuer gave it to,
// which only that process learned (through the hub, which authenticated it).
Ticket reporter_ticket(const HandoverKey& key, std::string_view reporter);
bool valid_reporter_ticket(const HandoverKey& key, std::string_view reporter,
                           std::span<const uint8_t> ticket);

// Whether a message that came to an intake (a PrefillJob, PrefillDone or SnapshotPut) carries
// the ticket of its request and attempt under `key`, the key the hub gave this process (none
// yet: nothing is taken).
template <class Table>
bool has_valid_ticket(const std::optional<HandoverKey>& key, const Table& table) {
  return key && table.ticket() != nullptr &&
         valid_ticket(*key, table.request_id(), table.attempt(),
                      {table.ticket()->data(), table.ticket()->size()});
}

// The endpoint to bind for `setting` ("auto" or an endpoint) next to the hub at `hub`.
std::string intake_bind_endpoint(const std::string& setting, const std::string& hub,
                                 const std::string& stage, const std::string& replica);

struct IntakeSettings {
  std::string bind = "auto";  // --intake-bind
  std::string advertise;      // --intake-advertise (empty: the bound endpoint)
  std::string hub;            // the hub's endpoint, for "auto"
  std::string stage, replica;
  size_t max_message_bytes = 0;            // 0: no limit
  std::optional<CurveKeyPair> curve_keys;  // with Curve: this stage's key pair
  SharedBulkSettings shared_bulk;          // --shm-handover
};

// Where a transfer goes: a PeerRoute's endpoint, Curve key and node token.
struct PeerAddress {
  std::string endpoint, server_key, node;
  static PeerAddress of(const wire::PeerRoute* route);
  bool empty() const { return endpoint.empty(); }
};

class Intake {
 public:
  // Binds (throws ConfigError when the endpoint cannot be bound). With Curve, `zap` must be the
  // process's ZAP handler: the intake domain admits any client key (the ticket says who may send).
  Intake(zmq::context_t& context, IntakeSettings settings, Logger& log, Registry& metrics,
         ZapHandler* zap);
  ~Intake();
  Intake(const Intake&) = delete;
  Intake& operator=(const Intake&) = delete;

  // What peers are told: the endpoint, and the Curve public key (empty without Curve).
  const std::string& endpoint() const { return advertised_; }
  const std::string& public_key() const { return public_key_; }
  // The node token senders of this node use shared memory with (empty: sockets only).
  const std::string& node() const;
  zmq::socket_t& socket() { return socket_; }

  // One waiting message (non-blocking); malformed frames are counted and dropped.
  std::optional<wire::Message> receive();
  // Whether a message is waiting.
  bool pending() { return (socket_.get(zmq::sockopt::events) & ZMQ_POLLIN) != 0; }
  // Counts and logs a message the stage refused (a bad ticket, a type this intake does not take).
  void refuse(wire::MessageType type, const char* reason);

 private:
  zmq::socket_t socket_;
  std::string bound_, advertised_, public_key_;
  size_t max_bulk_bytes_;
  std::unique_ptr<SharedBulk> shared_bulk_;
  Logger& log_;
  Registry& metrics_;
  RateLimited log_limit_;
};

// The sending end: one DEALER per intake endpoint, kept for the next transfer (the least recently
// used is closed past `max_connections`). A send never blocks: when the peer cannot take the
// message (its queue is full, or it is unreachable and the queue has filled) it returns false.
class PeerSender {
 public:
  // With `shared_bulk` enabled, transfers to an intake of this node go through shared memory.
  PeerSender(zmq::context_t& context, std::optional<CurveKeyPair> curve_keys,
             const SharedBulkSettings& shared_bulk, Registry& metrics, Logger& log,
             size_t max_connections = 16);
  ~PeerSender();
  PeerSender(const PeerSender&) = delete;
  PeerSender& operator=(const PeerSender&) = delete;

  bool send(const PeerAddress& to, std::vector<zmq::message_t>&& frames);
  // Connects ahead of the first send (the handshake then runs while the sender computes what it
  // will send), so that a transfer is not slower than the messages that follow it elsewhere.
  void prepare(const PeerAddress& to);

 private:
  struct Connection {
    std::string endpoint;
    zmq::socket_t socket;
  };
  zmq::socket_t& connection(const std::string& endpoint, const std::string& server_key);

  zmq::context_t& context_;
  std::optional<CurveKeyPair> curve_keys_;
  size_t max_connections_;
  std::unique_ptr<SharedBulk> shared_bulk_;
  std::list<Connection> connections_;  // most recently used first
};

}  // namespace moeline::runtime
