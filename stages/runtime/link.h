#pragma once
// A worker stage's connection to the hub (the gateway): a DEALER that says hello (stage, schema
// version, settings hash, credits), exchanges heartbeats and carries jobs and results. Heartbeats
// go out on a side connection from their own thread, so a long forward pass never makes the hub
// think this process died. When the hub goes quiet or answers HelloRequired (it restarted), the
// link asks the stage to say hello again; when it refuses the hello (another model or schema
// major) rejected() turns true and the stage exits with the reason.
//
// Not thread-safe apart from set_load(): the stage loop owns it.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "schemas/wire.h"
#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"
#include "stages/runtime/security.h"

namespace moeline::runtime {

struct LinkSettings {
  std::string hub;  // endpoint to connect to
  wire::StageKind stage = wire::StageKind::Prefill;
  std::string replica;
  uint64_t settings_hash = 0;
  int heartbeat_ms = 500;
  int peer_timeout_ms = 3000;
  uint16_t http_port = 0;
  size_t max_message_bytes = 0;  // 0: no limit
  // With Curve: this stage's key pair and the gateway's public key (the hub must prove it holds
  // the matching secret, so a stage never hands a job's result to an impostor).
  std::optional<CurveKeyPair> curve_keys;
  std::string curve_server_key;
  // Its intake, announced in the hello (see intake.h); empty: none.
  std::string intake, intake_key, intake_node;
};

// One refused frame: counted by peer and reason in moeline_wire_rejected_frames_total and logged,
// at most once per interval of `limit` (with how many were suppressed).
void report_rejected_frame(Registry& metrics, const Logger& log, RateLimited& limit,
                           const char* peer, const wire::WireError& error);

class HubLink {
 public:
  HubLink(zmq::context_t& context, LinkSettings settings, Logger& log, Registry& metrics);
  ~HubLink();
  HubLink(const HubLink&) = delete;
  HubLink& operator=(const HubLink&) = delete;

  // Says hello with `credits` jobs of capacity free now.
  void hello(uint32_t credits);
  // Sends a message to the hub; credit granted and not yet sent rides in its envelope when the hub
  // takes it there (1.14), or follows it as a Credit message (an older hub).
  bool send(std::vector<zmq::message_t>&& frames);
  // Grants the hub `credits` more jobs: they go back with the next message sent, or in a Credit
  // message of their own when the stage next waits in receive() with nothing sent. So a stage
  // that grants a job's credit before sending its result sends one message, not two.
  void grant(uint32_t credits);
  // Tells the hub this stage is draining: no more jobs (a hello with no credit and the draining
  // flag, repeated after a reconnect); grant() does nothing from now on.
  void drain();
  bool draining() const { return draining_; }
  // Waits up to timeout_ms for a message for the stage; link messages (hello replies, heartbeats)
  // are handled here, refused frames counted and logged. Returns early (nullopt) when `also`
  // has a message waiting (the stage's intake).
  std::optional<wire::Message> receive(int timeout_ms, zmq::socket_t* also = nullptr);
  // The key the hub gave this process at its last accepted hello: tickets of transfers to its
  // intake are signed with it. Absent before the first accepted hello.
  const std::optional<std::array<uint8_t, 32>>& handover_key() const { return handover_key_; }
  void set_intake(std::string endpoint, std::string public_key, std::string node) {
    settings_.intake = std::move(endpoint);
    settings_.intake_key = std::move(public_key);
    settings_.intake_node = std::move(node);
  }
  bool needs_hello() const { return needs_hello_; }
  bool accepted() const { return accepted_; }
  bool rejected() const { return !reject_reason_.empty(); }
  const std::string& reject_reason() const { return reject_reason_; }
  const std::string& identity() const { return identity_; }
  void set_load(uint32_t queue_depth, uint32_t active, uint32_t kv_used = 0, uint32_t kv_free = 0) {
    queue_depth_.store(queue_depth);
    active_.store(active);
    kv_used_.store(kv_used);
    kv_free_.store(kv_free);
  }

 private:
  void heartbeat_loop();
  // Sends the credit granted and not yet sent in a Credit message.
  void flush_credits();

  zmq::context_t& context_;
  LinkSettings settings_;
  Logger& log_;
  std::string identity_;
  zmq::socket_t socket_;
  bool needs_hello_ = true;
  bool draining_ = false;
  bool awaiting_reply_ = false;  // a hello is out and its HelloReply has not come
  bool accepted_ = false;
  uint32_t pending_credits_ = 0;
  bool hub_takes_envelope_credits_ = false;  // its HelloReply was 1.14 or later
  std::string reject_reason_;
  std::optional<std::array<uint8_t, 32>> handover_key_;
  std::chrono::steady_clock::time_point last_hub_message_;
  Registry& metrics_;
  Counter& reconnects_;
  RateLimited log_limit_;
  std::atomic<uint32_t> queue_depth_{0}, active_{0}, kv_used_{0}, kv_free_{0};
  std::atomic<bool> stopping_{false};
  std::thread heartbeat_thread_;
};

}  // namespace moeline::runtime
