// The data path's pure parts: which probe owns a namespace (consistent hashing) and the tickets
// that let an intake take only what the gateway arranged.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/quant_matmul.h"
#include "stages/common/common.h"
#include "stages/gateway/client_requests.h"
#include "stages/gateway/probe_ring.h"
#include "stages/runtime/hub.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/link.h"

namespace moeline {
namespace {

// A stored activation is found only by the arithmetic that computed it: the model's part of
// every reuse key changes with the model, with --quant-math and with --bf16-math (and, by
// construction, with kernels::kArithmeticRevision), and is the same for the same settings.
TEST(ReuseKeys, FollowTheModelAndTheArithmetic) {
  const kernels::QuantMath quant = kernels::quant_math();
  const kernels::Bf16Math bf16 = kernels::bf16_math();
  kernels::set_quant_math(kernels::QuantMath::kFast);
  kernels::set_bf16_math(kernels::Bf16Math::kExact);
  const uint64_t key = stages::reuse_model_key(7);
  EXPECT_EQ(stages::reuse_model_key(7), key);
  EXPECT_NE(stages::reuse_model_key(8), key);
  EXPECT_EQ(key, stages::settings_hash(7));  // what peers agree on at hello
  kernels::set_quant_math(kernels::QuantMath::kExact);
  EXPECT_NE(stages::reuse_model_key(7), key);
  kernels::set_quant_math(kernels::QuantMath::kFast);
  kernels::set_bf16_math(kernels::Bf16Math::kFast);
  EXPECT_NE(stages::reuse_model_key(7), key);
  kernels::set_quant_math(quant);
  kernels::set_bf16_math(bf16);
}

std::vector<std::string> namespaces(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back("tenant:t" + std::to_string(i));
  return out;
}

TEST(GatewayRequestIds, ARestartedGatewayNeverReusesAnIdOfItsPreviousLife) {
  // The stale sequences of a killed gateway's requests still stream from decode; a restarted
  // gateway counting from 1 again took their tokens for its own first requests.
  using std::chrono::milliseconds;
  using std::chrono::seconds;
  const auto start = std::chrono::system_clock::time_point(seconds(1'796'000'000));
  const uint64_t first_life = stages::first_request_id(start);
  // A life of 2 s at 100,000 requests a second, and the next one started 2 s later.
  EXPECT_GT(stages::first_request_id(start + seconds(2)), first_life + 200'000);
  // A gateway killed 300 ms after it started (a crash loop): its restart falls in the same second.
  EXPECT_GT(stages::first_request_id(start + milliseconds(300)), first_life + 30'000);
  EXPECT_GT(first_life, 0u);
  // Exact as a double in JSON readers until 2109.
  EXPECT_LT(stages::first_request_id(
                std::chrono::system_clock::time_point(seconds(86'400LL * 365 * 139))),
            uint64_t{1} << 53);
}

TEST(ProbeRing, ANamespaceAlwaysLandsOnTheSameReplica) {
  stages::ProbeRing a, b;
  a.update({"probe-0", "probe-1", "probe-2"});
  b.update({"probe-2", "probe-0", "probe-1"});  // another order, another process
  for (const std::string& ns : namespaces(2000)) {
    EXPECT_EQ(a.owner(ns), a.owner(ns));
    EXPECT_EQ(a.owner(ns), b.owner(ns)) << ns;
  }
}

TEST(ProbeRing, SpreadsNamespacesOverTheReplicas) {
  stages::ProbeRing ring;
  ring.update({"probe-0", "probe-1"});
  std::map<std::string, int> count;
  for (const std::string& ns : namespaces(10000)) ++count[ring.owner(ns)];
  ASSERT_EQ(count.size(), 2u);
  // 64 points each: a share within 35-65% (the expected spread is a few percent).
  for (const auto& [replica, n] : count) {
    EXPECT_GT(n, 3500) << replica;
    EXPECT_LT(n, 6500) << replica;
  }
}

TEST(ProbeRing, LosingOrAddingAReplicaMovesOnlyItsShare) {
  stages::ProbeRing three, two;
  three.update({"probe-0", "probe-1", "probe-2"});
  two.update({"probe-0", "probe-1"});
  int moved = 0;
  for (const std::string& ns : namespaces(5000)) {
    if (three.owner(ns) != "probe-2") {
      EXPECT_EQ(three.owner(ns), two.owner(ns)) << ns << " moved without its replica leaving";
    } else {
      ++moved;
      EXPECT_NE(two.owner(ns), "probe-2");
    }
  }
  EXPECT_GT(moved, 0);
}

TEST(ProbeRing, NoReplicaNoOwner) {
  stages::ProbeRing ring;
  EXPECT_EQ(ring.owner("tenant:a"), "");
  ring.update({"probe"});
  EXPECT_EQ(ring.owner("tenant:a"), "probe");
  ring.update({});
  EXPECT_EQ(ring.owner("tenant:a"), "");
}

TEST(HandoverTicket, OnlyTheKeyAndJobItWasSignedForCheck) {
  const runtime::HandoverKey key = runtime::new_handover_key();
  const runtime::HandoverKey other = runtime::new_handover_key();
  const runtime::Ticket ticket = runtime::handover_ticket(key, 42, 2);
  EXPECT_TRUE(runtime::valid_ticket(key, 42, 2, ticket));
  EXPECT_FALSE(runtime::valid_ticket(other, 42, 2, ticket));  // another replica's key
  EXPECT_FALSE(runtime::valid_ticket(key, 43, 2, ticket));    // another request
  EXPECT_FALSE(runtime::valid_ticket(key, 42, 3, ticket));    // another attempt (a retry)
  runtime::Ticket flipped = ticket;
  flipped[7] ^= 1;
  EXPECT_FALSE(runtime::valid_ticket(key, 42, 2, flipped));
  EXPECT_FALSE(runtime::valid_ticket(key, 42, 2, std::span(ticket).first(16)));  // truncated
  EXPECT_FALSE(runtime::valid_ticket(key, 42, 2, {}));
}

TEST(IntakeEndpoint, AutoSitsNextToTheHub) {
  const std::string ipc =
      runtime::intake_bind_endpoint("auto", "ipc:///tmp/run/hub.sock", "decode", "decode-1");
  EXPECT_EQ(ipc.rfind("ipc:///tmp/run/decode-decode-1-", 0), 0u) << ipc;
  const std::string tcp =
      runtime::intake_bind_endpoint("auto", "tcp://127.0.0.1:5555", "decode", "decode-1");
  EXPECT_EQ(tcp, "tcp://127.0.0.1:*");
  EXPECT_EQ(runtime::intake_bind_endpoint("tcp://0.0.0.0:7000", "tcp://10.0.0.1:5555", "probe",
                                          "probe-0"),
            "tcp://0.0.0.0:7000");
}

// A hub on its own thread and worker links to it, over ipc://.
class HubAndLinks : public ::testing::Test {
 protected:
  void SetUp() override {
    endpoint_ = "ipc:///tmp/moeline-hubtest-" + std::to_string(::getpid()) + ".sock";
    // The hub waits 5 s for a silent peer (a busy machine can hold the links' heartbeat thread
    // back for longer than 300 ms); the links' own 300 ms is what AStageBusy... checks.
    hub_ = std::make_unique<runtime::Hub>(context_, endpoint_, 42, 50, 5000, log_, metrics_);
    serving_ = std::thread([this] {
      while (!stop_) {
        std::lock_guard<std::mutex> lock(mutex_);
        while (hub_->receive()) {
        }
        hub_->tick();
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  }
  void TearDown() override {
    stop_ = true;
    serving_.join();
  }
  std::unique_ptr<runtime::HubLink> link(const std::string& replica) {
    runtime::LinkSettings settings;
    settings.hub = endpoint_;
    settings.stage = wire::StageKind::Decode;
    settings.replica = replica;
    settings.settings_hash = 42;
    settings.heartbeat_ms = 50;
    settings.peer_timeout_ms = 300;
    return std::make_unique<runtime::HubLink>(context_, settings, log_, metrics_);
  }
  static void say_hello(runtime::HubLink& link) {
    link.hello(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!link.accepted() && std::chrono::steady_clock::now() < until) link.receive(20);
    ASSERT_TRUE(link.accepted());
  }

  zmq::context_t context_{1};
  runtime::Logger log_{"test", "test"};
  runtime::Registry metrics_;
  std::string endpoint_;
  std::unique_ptr<runtime::Hub> hub_;
  std::mutex mutex_;
  std::atomic<bool> stop_{false};
  std::thread serving_;
};

TEST_F(HubAndLinks, AHelloAgainKeepsTheHandoverKeyAndANewPeerGetsAnother) {
  auto decode = link("decode-0");
  say_hello(*decode);
  ASSERT_TRUE(decode->handover_key().has_value());
  const auto first = *decode->handover_key();
  // Again, as after a pause: the transfers already signed for this replica must still check.
  say_hello(*decode);
  EXPECT_EQ(*decode->handover_key(), first);
  auto other = link("decode-1");
  say_hello(*other);
  EXPECT_NE(*other->handover_key(), first);
}

std::vector<zmq::message_t> empty_token_batch() {
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(wire::CreateTokenBatchDirect(builder, nullptr, 0, 0),
                 wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::TokenBatch, builder);
}

// How much credit the hub holds for `link`, and how much it took by each carrier, once `ready`
// holds (the hub runs on its own thread).
struct HubView {
  uint32_t credits = 0;
  double in_envelopes = 0, in_messages = 0;
};

TEST_F(HubAndLinks, AJobsCreditRidesOnTheMessageThatFinishesIt) {
  auto decode = link("decode-0");
  say_hello(*decode);  // one credit
  auto view = [&] {
    std::lock_guard<std::mutex> lock(mutex_);
    HubView v;
    if (const runtime::Peer* peer = hub_->peer(decode->identity())) v.credits = peer->credits;
    v.in_envelopes =
        metrics_.counter("moeline_hub_credits_total", "", {{"carried_by", "envelope"}}).value();
    v.in_messages =
        metrics_.counter("moeline_hub_credits_total", "", {{"carried_by", "message"}}).value();
    return v;
  };
  auto wait_for = [&](uint32_t credits) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (view().credits != credits && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return view();
  };
  // Granted, then the result sent: one message carries both.
  decode->grant(2);
  ASSERT_TRUE(decode->send(empty_token_batch()));
  HubView v = wait_for(3);
  EXPECT_EQ(v.credits, 3u);
  EXPECT_EQ(v.in_envelopes, 2);
  EXPECT_EQ(v.in_messages, 0);
  // Granted with nothing to send: it goes back in a Credit message when the stage next waits.
  decode->grant(4);
  decode->receive(0);
  v = wait_for(7);
  EXPECT_EQ(v.credits, 7u);
  EXPECT_EQ(v.in_envelopes, 2);
  EXPECT_EQ(v.in_messages, 4);
  // More than an envelope holds: the rest follows when the stage waits.
  decode->grant(300);
  ASSERT_TRUE(decode->send(empty_token_batch()));
  decode->receive(0);
  v = wait_for(307);
  EXPECT_EQ(v.credits, 307u);
  EXPECT_EQ(v.in_envelopes, 2 + wire::kMaxEnvelopeCredits);
  EXPECT_EQ(v.in_messages, 4 + 300 - wire::kMaxEnvelopeCredits);
  // A hello states all the capacity free: credit granted before it is not sent on top of it.
  decode->grant(5);
  say_hello(*decode);
  ASSERT_TRUE(decode->send(empty_token_batch()));
  decode->receive(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(view().credits, 1u);
}

// A hub of schema 1.13 refuses credit in the envelope: a link whose hello it answered gets each
// grant in a Credit message, right after the message it followed (the order of 1.13).
TEST(HubLinkToAnOlderHub, SendsCreditAsCreditMessages) {
  zmq::context_t context(1);
  runtime::Logger log("test", "test");
  runtime::Registry metrics;
  const std::string endpoint = "ipc:///tmp/moeline-oldhub-" + std::to_string(::getpid()) + ".sock";
  zmq::socket_t old_hub(context, zmq::socket_type::router);
  old_hub.set(zmq::sockopt::linger, 0);
  old_hub.bind(endpoint);
  runtime::LinkSettings settings;
  settings.hub = endpoint;
  settings.stage = wire::StageKind::Decode;
  settings.replica = "decode-0";
  settings.settings_hash = 42;
  runtime::HubLink link(context, settings, log, metrics);
  // What the old hub receives from the link's main connection (heartbeats come on another).
  auto next = [&]() -> std::optional<wire::Message> {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < until) {
      auto frames = wire::receive(old_hub, true);
      if (!frames) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      const std::string from = frames->front().to_string();
      frames->erase(frames->begin());
      if (from != link.identity()) continue;
      wire::Decoded decoded = wire::decode(std::move(*frames));  // 1.13: no credit in envelopes
      EXPECT_FALSE(decoded.error.has_value()) << decoded.error->detail;
      return std::move(decoded.message);
    }
    return std::nullopt;
  };
  link.hello(1);
  ASSERT_EQ(next()->type, wire::MessageType::Hello);
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(wire::CreateHelloReplyDirect(builder, true, "", 42), wire::HelloIdentifier());
  const std::string identity = link.identity();
  wire::send(old_hub,
             wire::encode_with_version(wire::MessageType::HelloReply, builder, wire::kSchemaMajor,
                                       wire::kEnvelopeCreditsMinor - 1),
             &identity);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!link.accepted() && std::chrono::steady_clock::now() < until) link.receive(20);
  ASSERT_TRUE(link.accepted());
  link.grant(2);
  ASSERT_TRUE(link.send(empty_token_batch()));
  auto batch = next();
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(batch->type, wire::MessageType::TokenBatch);
  auto credit = next();
  ASSERT_TRUE(credit.has_value());
  ASSERT_EQ(credit->type, wire::MessageType::Credit);
  EXPECT_EQ(credit->as<wire::Credit>()->credits(), 2u);
}

TEST_F(HubAndLinks, AStageBusyLongerThanThePeerTimeoutDoesNotThinkTheHubSilent) {
  auto decode = link("decode-0");
  say_hello(*decode);
  // A forward pass twice the timeout: the hub's heartbeats wait in the socket meanwhile.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  decode->receive(0);
  EXPECT_FALSE(decode->needs_hello());
}

}  // namespace
}  // namespace moeline
