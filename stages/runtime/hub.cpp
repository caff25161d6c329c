#include "stages/runtime/hub.h"

#include "stages/runtime/trace.h"

#include <algorithm>
#include <cstring>

namespace moeline::runtime {
namespace {
constexpr const char* kCreditsHelp =
    "Credit stages granted back, by what carried it (a Credit message, or the envelope of another "
    "message)";
}  // namespace

Hub::Hub(zmq::context_t& context, const std::string& bind, uint64_t settings_hash, int heartbeat_ms,
         int peer_timeout_ms, Logger& log, Registry& metrics, HubSecurity security)
    : socket_(context, zmq::socket_type::router),
      settings_hash_(settings_hash),
      heartbeat_(heartbeat_ms),
      timeout_(peer_timeout_ms),
      log_(log),
      metrics_(metrics),
      credits_in_envelopes_(
          metrics.counter("moeline_hub_credits_total", kCreditsHelp, {{"carried_by", "envelope"}})),
      credits_in_messages_(
          metrics.counter("moeline_hub_credits_total", kCreditsHelp, {{"carried_by", "message"}})) {
  socket_.set(zmq::sockopt::router_mandatory, true);
  socket_.set(zmq::sockopt::linger, 0);
  socket_.set(zmq::sockopt::sndhwm, 0);
  socket_.set(zmq::sockopt::rcvhwm, 0);
  if (security.max_message_bytes > 0)
    socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(security.max_message_bytes));
  if (security.curve != nullptr && security.curve->enabled()) {
    if (security.zap == nullptr) throw std::logic_error("a Curve hub needs a ZAP handler");
    security.zap->allow_keys(kHubDomain, security.curve->allowed);
    make_curve_server(socket_, security.curve->own.keys, kHubDomain);
    authenticated_ = true;
  }
  socket_.bind(bind);
  restrict_ipc_endpoint(bind);
  update_gauges();
}

void Hub::update_gauges() {
  for (auto stage : {wire::StageKind::Probe, wire::StageKind::Prefill, wire::StageKind::Decode,
                     wire::StageKind::OffloadManager}) {
    metrics_
        .gauge("moeline_hub_peers", "Connected stage processes by kind",
               {{"stage", wire::stage_name(stage)}})
        .set(static_cast<double>(count(stage)));
  }
}

void Hub::reply_error(const std::string& identity, wire::ErrorCode code, const std::string& text) {
  flatbuffers::FlatBufferBuilder builder(256);
  builder.Finish(wire::CreateErrorReply(builder, code, builder.CreateString(text)),
                 wire::HelloIdentifier());
  wire::send(socket_, wire::encode(wire::MessageType::ErrorReply, builder), &identity, true);
}

void Hub::on_hello(const std::string& identity, const std::string& key,
                   const wire::Message& message) {
  const auto* hello = message.as<wire::Hello>();
  const std::string replica = hello->replica() ? hello->replica()->str() : "";
  // The refusal says what the peer itself sent wrong, never a value of the hub's (its settings
  // hash would let an unknown peer pass the next hello).
  std::string refusal, reason;
  if (authenticated_ && key.rfind(std::string(wire::stage_name(hello->stage())) + ":", 0) != 0) {
    refusal = "refused";
    reason = "key " + key + " was not issued for a " + wire::stage_name(hello->stage()) + " stage";
  } else if (hello->schema_major() != wire::kSchemaMajor) {
    refusal = "schema major " + std::to_string(hello->schema_major()) + ", the hub speaks " +
              std::to_string(wire::kSchemaMajor);
  } else if (hello->settings_hash() != settings_hash_) {
    refusal = "settings hash " + std::to_string(hello->settings_hash()) +
              " differs from the hub's (another model, KV layout, --quant-math / --bf16-math or "
              "kernel arithmetic revision)";
  }
  // A new hand-over key for every new peer (a restarted process is a new identity); a peer that
  // says hello again keeps its key, or the tickets of the transfers already on their way to it
  // would no longer check.
  const auto existing = peers_.find(identity);
  const HandoverKey handover_key =
      existing != peers_.end() ? existing->second.handover_key : new_handover_key();
  flatbuffers::FlatBufferBuilder builder(256);
  auto key_vector =
      refusal.empty() ? builder.CreateVector(handover_key.data(), handover_key.size()) : 0;
  builder.Finish(wire::CreateHelloReply(builder, refusal.empty(), builder.CreateString(refusal),
                                        refusal.empty() ? settings_hash_ : 0, key_vector),
                 wire::HelloIdentifier());
  wire::send(socket_, wire::encode(wire::MessageType::HelloReply, builder), &identity, true);
  if (!refusal.empty()) {
    metrics_.counter("moeline_hub_hellos_refused_total", "Peers refused at hello").inc();
    log_.error("peer_refused", {{"peer", replica},
                                {"key", key},
                                {"reason", reason.empty() ? refusal : reason},
                                {"hub_settings_hash", settings_hash_}});
    return;
  }
  Peer& peer = peers_[identity];
  const bool known = !peer.identity.empty();
  peer.identity = identity;
  peer.stage = hello->stage();
  peer.replica = replica;
  // A hello resets the peer's credit to what it says is free now (after a hub restart, jobs of
  // the old hub may still be running there).
  peer.credits = hello->draining() ? 0 : std::min(hello->credits(), kMaxCredits);
  peer.draining = hello->draining();
  peer.pid = hello->pid();
  peer.http_port = hello->http_port();
  peer.key = key;
  peer.intake = hello->intake() ? hello->intake()->str() : "";
  peer.intake_key = hello->intake_key() ? hello->intake_key()->str() : "";
  peer.intake_node = hello->intake_node() ? hello->intake_node()->str() : "";
  peer.handover_key = handover_key;
  peer.last_seen = std::chrono::steady_clock::now();
  log_.info(peer.draining ? "peer_draining" : (known ? "peer_rehello" : "peer_joined"),
            {{"peer", replica},
             {"stage", wire::stage_name(peer.stage)},
             {"credits", peer.credits},
             {"pid", peer.pid},
             {"schema_minor", hello->schema_minor()}});
  update_gauges();
}

std::optional<Hub::Incoming> Hub::receive() {
  while (true) {
    auto frames = wire::receive(socket_, true);
    if (!frames) return std::nullopt;
    if (frames->empty()) continue;
    std::string identity = frames->front().to_string();
    // The connection's key, as the ZAP handler named it (the body frame carries the metadata).
    const std::string key = frames->size() > 1 ? peer_user_id((*frames)[1]) : std::string();
    frames->erase(frames->begin());
    {
      const auto [type, bytes] = type_and_size(*frames);
      count_traffic(true, type, bytes);
    }
    static constexpr wire::Limits kFromStages{.accepts_credits = true};
    wire::Decoded decoded = wire::decode(std::move(*frames), kFromStages);
    if (decoded.error) {
      report_rejected_frame(metrics_, log_, log_limit_, "stage", *decoded.error);
      reply_error(identity, wire::ErrorCode::MalformedMessage, decoded.error->detail);
      continue;
    }
    wire::Message& message = *decoded.message;
    if (message.type == wire::MessageType::Hello) {
      on_hello(identity, key, message);
      continue;
    }
    if (message.type == wire::MessageType::Heartbeat) {
      const auto* heartbeat = message.as<wire::Heartbeat>();
      const std::string main = heartbeat->peer() ? heartbeat->peer()->str() : identity;
      // A heartbeat keeps alive only the peer whose key sent it.
      if (auto it = peers_.find(main); it != peers_.end() && it->second.key == key) {
        it->second.last_seen = std::chrono::steady_clock::now();
        it->second.queue_depth = heartbeat->queue_depth();
        it->second.active = heartbeat->active();
        it->second.kv_used = heartbeat->kv_blocks_used();
        it->second.kv_free = heartbeat->kv_blocks_free();
      }
      continue;
    }
    auto it = peers_.find(identity);
    if (it == peers_.end()) {
      // A worker that was connected to a previous hub process: it must say hello again.
      reply_error(identity, wire::ErrorCode::HelloRequired, "unknown peer: say hello first");
      continue;
    }
    if (it->second.key != key) {
      refuse_peer(identity, "message over a connection with another key");
      continue;
    }
    it->second.last_seen = std::chrono::steady_clock::now();
    // A job's credit riding on its result (1.14), then the message itself.
    if (message.credits > 0) add_credits(it->second, message.credits, /*in_envelope=*/true);
    if (message.type == wire::MessageType::Credit) {
      add_credits(it->second, message.as<wire::Credit>()->credits(), /*in_envelope=*/false);
      continue;
    }
    trace_received(log_, message, "hub");
    return Incoming{std::move(identity), std::move(message)};
  }
}

void Hub::add_credits(Peer& peer, uint32_t credits, bool in_envelope) {
  (in_envelope ? credits_in_envelopes_ : credits_in_messages_).inc(credits);
  if (peer.draining) return;
  peer.credits =
      static_cast<uint32_t>(std::min<uint64_t>(uint64_t{peer.credits} + credits, kMaxCredits));
}

void Hub::refuse_peer(const std::string& identity, const std::string& reason) {
  metrics_.counter("moeline_hub_messages_refused_total", "Messages from peers refused by the hub")
      .inc();
  if (uint64_t suppressed = 0; log_limit_.allow(suppressed))
    log_.warn("peer_message_refused",
              {{"peer", identity}, {"reason", reason}, {"suppressed", suppressed}});
}

bool Hub::drain(const std::string& replica) {
  bool found = false;
  for (auto& [identity, peer] : peers_) {
    if (peer.replica != replica) continue;
    peer.draining = true;
    peer.credits = 0;
    found = true;
    log_.info("peer_draining", {{"peer", replica}, {"by", "operator"}});
  }
  return found;
}

Peer* Hub::peer(const std::string& identity) {
  auto it = peers_.find(identity);
  return it == peers_.end() ? nullptr : &it->second;
}

Peer* Hub::pick(wire::StageKind stage) {
  Peer* best = nullptr;
  for (auto& [identity, peer] : peers_) {
    if (peer.stage != stage || peer.credits == 0 || peer.draining) continue;
    if (best == nullptr || peer.credits > best->credits ||
        (peer.credits == best->credits && peer.last_picked < best->last_picked))
      best = &peer;
  }
  if (best != nullptr) best->last_picked = ++picks_;
  return best;
}

void Hub::restore_credit(const std::string& identity) {
  auto it = peers_.find(identity);
  if (it == peers_.end() || it->second.draining) return;
  it->second.credits = std::min(it->second.credits + 1, kMaxCredits);
}

void Hub::spend_credit(const std::string& identity) {
  auto it = peers_.find(identity);
  if (it != peers_.end() && it->second.credits > 0) --it->second.credits;
}

bool Hub::any(wire::StageKind stage) const {
  return count(stage) > 0;
}

size_t Hub::count(wire::StageKind stage) const {
  size_t n = 0;
  for (const auto& [identity, peer] : peers_) n += peer.stage == stage;
  return n;
}

bool Hub::send(const std::string& identity, std::vector<zmq::message_t>& frames, bool job) {
  auto it = peers_.find(identity);
  if (it == peers_.end()) return false;
  const auto [type, bytes] = type_and_size(frames);  // before the frames move
  if (!wire::send(socket_, std::move(frames), &identity, true)) {
    // ROUTER_MANDATORY: the peer's connection is gone (a killed process) — no need to wait for
    // its heartbeats to stop.
    unreachable_.push_back(identity);
    it->second.credits = 0;
    return false;
  }
  if (job && it->second.credits > 0) --it->second.credits;
  count_traffic(false, type, bytes);
  return true;
}

std::pair<uint16_t, size_t> Hub::type_and_size(const std::vector<zmq::message_t>& frames) {
  size_t bytes = 0;
  for (const zmq::message_t& frame : frames) bytes += frame.size();
  uint16_t type = 0;
  if (!frames.empty() && frames.front().size() >= wire::kHeaderBytes)
    std::memcpy(&type, static_cast<const uint8_t*>(frames.front().data()) + 8, 2);
  return {type, bytes};
}

void Hub::count_traffic(bool in, uint16_t type, size_t bytes) {
  TypeCounters& counters = traffic_[{in, type}];
  if (counters.bytes == nullptr) {
    const char* name = wire::message_type_name(static_cast<wire::MessageType>(type));
    const Labels labels = {{"direction", in ? "in" : "out"}, {"type", name}};
    counters.bytes =
        &metrics_.counter("moeline_hub_bytes_total",
                          "Bytes of messages through the hub, by direction and type", labels);
    // What a request costs in messages, each one a Curve encryption or decryption on tcp://.
    counters.messages = &metrics_.counter(
        "moeline_hub_messages_total", "Messages through the hub, by direction and type", labels);
  }
  counters.bytes->inc(static_cast<double>(bytes));
  counters.messages->inc();
}

std::vector<Peer> Hub::tick() {
  const auto now = std::chrono::steady_clock::now();
  std::vector<Peer> dead;
  for (auto it = peers_.begin(); it != peers_.end();) {
    const bool unreachable =
        std::find(unreachable_.begin(), unreachable_.end(), it->first) != unreachable_.end();
    if (unreachable || now - it->second.last_seen > timeout_) {
      log_.error("peer_lost", {{"peer", it->second.replica},
                               {"reason", unreachable ? "unreachable" : "heartbeat_timeout"},
                               {"stage", wire::stage_name(it->second.stage)},
                               {"silent_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 now - it->second.last_seen)
                                                 .count()}});
      metrics_
          .counter("moeline_hub_peers_lost_total", "Peers dropped after missing heartbeats",
                   {{"stage", wire::stage_name(it->second.stage)}})
          .inc();
      dead.push_back(std::move(it->second));
      it = peers_.erase(it);
    } else {
      ++it;
    }
  }
  unreachable_.clear();
  if (!dead.empty()) update_gauges();
  if (now - last_heartbeat_ >= heartbeat_) {
    last_heartbeat_ = now;
    for (auto& [identity, peer] : peers_) {
      flatbuffers::FlatBufferBuilder builder(64);
      builder.Finish(wire::CreateHeartbeat(builder, 0, 0, 0), wire::HelloIdentifier());
      wire::send(socket_, wire::encode(wire::MessageType::Heartbeat, builder), &identity, true);
    }
  }
  return dead;
}

}  // namespace moeline::runtime
