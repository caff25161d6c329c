// The C++ client SDK (sdk/client.h) against a scripted fake gateway: a ROUTER on an ipc://
// endpoint, served from a thread, that answers by prompt (tests/sdk/test_python_client.py does the
// same for the Python client). It checks what the client sends (every GenerateRequest field,
// cancel, feedback, control), how it assembles streams, multiplexes requests, maps errors, times
// out and reconnects, and that it refuses replies of another magic or schema major.

#include "sdk/client.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "schemas/wire.h"

namespace moeline::sdk {
namespace {

using std::chrono::milliseconds;

// Long enough never to fire on a loaded machine, short enough that a broken test fails quickly.
constexpr milliseconds kPatience{5000};
// How long to wait for something that must not come.
constexpr milliseconds kQuiet{50};

// One message the fake gateway received: its type, the sender's routing identity and the body.
struct Received {
  wire::MessageType type = wire::MessageType::Hello;
  std::string identity;
  std::vector<uint8_t> body;

  template <class Table>
  const Table* as() const {
    return flatbuffers::GetRoot<Table>(body.data());
  }
};

struct EventFields {
  const char* text = nullptr;
  std::vector<int32_t> token_ids;
  const char* finish_reason = nullptr;
  bool usage_and_timings = false;
  wire::ErrorCode error_code = wire::ErrorCode::None;
  const char* error_message = nullptr;
};

// A ROUTER that answers GenerateRequests by prompt, enough of the gateway's contract to drive the
// client:
//   "hello" (and any other prompt, or tokens)  Accepted, Delta [1,2] "ab", Delta [3] "cé",
//                                              Finished "length" with text "!", usage, timings
//   "slow"            Accepted, then nothing until a CancelRequest: Finished "cancelled"
//   "interleave"      like "hello", with a Delta and then a Finished "stop" of every request
//                     held ("slow") on the same connection woven between its own events
//   "fail"            Accepted, Error InvalidSampling
//   "refuse-own"      ErrorReply PromptTooLong carrying the request's client_request_id
//   "refuse-unknown"  ErrorReply MalformedMessage carrying an id the client never used
//   "silent"          nothing at all
//   "bad magic", "bad major"  a StreamEvent whose header has another magic / schema major 2
// ControlCommand "status" gets an ok reply with JSON, any other command a refusal.
class FakeGateway {
 public:
  FakeGateway() : endpoint_(unique_endpoint()), socket_(context_, zmq::socket_type::router) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.bind(endpoint_);
    thread_ = std::thread([this] { run(); });
  }

  ~FakeGateway() {
    stopping_ = true;
    thread_.join();
    socket_.close();
    std::error_code ignored;
    std::filesystem::remove(endpoint_.substr(std::strlen("ipc://")), ignored);
  }

  FakeGateway(const FakeGateway&) = delete;
  FakeGateway& operator=(const FakeGateway&) = delete;

  const std::string& endpoint() const { return endpoint_; }

  // The first received message of `type` that satisfies `match`, waiting up to `patience` for it.
  std::optional<Received> wait_for(wire::MessageType type,
                                   const std::function<bool(const Received&)>& match = {},
                                   milliseconds patience = kPatience) {
    std::unique_lock lock(mutex_);
    std::optional<Received> found;
    changed_.wait_for(lock, patience, [&] {
      for (const Received& r : received_) {
        if (r.type == type && (!match || match(r))) {
          found = r;
          return true;
        }
      }
      return false;
    });
    return found;
  }

  std::vector<Received> received(wire::MessageType type) const {
    std::lock_guard lock(mutex_);
    std::vector<Received> out;
    for (const Received& r : received_)
      if (r.type == type) out.push_back(r);
    return out;
  }

  // What went wrong inside the fake (it must not throw on its thread).
  std::vector<std::string> problems() const {
    std::lock_guard lock(mutex_);
    return problems_;
  }

 private:
  static std::string unique_endpoint() {
    static std::atomic<int> counter{0};
    return "ipc:///tmp/moeline-sdk-test-" + std::to_string(::getpid()) + "-" +
           std::to_string(counter++) + ".sock";
  }

  void run() {
    try {
      while (!stopping_) {
        zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
        zmq::poll(&item, 1, milliseconds(10));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        auto frames = wire::receive(socket_, true);
        if (!frames || frames->size() < 2) continue;
        const std::string identity = frames->front().to_string();
        frames->erase(frames->begin());
        wire::Decoded decoded = wire::decode(std::move(*frames));
        if (!decoded.message) {
          problem("the client sent a message decode() refuses: " + decoded.error->detail);
          continue;
        }
        handle(identity, *decoded.message);
      }
    } catch (const std::exception& e) {
      problem(std::string("fake gateway failed: ") + e.what());
    }
  }

  void problem(std::string text) {
    std::lock_guard lock(mutex_);
    problems_.push_back(std::move(text));
  }

  void record(const std::string& identity, const wire::Message& message) {
    {
      std::lock_guard lock(mutex_);
      const uint8_t* body = message.body.data();
      received_.push_back({message.type, identity, {body, body + message.body.size()}});
    }
    changed_.notify_all();
  }

  void send(const std::string& identity, std::vector<zmq::message_t> frames) {
    if (!wire::send(socket_, std::move(frames), &identity)) problem("cannot send to the client");
  }

  static flatbuffers::Offset<wire::StreamEvent> build_event(flatbuffers::FlatBufferBuilder& b,
                                                            uint64_t crid, wire::EventKind kind,
                                                            const EventFields& f) {
    flatbuffers::Offset<wire::Usage> usage = 0;
    flatbuffers::Offset<wire::Timings> timings = 0;
    if (f.usage_and_timings) {
      usage = wire::CreateUsageDirect(b, 5, 3, 2, "prefix");
      timings = wire::CreateTimings(b, 1.5, 2.5, 3.5, 9.0);
    }
    return wire::CreateStreamEventDirect(
        b, crid, 1000 + crid, kind, f.text, f.token_ids.empty() ? nullptr : &f.token_ids,
        f.finish_reason, usage, timings, f.error_code, f.error_message);
  }

  void event(const std::string& identity, uint64_t crid, wire::EventKind kind,
             const EventFields& f = {}) {
    if (batch_ != nullptr) {
      batch_->push_back({crid, kind, f});
      return;
    }
    flatbuffers::FlatBufferBuilder b(256);
    b.Finish(build_event(b, crid, kind, f), wire::GenerateRequestIdentifier());
    send(identity, wire::encode(wire::MessageType::StreamEvent, b));
  }

  // The events event() gathered since batch_ was set, as one StreamEventBatch (schema 1.11).
  struct BatchedEvent {
    uint64_t crid;
    wire::EventKind kind;
    EventFields fields;
  };
  void send_batch(const std::string& identity, const std::vector<BatchedEvent>& events) {
    flatbuffers::FlatBufferBuilder b(1024);
    std::vector<flatbuffers::Offset<wire::StreamEvent>> offsets;
    for (const BatchedEvent& e : events)
      offsets.push_back(build_event(b, e.crid, e.kind, e.fields));
    b.Finish(wire::CreateStreamEventBatchDirect(b, &offsets), wire::GenerateRequestIdentifier());
    send(identity, wire::encode(wire::MessageType::StreamEventBatch, b));
  }

  void error_reply(const std::string& identity, uint64_t crid, wire::ErrorCode code,
                   const char* text) {
    flatbuffers::FlatBufferBuilder b(128);
    b.Finish(wire::CreateErrorReplyDirect(b, code, text, crid), wire::HelloIdentifier());
    send(identity, wire::encode(wire::MessageType::ErrorReply, b));
  }

  void bad_reply(const std::string& identity, uint64_t crid, bool bad_magic) {
    flatbuffers::FlatBufferBuilder b(64);
    b.Finish(wire::CreateStreamEvent(b, crid, 1000 + crid, wire::EventKind::Accepted),
             wire::GenerateRequestIdentifier());
    std::vector<zmq::message_t> frames = wire::encode_with_version(
        wire::MessageType::StreamEvent, b, bad_magic ? wire::kSchemaMajor : 2, 0);
    if (bad_magic) std::memcpy(frames[0].data(), "HTTP", 4);
    send(identity, std::move(frames));
  }

  void finish_normally(const std::string& identity, uint64_t crid) {
    event(identity, crid, wire::EventKind::Finished,
          {.text = "!", .finish_reason = "length", .usage_and_timings = true});
  }

  void generate(const std::string& identity, const wire::GenerateRequest& request) {
    using K = wire::EventKind;
    const uint64_t crid = request.client_request_id();
    const std::string prompt = request.prompt() ? request.prompt()->str() : "";
    if (prompt == "slow") {
      event(identity, crid, K::Accepted);
      held_[crid] = identity;
    } else if (prompt == "fail") {
      event(identity, crid, K::Accepted);
      event(identity, crid, K::Error,
            {.error_code = wire::ErrorCode::InvalidSampling,
             .error_message = "top_p must be in (0, 1]"});
    } else if (prompt == "refuse-own") {
      error_reply(identity, crid, wire::ErrorCode::PromptTooLong, "9000 tokens");
    } else if (prompt == "refuse-unknown") {
      error_reply(identity, 987654, wire::ErrorCode::MalformedMessage, "bad body");
    } else if (prompt == "silent") {
    } else if (prompt == "bad magic" || prompt == "bad major") {
      bad_reply(identity, crid, prompt == "bad magic");
    } else if (prompt == "interleave" || prompt == "interleave-batched") {
      // Batched: everything after the Accepted in one StreamEventBatch, as a gateway sends one
      // decode step's events of every stream of a connection.
      std::vector<BatchedEvent> batch;
      std::vector<uint64_t> others;
      for (const auto& [held, who] : held_)
        if (who == identity) others.push_back(held);
      event(identity, crid, K::Accepted);
      if (prompt == "interleave-batched") batch_ = &batch;
      for (uint64_t other : others) event(identity, other, K::Delta, {"x", {7}});
      event(identity, crid, K::Delta, {"a", {1}});
      for (uint64_t other : others) {
        event(identity, other, K::Finished, {.finish_reason = "stop"});
        held_.erase(other);
      }
      finish_normally(identity, crid);
      batch_ = nullptr;
      if (!batch.empty()) send_batch(identity, batch);
    } else {
      event(identity, crid, K::Accepted);
      event(identity, crid, K::Delta, {"ab", {1, 2}});
      event(identity, crid, K::Delta, {"c\u00e9", {3}});
      finish_normally(identity, crid);
    }
  }

  void control(const std::string& identity, const wire::ControlCommand& command) {
    const std::string name = command.command() ? command.command()->str() : "";
    flatbuffers::FlatBufferBuilder b(128);
    if (name == "status") {
      b.Finish(wire::CreateControlReplyDirect(b, true, nullptr, R"({"stages": {"prefill": 3}})"),
               wire::ControlCommandIdentifier());
    } else {
      const std::string text = "unknown command " + name;
      b.Finish(wire::CreateControlReplyDirect(b, false, text.c_str(), nullptr),
               wire::ControlCommandIdentifier());
    }
    send(identity, wire::encode(wire::MessageType::ControlReply, b));
  }

  void handle(const std::string& identity, const wire::Message& message) {
    record(identity, message);
    switch (message.type) {
      case wire::MessageType::GenerateRequest:
        generate(identity, *message.as<wire::GenerateRequest>());
        break;
      case wire::MessageType::CancelRequest: {
        const uint64_t crid = message.as<wire::CancelRequest>()->client_request_id();
        if (auto it = held_.find(crid); it != held_.end()) {
          event(it->second, crid, wire::EventKind::Finished, {.finish_reason = "cancelled"});
          held_.erase(it);
        }
        break;
      }
      case wire::MessageType::ControlCommand:
        control(identity, *message.as<wire::ControlCommand>());
        break;
      default:
        break;  // Feedback is only recorded
    }
  }

  std::string endpoint_;
  zmq::context_t context_{1};
  zmq::socket_t socket_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Received> received_;
  std::vector<BatchedEvent>* batch_ = nullptr;  // where event() gathers, while set
  std::vector<std::string> problems_;
  std::map<uint64_t, std::string> held_;  // crid -> identity; touched by the fake's thread only
};

class SdkTest : public testing::Test {
 protected:
  void TearDown() override {
    client_.reset();  // first, so that its last cancels reach a live gateway
    for (const std::string& problem : gateway_.problems()) ADD_FAILURE() << problem;
  }

  Client& client(milliseconds timeout = kPatience) {
    if (!client_) client_ = std::make_unique<Client>(gateway_.endpoint(), timeout);
    return *client_;
  }

  FakeGateway gateway_;
  std::unique_ptr<Client> client_;
};

std::vector<EventKind> kinds_of(const std::vector<Event>& events) {
  std::vector<EventKind> out;
  for (const Event& e : events) out.push_back(e.kind);
  return out;
}

// --- generate ------------------------------------------------------------------------------------

TEST_F(SdkTest, GenerateCollectsTheStreamIntoAResult) {
  std::vector<Event> events;
  const Result result =
      client().generate({.prompt = "hello"}, [&](const Event& e) { events.push_back(e); });

  EXPECT_EQ(result.request_id, 1001u);
  EXPECT_EQ(result.ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(result.text, "abc\u00e9!") << "the Finished event's text is the stream's tail";
  EXPECT_EQ(result.finish_reason, "length");
  EXPECT_EQ(result.usage.prompt_tokens, 5u);
  EXPECT_EQ(result.usage.completion_tokens, 3u);
  EXPECT_EQ(result.usage.reused_tokens, 2u);
  EXPECT_EQ(result.usage.reuse_level, "prefix");
  EXPECT_EQ(result.timings.queue_ms, 1.5);
  EXPECT_EQ(result.timings.prefill_ms, 2.5);
  EXPECT_EQ(result.timings.ttft_ms, 3.5);
  EXPECT_EQ(result.timings.total_ms, 9.0);
  EXPECT_EQ(client().in_flight(), 0u);

  ASSERT_EQ(kinds_of(events), (std::vector<EventKind>{EventKind::kAccepted, EventKind::kDelta,
                                                      EventKind::kDelta, EventKind::kFinished}));
  for (const Event& e : events) {
    EXPECT_EQ(e.client_request_id, 1u);
    EXPECT_EQ(e.request_id, 1001u);
  }
  EXPECT_EQ(events[1].token_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(events[1].text, "ab");
  EXPECT_EQ(events[2].text, "c\u00e9");
  EXPECT_FALSE(events[2].terminal());
  EXPECT_TRUE(events[3].terminal());
  EXPECT_EQ(events[3].finish_reason, "length");
  EXPECT_EQ(events[3].error_code, 0);
}

TEST_F(SdkTest, GenerateRequestCarriesTheOptions) {
  client().generate({.prompt = "hello",
                     .max_tokens = 33,
                     .temperature = 0.5,
                     .top_k = 4,
                     .top_p = 0.9,
                     .seed = 0,  // a seed of 0 is still a seed
                     .stop_token_ids = {5, 6},
                     .ignore_eos = true,
                     .min_p = 0.05,
                     .presence_penalty = 0.25,
                     .frequency_penalty = -0.5,
                     .repetition_penalty = 1.125,
                     .logprobs = true,
                     .top_logprobs = 3,
                     .prompt_logprobs = true,
                     .logit_bias = {{11, -2.5f}, {12, 4.0f}},
                     .tenant = "acme",
                     .deadline_ms = 1500,
                     .add_special_tokens = false,
                     .reuse = "approximate"});
  client().generate({.tokens = {9, 8, 7}});

  const std::vector<Received> sent = gateway_.received(wire::MessageType::GenerateRequest);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[0].identity, sent[1].identity) << "one connection for both requests";

  const auto* r = sent[0].as<wire::GenerateRequest>();
  EXPECT_TRUE(flatbuffers::BufferHasIdentifier(sent[0].body.data(), "MLCL"));
  EXPECT_EQ(r->client_request_id(), 1u);
  ASSERT_NE(r->prompt(), nullptr);
  EXPECT_EQ(r->prompt()->str(), "hello");
  EXPECT_EQ(r->tokens(), nullptr);
  ASSERT_NE(r->tenant(), nullptr);
  EXPECT_EQ(r->tenant()->str(), "acme");
  EXPECT_EQ(r->deadline_ms(), 1500u);
  EXPECT_FALSE(r->add_special_tokens());
  ASSERT_NE(r->reuse(), nullptr);
  EXPECT_EQ(r->reuse()->str(), "approximate");
  EXPECT_TRUE(r->batch_events()) << "the SDK reads StreamEventBatch, and says so";
  const auto* s = r->sampling();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->max_tokens(), 33);
  EXPECT_EQ(s->temperature(), 0.5);
  EXPECT_EQ(s->top_k(), 4);
  EXPECT_EQ(s->top_p(), 0.9);
  EXPECT_EQ(s->seed(), 0u);
  EXPECT_TRUE(s->has_seed());
  ASSERT_NE(s->stop_token_ids(), nullptr);
  EXPECT_EQ(std::vector<int32_t>(s->stop_token_ids()->begin(), s->stop_token_ids()->end()),
            (std::vector<int32_t>{5, 6}));
  EXPECT_TRUE(s->ignore_eos());
  // Every other sampling field, each at a value no other field has.
  EXPECT_EQ(s->min_p(), 0.05);
  EXPECT_EQ(s->presence_penalty(), 0.25);
  EXPECT_EQ(s->frequency_penalty(), -0.5);
  EXPECT_EQ(s->repetition_penalty(), 1.125);
  EXPECT_TRUE(s->logprobs());
  EXPECT_EQ(s->top_logprobs(), 3);
  EXPECT_TRUE(s->prompt_logprobs());
  ASSERT_NE(s->logit_bias(), nullptr);
  ASSERT_EQ(s->logit_bias()->size(), 2u);
  EXPECT_EQ(s->logit_bias()->Get(0)->token(), 11);
  EXPECT_EQ(s->logit_bias()->Get(0)->bias(), -2.5f);
  EXPECT_EQ(s->logit_bias()->Get(1)->token(), 12);
  EXPECT_EQ(s->logit_bias()->Get(1)->bias(), 4.0f);

  // Token ids instead of a prompt, every other option at its default.
  r = sent[1].as<wire::GenerateRequest>();
  EXPECT_EQ(r->client_request_id(), 2u);
  EXPECT_EQ(r->prompt(), nullptr);
  ASSERT_NE(r->tokens(), nullptr);
  EXPECT_EQ(std::vector<int32_t>(r->tokens()->begin(), r->tokens()->end()),
            (std::vector<int32_t>{9, 8, 7}));
  EXPECT_EQ(r->deadline_ms(), 0u);
  EXPECT_TRUE(r->add_special_tokens());
  EXPECT_TRUE(r->tenant() == nullptr || r->tenant()->str().empty());
  EXPECT_EQ(r->reuse(), nullptr) << "no reuse field: the tenant's exact levels";
  s = r->sampling();
  ASSERT_NE(s, nullptr);
  EXPECT_FALSE(s->has_seed());
  EXPECT_EQ(s->max_tokens(), 16);
  EXPECT_EQ(s->temperature(), 0.0);
  EXPECT_EQ(s->top_k(), 0);
  EXPECT_EQ(s->top_p(), 1.0);
  EXPECT_TRUE(s->stop_token_ids() == nullptr || s->stop_token_ids()->size() == 0);
  EXPECT_FALSE(s->ignore_eos());
}

// --- errors --------------------------------------------------------------------------------------

TEST_F(SdkTest, ErrorEventBecomesClientError) {
  std::vector<Event> events;
  try {
    client().generate({.prompt = "fail"}, [&](const Event& e) { events.push_back(e); });
    FAIL() << "generate() returned on an Error event";
  } catch (const ClientError& e) {
    EXPECT_EQ(e.code(), static_cast<int>(wire::ErrorCode::InvalidSampling));
    EXPECT_EQ(e.name(), "InvalidSampling");
    EXPECT_NE(std::string(e.what()).find("top_p must be in (0, 1]"), std::string::npos) << e.what();
  }
  ASSERT_EQ(kinds_of(events), (std::vector<EventKind>{EventKind::kAccepted, EventKind::kError}));
  EXPECT_EQ(events[1].error_name, "InvalidSampling");
  EXPECT_TRUE(events[1].terminal());
  EXPECT_EQ(client().in_flight(), 0u);
  EXPECT_EQ(client().generate({.prompt = "hello"}).text, "abc\u00e9!") << "still usable";
}

TEST_F(SdkTest, ErrorReplyForARequestInFlightEndsThatRequest) {
  try {
    client().generate({.prompt = "refuse-own"});
    FAIL() << "generate() returned on an ErrorReply";
  } catch (const ClientError& e) {
    EXPECT_EQ(e.code(), static_cast<int>(wire::ErrorCode::PromptTooLong));
    EXPECT_EQ(e.name(), "PromptTooLong");
    EXPECT_NE(std::string(e.what()).find("9000 tokens"), std::string::npos) << e.what();
  }
  EXPECT_EQ(client().in_flight(), 0u);

  // Through next_event it is the request's terminal error event.
  const uint64_t id = client().start({.prompt = "refuse-own"});
  const std::optional<Event> event = client().next_event(kPatience);
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(event->client_request_id, id);
  EXPECT_EQ(event->kind, EventKind::kError);
  EXPECT_TRUE(event->terminal());
  EXPECT_EQ(event->error_code, static_cast<int>(wire::ErrorCode::PromptTooLong));
  EXPECT_EQ(event->error_name, "PromptTooLong");
  EXPECT_EQ(event->error_message, "9000 tokens");
  EXPECT_EQ(client().in_flight(), 0u);
}

TEST_F(SdkTest, ErrorReplyForAnUnknownRequestThrows) {
  try {
    client().generate({.prompt = "refuse-unknown"});
    FAIL() << "generate() returned on an ErrorReply";
  } catch (const ClientError& e) {
    EXPECT_EQ(e.code(), static_cast<int>(wire::ErrorCode::MalformedMessage));
    EXPECT_EQ(e.name(), "MalformedMessage");
    EXPECT_NE(std::string(e.what()).find("bad body"), std::string::npos) << e.what();
  }
  client().start({.prompt = "refuse-unknown"});
  EXPECT_THROW(client().next_event(kPatience), ClientError);
}

TEST_F(SdkTest, ErrorNamesCoverTheEnum) {
  EXPECT_STREQ(error_name(0), "None");
  EXPECT_STREQ(error_name(static_cast<int>(wire::ErrorCode::DeadlineExceeded)), "DeadlineExceeded");
  EXPECT_STREQ(error_name(static_cast<int>(wire::ErrorCode::HelloRequired)), "HelloRequired");
  EXPECT_STREQ(error_name(999), "Unknown");
}

// --- several requests on one connection ----------------------------------------------------------

// The same events one by one, or (schema 1.11) all but the first in one StreamEventBatch.
class SdkInterleaved : public SdkTest, public ::testing::WithParamInterface<const char*> {};
INSTANTIATE_TEST_SUITE_P(OneByOneAndBatched, SdkInterleaved,
                         ::testing::Values("interleave", "interleave-batched"));

TEST_P(SdkInterleaved, NextEventInterleavesRequestsInArrivalOrder) {
  const uint64_t slow = client().start({.prompt = "slow"});
  const uint64_t fast = client().start({.prompt = GetParam()});
  EXPECT_NE(slow, fast);
  EXPECT_EQ(client().in_flight(), 2u);

  const std::vector<std::pair<uint64_t, EventKind>> want = {
      {slow, EventKind::kAccepted}, {fast, EventKind::kAccepted}, {slow, EventKind::kDelta},
      {fast, EventKind::kDelta},    {slow, EventKind::kFinished}, {fast, EventKind::kFinished}};
  std::vector<Event> events;
  while (events.size() < want.size()) {
    std::optional<Event> event = client().next_event(kPatience);
    ASSERT_TRUE(event.has_value()) << "after " << events.size() << " events";
    events.push_back(std::move(*event));
  }
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(events[i].client_request_id, want[i].first) << "event " << i;
    EXPECT_EQ(events[i].kind, want[i].second) << "event " << i;
  }
  EXPECT_EQ(events[2].text, "x");
  EXPECT_EQ(events[4].finish_reason, "stop");
  EXPECT_EQ(events[5].finish_reason, "length");
  EXPECT_EQ(client().in_flight(), 0u);
  EXPECT_FALSE(client().next_event(kQuiet).has_value()) << "nothing more was sent";
}

TEST_P(SdkInterleaved, GenerateKeepsOtherRequestsEventsForNextEvent) {
  const uint64_t slow = client().start({.prompt = "slow"});
  const Result result = client().generate({.prompt = GetParam()});
  EXPECT_EQ(result.ids, (std::vector<int32_t>{1}));
  EXPECT_EQ(result.text, "a!");
  EXPECT_EQ(result.finish_reason, "length");

  // The slow request's events, which arrived during generate(), in their order.
  std::vector<Event> events;
  while (std::optional<Event> event = client().next_event(kQuiet)) events.push_back(*event);
  ASSERT_EQ(kinds_of(events), (std::vector<EventKind>{EventKind::kAccepted, EventKind::kDelta,
                                                      EventKind::kFinished}));
  for (const Event& e : events) EXPECT_EQ(e.client_request_id, slow);
  EXPECT_EQ(events[1].token_ids, (std::vector<int32_t>{7}));
  EXPECT_EQ(events[2].finish_reason, "stop");
  EXPECT_EQ(client().in_flight(), 0u);
}

// --- cancel, feedback, control -------------------------------------------------------------------

TEST_F(SdkTest, CancelSendsCancelRequestAndTheStreamEnds) {
  const uint64_t slow = client().start({.prompt = "slow"});
  std::optional<Event> event = client().next_event(kPatience);
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(event->kind, EventKind::kAccepted);

  client().cancel(slow);
  const std::optional<Received> cancel = gateway_.wait_for(wire::MessageType::CancelRequest);
  ASSERT_TRUE(cancel.has_value()) << "no CancelRequest reached the gateway";
  EXPECT_TRUE(flatbuffers::BufferHasIdentifier(cancel->body.data(), "MLCL"));
  EXPECT_EQ(cancel->as<wire::CancelRequest>()->client_request_id(), slow);

  event = client().next_event(kPatience);
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(event->client_request_id, slow);
  EXPECT_EQ(event->kind, EventKind::kFinished);
  EXPECT_EQ(event->finish_reason, "cancelled");
  EXPECT_EQ(client().in_flight(), 0u);
}

TEST_F(SdkTest, FeedbackReachesTheGateway) {
  client().feedback(7, 0.5f, "good");
  client().feedback(8, -1.0f);
  const std::optional<Received> first = gateway_.wait_for(
      wire::MessageType::Feedback,
      [](const Received& r) { return r.as<wire::Feedback>()->client_request_id() == 7; });
  ASSERT_TRUE(first.has_value());
  const auto* fb = first->as<wire::Feedback>();
  EXPECT_EQ(fb->score(), 0.5f);
  ASSERT_NE(fb->comment(), nullptr);
  EXPECT_EQ(fb->comment()->str(), "good");
  const std::optional<Received> second = gateway_.wait_for(
      wire::MessageType::Feedback,
      [](const Received& r) { return r.as<wire::Feedback>()->client_request_id() == 8; });
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->as<wire::Feedback>()->score(), -1.0f);
}

TEST_F(SdkTest, ControlReturnsTheReplyJson) {
  EXPECT_EQ(client(kPatience).control("status"), R"({"stages": {"prefill": 3}})");
  const std::vector<Received> sent = gateway_.received(wire::MessageType::ControlCommand);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_TRUE(flatbuffers::BufferHasIdentifier(sent[0].body.data(), "MLCT"));
  ASSERT_NE(sent[0].as<wire::ControlCommand>()->command(), nullptr);
  EXPECT_EQ(sent[0].as<wire::ControlCommand>()->command()->str(), "status");
}

TEST_F(SdkTest, RefusedControlCommandThrows) {
  try {
    client(kPatience).control("bogus", "now");
    FAIL() << "a refused control command returned";
  } catch (const ClientError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown command bogus"), std::string::npos) << e.what();
  }
  const std::optional<Received> sent = gateway_.wait_for(wire::MessageType::ControlCommand);
  ASSERT_TRUE(sent.has_value());
  ASSERT_NE(sent->as<wire::ControlCommand>()->arguments(), nullptr);
  EXPECT_EQ(sent->as<wire::ControlCommand>()->arguments()->str(), "now");
  EXPECT_EQ(client().control("status"), R"({"stages": {"prefill": 3}})") << "still usable";
}

TEST_F(SdkTest, ControlKeepsEventsThatArriveMeanwhile) {
  const uint64_t slow = client(kPatience).start({.prompt = "slow"});
  EXPECT_EQ(client().control("status"), R"({"stages": {"prefill": 3}})");
  const std::optional<Event> event = client().next_event(kQuiet);
  ASSERT_TRUE(event.has_value()) << "the Accepted read during control() was lost";
  EXPECT_EQ(event->client_request_id, slow);
  EXPECT_EQ(event->kind, EventKind::kAccepted);
}

TEST_F(SdkTest, ControlReturnsWhenTheReplyArrives) {
  constexpr milliseconds kTimeout{3000};
  Client& c = client(kTimeout);
  const auto started = std::chrono::steady_clock::now();
  EXPECT_EQ(c.control("status"), R"({"stages": {"prefill": 3}})");
  const auto waited =
      std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - started);
  // Loose: the fake answers at once; only "waited for the timeout" is a failure.
  EXPECT_LT(waited.count(), kTimeout.count() / 2);
}

// --- timeouts and reconnect ----------------------------------------------------------------------

TEST_F(SdkTest, SilentGatewayTimesOutCancelsAndReconnects) {
  constexpr milliseconds kTimeout{200};
  Client& c = client(kTimeout);
  const auto started = std::chrono::steady_clock::now();
  EXPECT_THROW(c.generate({.prompt = "silent"}), TimeoutError);
  const auto waited =
      std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - started);
  // Loose bounds: only "did not wait at all" and "hung" are failures.
  EXPECT_GE(waited.count(), kTimeout.count() / 2);
  EXPECT_LT(waited.count(), kPatience.count());
  EXPECT_EQ(c.in_flight(), 0u);

  const std::optional<Received> silent = gateway_.wait_for(wire::MessageType::GenerateRequest);
  ASSERT_TRUE(silent.has_value());
  const uint64_t silent_id = silent->as<wire::GenerateRequest>()->client_request_id();
  const std::optional<Received> cancel = gateway_.wait_for(wire::MessageType::CancelRequest);
  ASSERT_TRUE(cancel.has_value()) << "the timed-out request was not cancelled";
  EXPECT_EQ(cancel->as<wire::CancelRequest>()->client_request_id(), silent_id);

  // The next request works, on a fresh connection (a new routing identity at the gateway). Its
  // events are waited for with kPatience, not the client's 200 ms: a busy machine may take longer
  // to connect and answer, and only the reconnect is checked here.
  const uint64_t next = c.start({.prompt = "hello"});
  std::string text;
  for (;;) {
    const std::optional<Event> event = c.next_event(kPatience);
    ASSERT_TRUE(event.has_value()) << "the request after the timeout was not answered";
    if (event->client_request_id != next) continue;
    text += event->text;
    if (!event->terminal()) continue;
    EXPECT_EQ(event->kind, EventKind::kFinished) << event->error_message;
    break;
  }
  EXPECT_EQ(text, "abc\u00e9!");
  const std::vector<Received> sent = gateway_.received(wire::MessageType::GenerateRequest);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_NE(sent[1].identity, sent[0].identity) << "no reconnect after the timeout";
  EXPECT_NE(sent[1].as<wire::GenerateRequest>()->client_request_id(), silent_id)
      << "an id must never name two requests of one client";
}

TEST_F(SdkTest, TimeoutCancelsEveryRequestInFlight) {
  Client& c = client(milliseconds(200));
  const uint64_t slow = c.start({.prompt = "slow"});
  EXPECT_THROW(c.generate({.prompt = "silent"}), TimeoutError);
  EXPECT_EQ(c.in_flight(), 0u);
  EXPECT_TRUE(gateway_
                  .wait_for(wire::MessageType::CancelRequest,
                            [&](const Received& r) {
                              return r.as<wire::CancelRequest>()->client_request_id() == slow;
                            })
                  .has_value())
      << "the other request in flight was dropped without a CancelRequest";
}

TEST_F(SdkTest, NextEventReturnsNothingAfterItsTimeout) {
  client().start({.prompt = "silent"});
  EXPECT_FALSE(client().next_event(kQuiet).has_value());
  EXPECT_EQ(client().in_flight(), 1u) << "next_event's timeout leaves the request in flight";
}

// A wait of a millisecond is a millisecond, not a poll that returns at once: truncated to whole
// milliseconds, what was left of it became zero, and a caller waiting in 1 ms steps spun a core.
TEST_F(SdkTest, NextEventWaitsItsWholeTimeout) {
  client().start({.prompt = "silent"});
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) ASSERT_FALSE(client().next_event(milliseconds(1)).has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(100));
}

// --- replies the client must refuse --------------------------------------------------------------

TEST_F(SdkTest, ReplyWithWrongMagicThrows) {
  try {
    client().generate({.prompt = "bad magic"});
    FAIL() << "a reply with a wrong magic was accepted";
  } catch (const ClientError& e) {
    FAIL() << "not a ClientError: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("magic"), std::string::npos) << e.what();
  }
  EXPECT_EQ(client().generate({.prompt = "hello"}).text, "abc\u00e9!") << "still usable";
}

TEST_F(SdkTest, ReplyOfAnotherSchemaMajorThrows) {
  try {
    client().generate({.prompt = "bad major"});
    FAIL() << "a reply of schema major 2 was accepted";
  } catch (const ClientError& e) {
    FAIL() << "not a ClientError: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("schema major 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(client().generate({.prompt = "hello"}).text, "abc\u00e9!") << "still usable";
}

// --- Curve: the server key ------------------------------------------------------------------

// A key file whose path is exactly 40 characters, all of them in Z85's alphabet, is read as a
// file: taken for the key itself, the handshake would fail and the first request be lost.
TEST(SdkCurve, AKeyFileWhosePathIsFortyCharactersIsReadAsAFile) {
  char server_public[41] = {}, server_secret[41] = {};
  ASSERT_EQ(zmq_curve_keypair(server_public, server_secret), 0);
  const std::string dir = "/tmp/mlk" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::string path = dir + "/";
  path += std::string(40 - path.size() - 4, 'g') + ".pub";
  ASSERT_EQ(path.size(), 40u);
  {
    std::ofstream out(path);
    out << R"({"name": "gateway", "role": "gateway", "public": ")" << server_public << "\"}";
  }
  zmq::context_t context;
  zmq::socket_t server(context, zmq::socket_type::router);
  server.set(zmq::sockopt::curve_server, true);
  server.set(zmq::sockopt::curve_secretkey, std::string(server_secret));
  server.set(zmq::sockopt::linger, 0);
  server.bind("tcp://127.0.0.1:*");
  const std::string endpoint = server.get(zmq::sockopt::last_endpoint);

  Client client(endpoint, kPatience, Credentials{.server_key = path});
  client.start({.prompt = "over Curve"});
  zmq::pollitem_t item{server.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, kPatience);
  EXPECT_TRUE(item.revents & ZMQ_POLLIN) << "the request never arrived: the handshake failed";
  std::filesystem::remove_all(dir);

  // Neither a file nor a key: a clear error, not a connection that silently fails.
  EXPECT_THROW(Client(endpoint, kPatience, Credentials{.server_key = std::string(40, '~')}),
               std::runtime_error);
}

}  // namespace
}  // namespace moeline::sdk
