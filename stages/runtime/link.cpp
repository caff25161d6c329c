#include "stages/runtime/link.h"

#include "stages/runtime/trace.h"

#include <unistd.h>

#include <algorithm>
#include <random>

namespace moeline::runtime {
namespace {

std::string random_suffix() {
  std::random_device device;
  char text[9];
  std::snprintf(text, sizeof text, "%08x", device());
  return text;
}

uint64_t unix_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

void configure_socket(zmq::socket_t& socket, const LinkSettings& settings) {
  if (settings.max_message_bytes > 0)
    socket.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(settings.max_message_bytes));
  if (settings.curve_keys)
    make_curve_client(socket, *settings.curve_keys, settings.curve_server_key);
}

}  // namespace

void report_rejected_frame(Registry& metrics, const Logger& log, RateLimited& limit,
                           const char* peer, const wire::WireError& error) {
  metrics.counter(kWireRejectedFrames, {{"peer", peer}, {"reason", error.reason}}).inc();
  if (uint64_t suppressed = 0; limit.allow(suppressed))
    log.warn("frame_rejected",
             {{"reason", error.reason}, {"detail", error.detail}, {"suppressed", suppressed}});
}

HubLink::HubLink(zmq::context_t& context, LinkSettings settings, Logger& log, Registry& metrics)
    : context_(context),
      settings_(std::move(settings)),
      log_(log),
      // A new identity per process: a restarted replica is a new peer, never mistaken for the
      // one that died with jobs in flight.
      identity_(settings_.replica + "#" + random_suffix()),
      socket_(context_, zmq::socket_type::dealer),
      last_hub_message_(std::chrono::steady_clock::now()),
      metrics_(metrics),
      reconnects_(metrics.counter("moeline_link_hellos_total",
                                  "Hellos sent to the hub (the first and every reconnect)")) {
  socket_.set(zmq::sockopt::routing_id, identity_);
  socket_.set(zmq::sockopt::linger, 0);
  socket_.set(zmq::sockopt::sndhwm, 0);
  socket_.set(zmq::sockopt::rcvhwm, 0);
  configure_socket(socket_, settings_);
  socket_.connect(settings_.hub);
  if (is_tcp(settings_.hub) && !settings_.curve_keys)
    log_.warn("open_endpoint", {{"endpoint", settings_.hub},
                                {"detail", "tcp:// without --curve-dir: not authenticated"}});
  heartbeat_thread_ = std::thread([this] { heartbeat_loop(); });
}

HubLink::~HubLink() {
  stopping_.store(true);
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

void HubLink::heartbeat_loop() {
  zmq::socket_t side(context_, zmq::socket_type::dealer);
  side.set(zmq::sockopt::routing_id, identity_ + "/hb");
  side.set(zmq::sockopt::linger, 0);
  side.set(zmq::sockopt::sndhwm, 4);
  configure_socket(side, settings_);
  side.connect(settings_.hub);
  while (!stopping_.load()) {
    flatbuffers::FlatBufferBuilder builder(128);
    builder.Finish(
        wire::CreateHeartbeat(builder, unix_ns(), queue_depth_.load(), active_.load(),
                              builder.CreateString(identity_), kv_used_.load(), kv_free_.load()),
        wire::HelloIdentifier());
    wire::send(side, wire::encode(wire::MessageType::Heartbeat, builder), nullptr, true);
    // Drain anything the hub says on this side connection (nothing is expected).
    while (wire::receive(side, true)) {
    }
    for (int slept = 0; slept < settings_.heartbeat_ms && !stopping_.load(); slept += 20)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void HubLink::hello(uint32_t credits) {
  if (draining_) credits = 0;
  flatbuffers::FlatBufferBuilder builder(256);
  builder.Finish(
      wire::CreateHello(
          builder, settings_.stage, builder.CreateString(settings_.replica), wire::kSchemaMajor,
          wire::kSchemaMinor, builder.CreateString("moeline 0.1.0"), settings_.settings_hash,
          credits, static_cast<uint32_t>(::getpid()), settings_.http_port, draining_,
          builder.CreateString(settings_.intake), builder.CreateString(settings_.intake_key),
          builder.CreateString(settings_.intake_node)),
      wire::HelloIdentifier());
  wire::send(socket_, wire::encode(wire::MessageType::Hello, builder));
  reconnects_.inc();
  needs_hello_ = false;
  awaiting_reply_ = true;
  accepted_ = false;
  // The hello states all the capacity free now: credit granted before it is in it.
  pending_credits_ = 0;
  hub_takes_envelope_credits_ = false;
  last_hub_message_ = std::chrono::steady_clock::now();
  log_.info("hello_sent", {{"hub", settings_.hub}, {"credits", credits}});
}

bool HubLink::send(std::vector<zmq::message_t>&& frames) {
  const uint32_t riding =
      hub_takes_envelope_credits_ ? std::min(pending_credits_, wire::kMaxEnvelopeCredits) : 0;
  if (riding > 0) wire::set_envelope_credits(frames, riding);
  const bool sent = wire::send(socket_, std::move(frames));
  if (sent) pending_credits_ -= riding;
  if (!hub_takes_envelope_credits_) flush_credits();
  return sent;
}

void HubLink::flush_credits() {
  if (pending_credits_ == 0) return;
  flatbuffers::FlatBufferBuilder builder(64);
  builder.Finish(wire::CreateCredit(builder, pending_credits_), wire::HelloIdentifier());
  if (wire::send(socket_, wire::encode(wire::MessageType::Credit, builder))) pending_credits_ = 0;
}

void HubLink::drain() {
  if (draining_) return;
  draining_ = true;
  hello(0);  // drops any credit not yet sent
  log_.info("draining", {{"hub", settings_.hub}});
}

void HubLink::grant(uint32_t credits) {
  if (credits == 0 || draining_) return;
  // The hub caps a peer's credit far below this; the sum only must not wrap.
  pending_credits_ = static_cast<uint32_t>(
      std::min<uint64_t>(uint64_t{pending_credits_} + credits, uint64_t{1} << 31));
}

std::optional<wire::Message> HubLink::receive(int timeout_ms, zmq::socket_t* also) {
  // Before waiting: credit granted since the last message must not wait with the stage.
  flush_credits();
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
    zmq::pollitem_t items[2] = {{socket_.handle(), 0, ZMQ_POLLIN, 0},
                                {also != nullptr ? also->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, also != nullptr ? 2 : 1,
                std::chrono::milliseconds(std::max<int64_t>(0, left)));
    } catch (const zmq::error_t&) {
      return std::nullopt;  // interrupted by a signal: the loop checks its stop flag
    }
    if (!(items[0].revents & ZMQ_POLLIN)) {
      // Silent only when nothing from the hub is waiting either: after a forward pass longer than
      // the timeout, its heartbeats are queued here, not missing.
      if (!needs_hello_ && std::chrono::steady_clock::now() - last_hub_message_ >
                               std::chrono::milliseconds(settings_.peer_timeout_ms)) {
        log_.warn("hub_silent",
                  {{"hub", settings_.hub}, {"timeout_ms", settings_.peer_timeout_ms}});
        needs_hello_ = true;
      }
      return std::nullopt;
    }
    auto frames = wire::receive(socket_, true);
    if (!frames) continue;
    last_hub_message_ = std::chrono::steady_clock::now();
    wire::Decoded decoded = wire::decode(std::move(*frames));
    if (decoded.error) {
      report_rejected_frame(metrics_, log_, log_limit_, "hub", *decoded.error);
      continue;
    }
    wire::Message& message = *decoded.message;
    // Link-level messages stop here; the stage's own dispatch (an exhaustive switch) sees the rest.
    if (message.type == wire::MessageType::HelloReply) {
      const auto* reply = message.as<wire::HelloReply>();
      // Only the answer to a hello of ours counts: a stray reply must not end the stage.
      if (!awaiting_reply_) continue;
      awaiting_reply_ = false;
      if (!reply->accepted()) {
        reject_reason_ = reply->reason() ? reply->reason()->str() : "refused";
        log_.error("hello_refused", {{"hub", settings_.hub}, {"reason", reject_reason_}});
        return std::nullopt;
      }
      accepted_ = true;
      hub_takes_envelope_credits_ = message.minor >= wire::kEnvelopeCreditsMinor;
      if (reply->handover_key() != nullptr && reply->handover_key()->size() == 32) {
        handover_key_.emplace();
        std::copy(reply->handover_key()->begin(), reply->handover_key()->end(),
                  handover_key_->begin());
      }
      log_.info("hello_accepted", {{"hub", settings_.hub}});
      continue;
    }
    if (message.type == wire::MessageType::Heartbeat) continue;
    if (message.type == wire::MessageType::ErrorReply &&
        message.as<wire::ErrorReply>()->code() == wire::ErrorCode::HelloRequired) {
      log_.warn("hub_restarted", {{"hub", settings_.hub}});
      needs_hello_ = true;
      return std::nullopt;
    }
    trace_received(log_, message, "link");
    return std::move(message);
  }
}

}  // namespace moeline::runtime
