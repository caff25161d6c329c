#include "sdk/client.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "schemas/vocabulary.h"
#include "schemas/wire.h"

namespace moeline::sdk {
namespace {

using Clock = std::chrono::steady_clock;

Event to_event(const wire::StreamEvent& e) {
  Event event;
  event.client_request_id = e.client_request_id();
  event.request_id = e.request_id();
  switch (e.kind()) {
    case wire::EventKind::Accepted:
      event.kind = EventKind::kAccepted;
      break;
    case wire::EventKind::Delta:
      event.kind = EventKind::kDelta;
      break;
    case wire::EventKind::Finished:
      event.kind = EventKind::kFinished;
      break;
    case wire::EventKind::Error:
      event.kind = EventKind::kError;
      break;
  }
  if (e.text()) event.text = e.text()->str();
  if (e.token_ids()) event.token_ids.assign(e.token_ids()->begin(), e.token_ids()->end());
  auto read_logprobs = [](const flatbuffers::Vector<flatbuffers::Offset<wire::TokenLogprobs>>* from,
                          std::vector<TokenLogprob>& to) {
    if (from == nullptr) return;
    for (const wire::TokenLogprobs* lp : *from) {
      TokenLogprob& token = to.emplace_back();
      token.logprob = lp->logprob();
      if (lp->top_ids() && lp->top_logprobs())
        for (flatbuffers::uoffset_t k = 0;
             k < std::min(lp->top_ids()->size(), lp->top_logprobs()->size()); ++k)
          token.top.emplace_back(lp->top_ids()->Get(k), lp->top_logprobs()->Get(k));
    }
  };
  read_logprobs(e.logprobs(), event.logprobs);
  read_logprobs(e.prompt_logprobs(), event.prompt_logprobs);
  if (e.prompt_token_ids())
    event.prompt_token_ids.assign(e.prompt_token_ids()->begin(), e.prompt_token_ids()->end());
  event.finish_reason = wire::name(wire::finish_reason_of(e));
  if (const auto* usage = e.usage()) {
    event.usage = {usage->prompt_tokens(),
                   usage->completion_tokens(),
                   usage->reused_tokens(),
                   std::string(wire::name(wire::reuse_level_of(*usage))),
                   std::string(wire::name(wire::approximate_outcome_of(*usage))),
                   usage->similarity()};
  }
  if (const auto* timings = e.timings())
    event.timings = {timings->queue_ms(), timings->prefill_ms(), timings->ttft_ms(),
                     timings->total_ms()};
  event.error_code = static_cast<int>(e.error_code());
  event.error_name = error_name(event.error_code);
  if (e.error_message()) event.error_message = e.error_message()->str();
  return event;
}

}  // namespace

const char* error_name(int code) {
  const char* name = wire::EnumNameErrorCode(static_cast<wire::ErrorCode>(code));
  return name != nullptr && *name != '\0' ? name : "Unknown";
}

Client::Client(std::string endpoint, std::chrono::milliseconds timeout, Credentials credentials)
    : endpoint_(std::move(endpoint)), timeout_(timeout), credentials_(std::move(credentials)) {
  // A path (an existing file: a path can be 40 characters of Z85's alphabet, like a key): the
  // public key is the "public" field of the gateway's key file.
  const std::string& key = credentials_.server_key;
  if (!key.empty() && (std::filesystem::is_regular_file(key) || key.size() != 40)) {
    std::ifstream in(credentials_.server_key);
    if (!in) throw std::runtime_error("cannot read the server key " + credentials_.server_key);
    const nlohmann::json file = nlohmann::json::parse(in, nullptr, false);
    if (!file.is_object() || !file.contains("public") || !file["public"].is_string())
      throw std::runtime_error(credentials_.server_key + " is not a key file (no \"public\")");
    credentials_.server_key = file["public"].get<std::string>();
  }
  uint8_t decoded[32];
  if (!credentials_.server_key.empty() &&
      (credentials_.server_key.size() != 40 ||
       zmq_z85_decode(decoded, credentials_.server_key.c_str()) == nullptr))
    throw std::runtime_error("the server key is neither a key file nor 40 Z85 characters");
  open();
}

Client::~Client() {
  for (auto& [id, _] : in_flight_) {
    try {
      cancel(id);
    } catch (...) {
    }
  }
  close_socket();
}

void Client::close_socket() {
  if (!socket_) return;
  zmq_socket_monitor(socket_->handle(), nullptr, 0);
  monitor_.reset();
  socket_.reset();
}

void Client::open() {
  close_socket();
  socket_ = std::make_unique<zmq::socket_t>(context_, zmq::socket_type::dealer);
  socket_->set(zmq::sockopt::linger, 200);
  socket_->set(zmq::sockopt::sndhwm, 0);
  socket_->set(zmq::sockopt::rcvhwm, 0);
  // What a gateway sends a client is small (events, replies): a larger frame is not one.
  socket_->set(zmq::sockopt::maxmsgsize, int64_t{64} << 20);
  // ZMTP heartbeats: a gateway that stops answering drops the connection within 5 s.
  socket_->set(zmq::sockopt::heartbeat_ivl, 1000);
  socket_->set(zmq::sockopt::heartbeat_timeout, 5000);
  static std::atomic<uint64_t> monitors{0};
  const std::string address = "inproc://moeline-client-monitor-" + std::to_string(++monitors);
  if (zmq_socket_monitor(socket_->handle(), address.c_str(), ZMQ_EVENT_DISCONNECTED) != 0)
    throw std::runtime_error("cannot monitor the client socket");
  monitor_ = std::make_unique<zmq::socket_t>(context_, zmq::socket_type::pair);
  monitor_->set(zmq::sockopt::linger, 0);
  monitor_->connect(address);
  if (!credentials_.server_key.empty()) {
    char public_key[41] = {}, secret_key[41] = {};
    if (zmq_curve_keypair(public_key, secret_key) != 0)
      throw std::runtime_error("this libzmq has no CURVE support");
    socket_->set(zmq::sockopt::curve_serverkey, credentials_.server_key);
    socket_->set(zmq::sockopt::curve_publickey, std::string(public_key));
    socket_->set(zmq::sockopt::curve_secretkey, std::string(secret_key));
  }
  socket_->connect(endpoint_);
}

void Client::reconnect() {
  // The gateway would otherwise keep generating for a connection nobody reads any more.
  for (const auto& [id, _] : in_flight_) cancel(id);
  in_flight_.clear();
  pending_.clear();
  unread_.clear();
  control_replies_.clear();
  open();
}

uint64_t Client::start(const GenerateOptions& options) {
  const uint64_t id = next_id_++;
  flatbuffers::FlatBufferBuilder builder(256 + options.prompt.size() + options.tokens.size() * 4);
  auto stops = builder.CreateVector(options.stop_token_ids);
  flatbuffers::Offset<flatbuffers::Vector<const wire::TokenBias*>> bias = 0;
  if (!options.logit_bias.empty()) {
    std::vector<wire::TokenBias> entries;
    for (const auto& [token, value] : options.logit_bias) entries.emplace_back(token, value);
    bias = builder.CreateVectorOfStructs(entries);
  }
  auto schema = options.json_schema.empty() ? 0 : builder.CreateString(options.json_schema);
  auto sampling = wire::CreateSamplingParams(
      builder, options.temperature, options.top_k, options.top_p, options.seed.value_or(0),
      options.seed.has_value(), options.max_tokens, stops, options.ignore_eos, options.min_p,
      options.presence_penalty, options.frequency_penalty, options.repetition_penalty,
      options.logprobs, options.top_logprobs, bias, options.prompt_logprobs,
      static_cast<wire::StructuredOutput>(options.structured), schema,
      static_cast<wire::ReasoningBlock>(options.reasoning), options.min_tokens);
  auto prompt = options.prompt.empty() ? 0 : builder.CreateString(options.prompt);
  auto tokens = options.tokens.empty() ? 0 : builder.CreateVector(options.tokens);
  auto tenant = builder.CreateString(options.tenant);
  auto reuse = options.reuse.empty() ? 0 : builder.CreateString(options.reuse);
  const std::string& key = options.api_key.empty() ? credentials_.api_key : options.api_key;
  auto api_key = key.empty() ? 0 : builder.CreateString(key);
  // batch_events: this client reads StreamEventBatch (schema 1.11), so a connection with many
  // streams gets one message per decode step rather than one per stream.
  builder.Finish(wire::CreateGenerateRequest(builder, id, prompt, tokens, sampling, tenant,
                                             options.deadline_ms, options.add_special_tokens, reuse,
                                             api_key, true, options.skip_special_tokens),
                 wire::GenerateRequestIdentifier());
  if (!wire::send(*socket_, wire::encode(wire::MessageType::GenerateRequest, builder)))
    throw std::runtime_error("cannot send to " + endpoint_);
  in_flight_[id] = true;
  return id;
}

void Client::connection_lost() {
  const std::string text = "the connection to the gateway at " + endpoint_ +
                           " was lost (it died or restarted); the request did not finish";
  for (const auto& [id, _] : in_flight_) {
    Event event;
    event.client_request_id = id;
    event.kind = EventKind::kError;
    event.error_code = static_cast<int>(wire::ErrorCode::StageFailed);
    event.error_name = error_name(event.error_code);
    event.error_message = text;
    pending_.push_back(std::move(event));
  }
  in_flight_.clear();
  if (awaiting_control_)
    throw ClientError(static_cast<int>(wire::ErrorCode::StageFailed), "StageFailed", text);
}

bool Client::still_in_flight(const Event& event) {
  if (!in_flight_.count(event.client_request_id)) return false;  // a request we gave up on
  if (event.terminal()) in_flight_.erase(event.client_request_id);
  return true;
}

namespace {

// Rounded up: truncated, a wait of under a millisecond left became a poll that returns at once,
// and a caller waiting in 1 ms steps (moeline load at a --rate) spun a whole core.
std::chrono::milliseconds milliseconds_left(Clock::time_point until) {
  return std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now());
}

}  // namespace

std::optional<Event> Client::receive(std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (true) {
    if (!unread_.empty()) {
      Event event = std::move(unread_.front());
      unread_.pop_front();
      return event;
    }
    const auto left = milliseconds_left(until);
    zmq::pollitem_t items[] = {{socket_->handle(), 0, ZMQ_POLLIN, 0},
                               {monitor_->handle(), 0, ZMQ_POLLIN, 0},
                               {nullptr, wake_fd_, ZMQ_POLLIN, 0}};
    zmq::poll(items, wake_fd_ >= 0 ? 3 : 2, std::max(left, std::chrono::milliseconds(0)));
    if (items[1].revents & ZMQ_POLLIN) {
      // A monitor event is two frames (event and value, then the peer's address).
      zmq::message_t frame;
      while (monitor_->recv(frame, zmq::recv_flags::dontwait) && frame.more()) {
      }
      connection_lost();
      if (!pending_.empty()) {
        Event event = std::move(pending_.front());
        pending_.pop_front();
        return event;
      }
      continue;
    }
    if (!(items[0].revents & ZMQ_POLLIN)) return std::nullopt;  // timeout, or woken
    auto frames = wire::receive(*socket_, true);
    if (!frames) continue;
    wire::Decoded decoded = wire::decode(std::move(*frames));
    if (decoded.error)
      throw std::runtime_error("bad reply from the gateway: " + decoded.error->detail);
    const wire::Message& message = *decoded.message;
    if (message.type == wire::MessageType::StreamEvent) {
      Event event = to_event(*message.as<wire::StreamEvent>());
      if (!still_in_flight(event)) continue;
      return event;
    }
    if (message.type == wire::MessageType::StreamEventBatch) {
      const auto* events = message.as<wire::StreamEventBatch>()->events();
      if (events == nullptr) continue;
      for (const wire::StreamEvent* e : *events) {
        Event event = to_event(*e);
        if (still_in_flight(event)) unread_.push_back(std::move(event));
      }
      continue;  // the loop's first step returns the first of them
    }
    if (message.type == wire::MessageType::ControlReply) {
      const auto* reply = message.as<wire::ControlReply>();
      if (!reply->ok())
        throw ClientError(static_cast<int>(wire::ErrorCode::InvalidRequest), "InvalidRequest",
                          reply->message() ? reply->message()->str() : "control command refused");
      control_replies_.push_back(reply->json() ? reply->json()->str() : "{}");
      if (awaiting_control_) return std::nullopt;
      continue;
    }
    if (message.type == wire::MessageType::ErrorReply) {
      const auto* error = message.as<wire::ErrorReply>();
      const int code = static_cast<int>(error->code());
      const std::string text = error->message() ? error->message()->str() : "";
      if (in_flight_.count(error->client_request_id())) {
        Event event;
        event.client_request_id = error->client_request_id();
        event.kind = EventKind::kError;
        event.error_code = code;
        event.error_name = error_name(code);
        event.error_message = text;
        in_flight_.erase(error->client_request_id());
        return event;
      }
      throw ClientError(code, error_name(code), text);
    }
    throw std::runtime_error(std::string("unexpected ") + wire::message_type_name(message.type) +
                             " from the gateway");
  }
}

std::optional<Event> Client::next_event(std::chrono::milliseconds timeout) {
  if (!pending_.empty()) {
    Event event = std::move(pending_.front());
    pending_.pop_front();
    return event;
  }
  return receive(timeout);
}

Result Client::generate(const GenerateOptions& options,
                        const std::function<void(const Event&)>& on_event) {
  const uint64_t id = start(options);
  Result result;
  auto take = [&](const Event& event) -> bool {
    if (on_event) on_event(event);
    result.request_id = event.request_id;
    switch (event.kind) {
      case EventKind::kAccepted:
        return false;
      case EventKind::kDelta:
        result.ids.insert(result.ids.end(), event.token_ids.begin(), event.token_ids.end());
        result.logprobs.insert(result.logprobs.end(), event.logprobs.begin(), event.logprobs.end());
        if (!event.prompt_token_ids.empty()) {
          result.prompt_ids = event.prompt_token_ids;
          result.prompt_logprobs = event.prompt_logprobs;
        }
        result.text += event.text;
        return false;
      case EventKind::kFinished:
        result.text += event.text;
        result.finish_reason = event.finish_reason;
        result.usage = event.usage;
        result.timings = event.timings;
        return true;
      case EventKind::kError:
        throw ClientError(event.error_code, event.error_name, event.error_message);
    }
    return false;
  };
  // Events of this request that arrived while someone waited for another (or that a lost
  // connection queued for every request at once).
  auto take_pending = [&]() -> bool {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->client_request_id != id) {
        ++it;
        continue;
      }
      Event event = std::move(*it);
      it = pending_.erase(it);
      if (take(event)) return true;
    }
    return false;
  };
  while (true) {
    if (take_pending()) return result;
    std::optional<Event> event = receive(timeout_);
    if (!event) {
      cancel(id);
      reconnect();
      throw TimeoutError("no answer from " + endpoint_ + " within " +
                         std::to_string(timeout_.count()) + " ms");
    }
    if (event->client_request_id != id) {
      pending_.push_back(std::move(*event));
      continue;
    }
    if (take(*event)) return result;
  }
}

void Client::cancel(uint64_t client_request_id) {
  flatbuffers::FlatBufferBuilder builder(64);
  builder.Finish(wire::CreateCancelRequest(builder, client_request_id),
                 wire::GenerateRequestIdentifier());
  wire::send(*socket_, wire::encode(wire::MessageType::CancelRequest, builder), nullptr, true);
}

void Client::feedback(uint64_t client_request_id, float score, const std::string& comment) {
  flatbuffers::FlatBufferBuilder builder(128 + comment.size());
  builder.Finish(
      wire::CreateFeedback(builder, client_request_id, score, builder.CreateString(comment)),
      wire::GenerateRequestIdentifier());
  wire::send(*socket_, wire::encode(wire::MessageType::Feedback, builder));
}

std::string Client::control(const std::string& command, const std::string& arguments) {
  flatbuffers::FlatBufferBuilder builder(128);
  auto api_key = credentials_.api_key.empty() ? 0 : builder.CreateString(credentials_.api_key);
  builder.Finish(wire::CreateControlCommand(builder, builder.CreateString(command),
                                            builder.CreateString(arguments), api_key),
                 wire::ControlCommandIdentifier());
  wire::send(*socket_, wire::encode(wire::MessageType::ControlCommand, builder));
  const auto until = Clock::now() + timeout_;
  awaiting_control_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{awaiting_control_};
  while (control_replies_.empty()) {
    const auto left = milliseconds_left(until);
    if (left.count() <= 0) {
      reconnect();
      throw TimeoutError("no answer from " + endpoint_ + " within " +
                         std::to_string(timeout_.count()) + " ms");
    }
    if (auto event = receive(left)) pending_.push_back(std::move(*event));
  }
  std::string reply = std::move(control_replies_.front());
  control_replies_.pop_front();
  return reply;
}

}  // namespace moeline::sdk
