#include "stages/runtime/intake.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sodium.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "stages/runtime/config.h"
#include "stages/runtime/link.h"
#include "stages/runtime/trace.h"

namespace moeline::runtime {
namespace {

std::string safe_name(const std::string& text) {
  std::string out;
  for (char c : text)
    out += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') ? c : '_';
  return out.substr(0, 40);
}

// The address this host uses to reach `host` (a UDP "connection" sends nothing): the address a
// peer that reaches the hub can most likely reach us on.
std::optional<std::string> local_address_towards(const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr)
    return std::nullopt;
  std::optional<std::string> address;
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0) {
    sockaddr_in local{};
    socklen_t length = sizeof local;
    if (::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET_ADDRSTRLEN] = {};
      if (::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text) != nullptr) address = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return address;
}

}  // namespace

HandoverKey new_handover_key() {
  HandoverKey key;
  randombytes_buf(key.data(), key.size());
  return key;
}

Ticket handover_ticket(const HandoverKey& key, uint64_t request_id, uint32_t attempt) {
  static_assert(crypto_auth_BYTES == kTicketBytes && crypto_auth_KEYBYTES == kHandoverKeyBytes);
  uint8_t job[12];
  std::memcpy(job, &request_id, 8);
  std::memcpy(job + 8, &attempt, 4);
  Ticket ticket;
  crypto_auth(ticket.data(), job, sizeof job, key.data());
  return ticket;
}

bool valid_ticket(const HandoverKey& key, uint64_t request_id, uint32_t attempt,
                  std::span<const uint8_t> ticket) {
  if (ticket.size() != kTicketBytes) return false;
  uint8_t job[12];
  std::memcpy(job, &request_id, 8);
  std::memcpy(job + 8, &attempt, 4);
  return crypto_auth_verify(ticket.data(), job, sizeof job, key.data()) == 0;
}

namespace {
// The MAC's message: a tag, so that no reporter's identity can pass for a request's ticket (whose
// message is 12 bytes), then the identity.
std::string reporter_message(std::string_view reporter) {
  return "moeline-reporter:" + std::string(reporter);
}
}  // namespace

Ticket reporter_ticket(const HandoverKey& key, std::string_view reporter) {
  const std::string message = reporter_message(reporter);
  Ticket ticket;
  crypto_auth(ticket.data(), reinterpret_cast<const uint8_t*>(message.data()), message.size(),
              key.data());
  return ticket;
}

bool valid_reporter_ticket(const HandoverKey& key, std::string_view reporter,
                           std::span<const uint8_t> ticket) {
  if (ticket.size() != kTicketBytes) return false;
  const std::string message = reporter_message(reporter);
  return crypto_auth_verify(ticket.data(), reinterpret_cast<const uint8_t*>(message.data()),
                            message.size(), key.data()) == 0;
}

std::string intake_bind_endpoint(const std::string& setting, const std::string& hub,
                                 const std::string& stage, const std::string& replica) {
  if (!setting.empty() && setting != "auto") return setting;
  const std::string file = safe_name(stage + "-" + replica) + "-" +
                           std::to_string(static_cast<long>(::getpid())) + ".intake";
  if (hub.rfind("ipc://", 0) == 0) {
    const std::filesystem::path folder = std::filesystem::path(hub.substr(6)).parent_path();
    return "ipc://" + (folder / file).string();
  }
  if (is_tcp(hub)) {
    const std::string rest = hub.substr(6);
    const size_t colon = rest.rfind(':');
    const std::string host = colon == std::string::npos ? rest : rest.substr(0, colon);
    const std::string port = colon == std::string::npos ? "1" : rest.substr(colon + 1);
    if (auto address = local_address_towards(host, port)) return "tcp://" + *address + ":*";
    return "tcp://127.0.0.1:*";
  }
  return "ipc://" + (std::filesystem::temp_directory_path() / ("moeline-" + file)).string();
}

PeerAddress PeerAddress::of(const wire::PeerRoute* route) {
  if (route == nullptr) return {};
  auto text = [](const flatbuffers::String* s) { return s != nullptr ? s->str() : std::string(); };
  return {text(route->endpoint()), text(route->server_key()), text(route->node())};
}

namespace {
std::unique_ptr<SharedBulk> open_shared_bulk(const SharedBulkSettings& settings, Registry& metrics,
                                             Logger& log) {
  if (!settings.enabled) return nullptr;
  auto opened = SharedBulk::open(settings, metrics);
  if (!opened) {
    log.warn("shm_handover_unavailable",
             {{"detail", opened.error().message}, {"effect", "bulk data crosses the socket"}});
    return nullptr;
  }
  return std::move(*opened);
}
}  // namespace

Intake::Intake(zmq::context_t& context, IntakeSettings settings, Logger& log, Registry& metrics,
               ZapHandler* zap)
    : socket_(context, zmq::socket_type::router),
      max_bulk_bytes_(settings.max_message_bytes > 0 ? settings.max_message_bytes
                                                     : wire::Limits{}.max_bulk_bytes),
      log_(log),
      metrics_(metrics) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.set(zmq::sockopt::rcvhwm, 0);
  if (settings.max_message_bytes > 0)
    socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(settings.max_message_bytes));
  if (settings.curve_keys) {
    if (zap == nullptr) throw ConfigError("an intake with Curve needs the process's ZAP handler");
    zap->allow_any(kIntakeDomain);
    make_curve_server(socket_, *settings.curve_keys, kIntakeDomain);
    public_key_ = settings.curve_keys->public_key;
  }
  const std::string bind =
      intake_bind_endpoint(settings.bind, settings.hub, settings.stage, settings.replica);
  try {
    socket_.bind(bind);
  } catch (const zmq::error_t& e) {
    throw ConfigError("--intake-bind " + bind + ": " + e.what());
  }
  bound_ = socket_.get(zmq::sockopt::last_endpoint);
  restrict_ipc_endpoint(bound_);
  advertised_ = settings.advertise.empty() ? bound_ : settings.advertise;
  if (advertised_.rfind("tcp://0.0.0.0:", 0) == 0) {
    // A wildcard address is no address to connect to: name this host as the hub sees it.
    const std::string port = advertised_.substr(std::strlen("tcp://0.0.0.0:"));
    const std::string towards = intake_bind_endpoint("auto", settings.hub, "", "");
    const std::string host = towards.substr(6, towards.rfind(':') - 6);
    advertised_ = "tcp://" + host + ":" + port;
  }
  if (is_tcp(advertised_) && !settings.curve_keys)
    log_.warn("open_endpoint",
              {{"endpoint", advertised_},
               {"detail", "intake on tcp:// without --curve-dir: bulk data travels unencrypted"}});
  shared_bulk_ = open_shared_bulk(settings.shared_bulk, metrics, log);
  log_.info("intake_bound", {{"bind", bound_},
                             {"advertised", advertised_},
                             {"shm_folder", shared_bulk_ ? shared_bulk_->folder() : "off"}});
}

Intake::~Intake() = default;

const std::string& Intake::node() const {
  static const std::string none;
  return shared_bulk_ ? shared_bulk_->node() : none;
}

std::optional<wire::Message> Intake::receive() {
  while (true) {
    auto frames = wire::receive(socket_, true);
    if (!frames) return std::nullopt;
    if (frames->size() < 2) continue;
    frames->erase(frames->begin());  // the sender's routing identity: the ticket says who
    if (has_shared_bulk_flag(*frames)) {
      const Status restored =
          shared_bulk_ ? shared_bulk_->import_frames(*frames, max_bulk_bytes_)
                       : Status(Error{"shared-memory hand-over to an intake that offers none"});
      if (!restored.ok()) {
        report_rejected_frame(metrics_, log_, log_limit_, "intake",
                              wire::WireError{"shared_bulk", restored.error().message});
        continue;
      }
    }
    if (shared_bulk_) shared_bulk_->sweep();
    wire::Decoded decoded = wire::decode(std::move(*frames));
    if (decoded.error) {
      report_rejected_frame(metrics_, log_, log_limit_, "intake", *decoded.error);
      continue;
    }
    trace_received(log_, *decoded.message, "intake");
    return std::move(*decoded.message);
  }
}

void Intake::refuse(wire::MessageType type, const char* reason) {
  metrics_
      .counter("moeline_intake_refused_total",
               "Messages refused at this stage's intake (no valid ticket, or not taken here)",
               {{"reason", reason}, {"type", wire::message_type_name(type)}})
      .inc();
  if (uint64_t suppressed = 0; log_limit_.allow(suppressed))
    log_.warn(
        "intake_refused",
        {{"type", wire::message_type_name(type)}, {"reason", reason}, {"suppressed", suppressed}});
}

PeerSender::PeerSender(zmq::context_t& context, std::optional<CurveKeyPair> curve_keys,
                       const SharedBulkSettings& shared_bulk, Registry& metrics, Logger& log,
                       size_t max_connections)
    : context_(context),
      curve_keys_(std::move(curve_keys)),
      max_connections_(std::max<size_t>(1, max_connections)),
      shared_bulk_(open_shared_bulk(shared_bulk, metrics, log)) {}

PeerSender::~PeerSender() = default;

zmq::socket_t& PeerSender::connection(const std::string& endpoint, const std::string& server_key) {
  auto it = std::find_if(connections_.begin(), connections_.end(),
                         [&](const Connection& c) { return c.endpoint == endpoint; });
  if (it != connections_.end()) {
    connections_.splice(connections_.begin(), connections_, it);
    return connections_.front().socket;
  }
  if (connections_.size() >= max_connections_) connections_.pop_back();
  zmq::socket_t socket(context_, zmq::socket_type::dealer);
  socket.set(zmq::sockopt::linger, 0);
  // A few transfers may wait for a peer that is still connecting; past that, a send fails rather
  // than pile KV up for a replica that may be dead.
  socket.set(zmq::sockopt::sndhwm, 64);
  if (curve_keys_) {
    if (server_key.empty())
      throw std::runtime_error("the route to " + endpoint + " names no Curve key");
    make_curve_client(socket, *curve_keys_, server_key);
  }
  socket.connect(endpoint);
  connections_.push_front(Connection{endpoint, std::move(socket)});
  return connections_.front().socket;
}

void PeerSender::prepare(const PeerAddress& to) {
  if (to.endpoint.empty()) return;
  try {
    connection(to.endpoint, to.server_key);
  } catch (const std::exception&) {
    // A malformed route: its send fails and is reported there.
  }
}

bool PeerSender::send(const PeerAddress& to, std::vector<zmq::message_t>&& frames) {
  if (to.endpoint.empty()) return false;
  const std::optional<uint32_t> shared =
      shared_bulk_ ? shared_bulk_->export_frames(to.node, frames) : std::nullopt;
  bool sent = false;
  try {
    sent = wire::send(connection(to.endpoint, to.server_key), std::move(frames), nullptr, true);
  } catch (const std::exception&) {
    // A malformed endpoint or key in the route: the transfer fails, nothing else.
  }
  // A message ZeroMQ did not take is still ours (frames are moved only when sent): its file goes.
  if (shared && !sent) shared_bulk_->discard(*shared);
  return sent;
}

}  // namespace moeline::runtime
