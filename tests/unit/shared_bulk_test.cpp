// Bulk frames through shared memory on one node (stages/runtime/shared_bulk.h): a transfer arrives
// whole, once, and its space is reused; a sender of another node, a small transfer or one without
// room keeps to the socket; a reference that does not hold (a name outside the folder, a link, a
// slot, generation, offset or count that is not the transfer's) is refused without the intake
// stopping; stale slots and the arenas of dead senders are reclaimed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "schemas/wire.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/shared_bulk.h"

namespace moeline {
namespace {

namespace fs = std::filesystem;

class SharedBulkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    folder_ = fs::temp_directory_path() /
              ("moeline-shm-test-" + std::to_string(::getpid()) + "-" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(folder_);
    settings_.folder = folder_.string();
    settings_.min_bytes = 4096;
  }
  void TearDown() override { fs::remove_all(folder_); }

  std::unique_ptr<runtime::SharedBulk> open() {
    auto bulk = runtime::SharedBulk::open(settings_, metrics_);
    if (!bulk) ADD_FAILURE() << bulk.error().message;
    return bulk ? std::move(*bulk) : nullptr;
  }
  // A real message (a Credit) with bulk frames of these sizes, each byte a function of its place.
  static std::vector<zmq::message_t> message(const std::vector<size_t>& sizes) {
    flatbuffers::FlatBufferBuilder builder;
    builder.Finish(wire::CreateCredit(builder, 3), wire::HelloIdentifier());
    std::vector<zmq::message_t> bulk;
    for (size_t f = 0; f < sizes.size(); ++f) {
      zmq::message_t frame(sizes[f]);
      auto* p = static_cast<uint8_t*>(frame.data());
      for (size_t i = 0; i < sizes[f]; ++i) p[i] = static_cast<uint8_t>(i * 31 + f * 7 + 1);
      bulk.push_back(std::move(frame));
    }
    return wire::encode(wire::MessageType::Credit, builder, std::move(bulk));
  }
  static std::vector<std::string> bytes_of(const std::vector<zmq::message_t>& frames) {
    std::vector<std::string> out;
    for (const auto& f : frames) out.emplace_back(static_cast<const char*>(f.data()), f.size());
    return out;
  }
  size_t files() const {
    size_t n = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(folder_)) ++n;
    return n;
  }
  double counter(const std::string& name, const std::string& direction = "") {
    runtime::Labels labels;
    if (!direction.empty()) labels = {{"direction", direction}};
    return metrics_.counter(name, "", labels).value();
  }
  // The arena a reference frame names, as a file of the folder.
  std::string arena_named_by(const zmq::message_t& reference) const {
    const char* name = static_cast<const char*>(reference.data()) + 8;
    return (folder_ / std::string(name, strnlen(name, 64))).string();
  }
  // A copy of `frames` whose reference frame has `n` bytes at `at` replaced.
  static std::vector<zmq::message_t> patched(const std::vector<zmq::message_t>& frames, size_t at,
                                             const void* bytes, size_t n) {
    std::vector<zmq::message_t> copy;
    for (const auto& f : frames) copy.emplace_back(f.data(), f.size());
    std::memcpy(static_cast<uint8_t*>(copy[2].data()) + at, bytes, n);
    return copy;
  }
  static std::vector<zmq::message_t> copied(const std::vector<zmq::message_t>& frames) {
    std::vector<zmq::message_t> copy;
    for (const auto& f : frames) copy.emplace_back(f.data(), f.size());
    return copy;
  }

  fs::path folder_;
  runtime::SharedBulkSettings settings_;
  runtime::Registry metrics_;
};

// Reference frame layout (shared_bulk.cpp): magic 8, name 64, slot 4, reserved 4, generation 8,
// offset 8, count 8, then the sizes.
constexpr size_t kNameAt = 8, kSlotAt = 72, kGenerationAt = 80, kOffsetAt = 88, kCountAt = 96,
                 kSizesAt = 104;

TEST_F(SharedBulkTest, ATransferArrivesWholeAndItsSpaceIsReused) {
  auto sender = open();
  auto receiver = open();
  ASSERT_TRUE(sender && receiver);
  EXPECT_EQ(sender->node(), receiver->node());
  EXPECT_EQ(sender->node().size(), 32u);
  EXPECT_EQ(fs::status(folder_).permissions() & fs::perms::all, fs::perms::owner_all);

  std::vector<zmq::message_t> frames = message({100000, 7, 70001, 0});
  const std::vector<std::string> original = bytes_of(frames);
  ASSERT_TRUE(sender->export_frames(receiver->node(), frames));
  ASSERT_EQ(frames.size(), 3u);  // header (flagged), body, the reference
  EXPECT_TRUE(runtime::has_shared_bulk_flag(frames));
  EXPECT_EQ(files(), 1u);  // the sender's arena
  const std::string arena = arena_named_by(frames[2]);
  EXPECT_EQ(fs::status(arena).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  const size_t first = sender->arena_in_use();
  EXPECT_GE(first, 170008u);

  std::vector<zmq::message_t> replay = copied(frames);
  ASSERT_TRUE(receiver->import_frames(frames, size_t{1} << 30).ok());
  EXPECT_FALSE(runtime::has_shared_bulk_flag(frames));
  EXPECT_EQ(bytes_of(frames), original);
  for (size_t i = 2; i < frames.size(); ++i) {
    if (frames[i].size() == 0) continue;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(frames[i].data()) % 8, 0u) << "frame " << i;
  }
  // What the receiver hands on is an ordinary message again.
  wire::Decoded decoded = wire::decode(std::move(frames));
  ASSERT_TRUE(decoded.message) << decoded.error->detail;
  EXPECT_EQ(decoded.message->bulk.size(), 4u);
  // Taken once only.
  EXPECT_EQ(receiver->import_frames(replay, size_t{1} << 30).code(), StatusCode::kNotFound);

  // The slot the receiver marked done is the sender's again: the next transfer takes its place.
  std::vector<zmq::message_t> next = message({100000});
  ASSERT_TRUE(sender->export_frames(receiver->node(), next));
  EXPECT_LT(sender->arena_in_use(), first);
  EXPECT_EQ(receiver->import_frames(next, size_t{1} << 30).code(), StatusCode::kOk);
  EXPECT_EQ(counter("moeline_shm_handover_total", "sent"), 2);
  EXPECT_EQ(counter("moeline_shm_handover_total", "received"), 2);
  EXPECT_EQ(counter("moeline_shm_handover_bytes_total", "received"), 270008);
  // A sender that closes with nothing in flight takes its arena with it.
  sender.reset();
  EXPECT_EQ(files(), 0u);
}

TEST_F(SharedBulkTest, OtherNodesSmallTransfersAndNoRoomKeepToTheSocket) {
  settings_.arena_bytes = 256 << 10;
  auto sender = open();
  ASSERT_TRUE(sender);
  std::vector<zmq::message_t> frames = message({200000});
  const std::vector<std::string> original = bytes_of(frames);
  EXPECT_FALSE(sender->export_frames("", frames));
  EXPECT_FALSE(sender->export_frames(std::string(32, '0'), frames));
  std::vector<zmq::message_t> small = message({4095});
  EXPECT_FALSE(sender->export_frames(sender->node(), small));
  EXPECT_EQ(bytes_of(frames), original);
  // One fits; a second while the first is unread does not (the arena is 256 KiB), nor one larger
  // than the arena: they stay as they were, counted.
  std::vector<zmq::message_t> first = message({200000});
  ASSERT_TRUE(sender->export_frames(sender->node(), first));
  EXPECT_FALSE(sender->export_frames(sender->node(), frames));
  std::vector<zmq::message_t> huge = message({300000});
  EXPECT_FALSE(sender->export_frames(sender->node(), huge));
  EXPECT_EQ(bytes_of(frames), original);
  EXPECT_EQ(counter("moeline_shm_handover_no_room_total"), 2);
  // Not sent after all: its space is free again.
  sender->discard(0);
  EXPECT_EQ(sender->arena_in_use(), 0u);
  EXPECT_TRUE(sender->export_frames(sender->node(), frames));

  // A folder that is gone before the first transfer: no arena, the socket.
  auto late = open();
  ASSERT_TRUE(late);
  fs::remove_all(folder_);
  std::vector<zmq::message_t> more = message({8192});
  EXPECT_FALSE(late->export_frames(late->node(), more));
  EXPECT_EQ(counter("moeline_shm_handover_no_room_total"), 3);
}

TEST_F(SharedBulkTest, AReferenceThatDoesNotHoldIsRefused) {
  auto sender = open();
  auto receiver = open();
  ASSERT_TRUE(sender && receiver);
  std::vector<zmq::message_t> frames = message({8192});
  ASSERT_TRUE(sender->export_frames(sender->node(), frames));
  auto refused = [&](std::vector<zmq::message_t> bad) {
    return !receiver->import_frames(bad, 1 << 20).ok();
  };
  char name[64] = "../../../../../../../../etc/passwd";
  EXPECT_TRUE(refused(patched(frames, kNameAt, name, sizeof name)));
  const uint32_t slot = 5000;
  EXPECT_TRUE(refused(patched(frames, kSlotAt, &slot, 4)));
  const uint64_t generation = 77, far = uint64_t{1} << 40, huge = ~uint64_t{0} / 4;
  EXPECT_TRUE(refused(patched(frames, kGenerationAt, &generation, 8)));
  EXPECT_TRUE(refused(patched(frames, kOffsetAt, &far, 8)));
  EXPECT_TRUE(refused(patched(frames, kCountAt, &huge, 8)));
  EXPECT_TRUE(refused(patched(frames, kSizesAt, &far, 8)));
  EXPECT_EQ(receiver->import_frames(frames, 4096).code(), StatusCode::kResourceExhausted);
  // None of that took the transfer: the reference itself still holds.
  EXPECT_TRUE(receiver->import_frames(frames, 1 << 20).ok());

  // A link in the folder, named as an arena is, to a file elsewhere: never opened.
  auto other_receiver = open();
  std::vector<zmq::message_t> more = message({8192});
  ASSERT_TRUE(sender->export_frames(sender->node(), more));
  const fs::path arena = arena_named_by(more[2]);
  const fs::path moved = folder_.string() + "-moved";
  fs::rename(arena, moved);
  fs::create_symlink(moved, arena);
  EXPECT_FALSE(other_receiver->import_frames(more, 1 << 20).ok());
  fs::remove(arena);
  fs::remove(moved);
}

TEST_F(SharedBulkTest, AStaleSlotIsReclaimedAndItsLateReaderRefused) {
  settings_.stale_after = std::chrono::seconds(0);
  auto sender = open();
  auto receiver = open();
  ASSERT_TRUE(sender && receiver);
  std::vector<zmq::message_t> unread = message({8192});
  ASSERT_TRUE(sender->export_frames(sender->node(), unread));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::vector<zmq::message_t> next = message({8192});
  ASSERT_TRUE(sender->export_frames(sender->node(), next));  // reclaims the unread one
  EXPECT_EQ(receiver->import_frames(unread, 1 << 20).code(), StatusCode::kNotFound);
  EXPECT_TRUE(receiver->import_frames(next, 1 << 20).ok());
}

TEST_F(SharedBulkTest, ASweepRemovesOnlyTheArenasOfSendersThatAreGone) {
  auto receiver = open();
  ASSERT_TRUE(receiver);
  { std::ofstream(folder_ / "999999999-0123456789abcdef.arena") << "dead sender"; }
  { std::ofstream(folder_ / "1-0123456789abcdef.arena") << "init lives"; }
  { std::ofstream(folder_ / "not-an-arena") << "kept"; }
  receiver->sweep(true);
  EXPECT_FALSE(fs::exists(folder_ / "999999999-0123456789abcdef.arena"));
  EXPECT_TRUE(fs::exists(folder_ / "1-0123456789abcdef.arena"));
  EXPECT_TRUE(fs::exists(folder_ / "not-an-arena"));
  EXPECT_EQ(counter("moeline_shm_handover_swept_total"), 1);
}

TEST_F(SharedBulkTest, AFolderOthersMayWriteIsNotUsed) {
  fs::create_directories(folder_);
  fs::permissions(folder_, fs::perms::owner_all | fs::perms::others_write);
  auto bulk = runtime::SharedBulk::open(settings_, metrics_);
  EXPECT_FALSE(bulk);
  settings_.enabled = false;
  EXPECT_FALSE(runtime::SharedBulk::open(settings_, metrics_));
}

// The transfer through a real intake and sender (tcp://, as between stages): the bulk takes the
// shared folder; a flagged message to an intake that offers no shared memory, or with a
// reference that does not hold, is refused and the intake goes on taking messages.
TEST_F(SharedBulkTest, ThroughAnIntakeAndAPeerSender) {
  zmq::context_t context(1);
  runtime::Logger log("test", "test");
  runtime::IntakeSettings with_shm;
  with_shm.bind = "tcp://127.0.0.1:*";
  with_shm.shared_bulk = settings_;
  runtime::Intake intake(context, with_shm, log, metrics_, nullptr);
  ASSERT_FALSE(intake.node().empty());
  runtime::IntakeSettings without_shm = with_shm;
  without_shm.shared_bulk.enabled = false;
  runtime::Intake plain(context, without_shm, log, metrics_, nullptr);
  EXPECT_TRUE(plain.node().empty());

  runtime::PeerSender sender(context, std::nullopt, settings_, metrics_, log);
  auto receive = [](runtime::Intake& at) {
    for (int i = 0; i < 500; ++i) {
      if (auto m = at.receive()) return m;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return std::optional<wire::Message>();
  };
  std::vector<zmq::message_t> frames = message({200000});
  const std::vector<std::string> original = bytes_of(frames);
  ASSERT_TRUE(sender.send({intake.endpoint(), "", intake.node()}, std::move(frames)));
  auto received = receive(intake);
  ASSERT_TRUE(received);
  ASSERT_EQ(received->bulk.size(), 1u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(received->bulk[0].data()),
                        received->bulk[0].size()),
            original[2]);
  EXPECT_EQ(counter("moeline_shm_handover_total", "received"), 1);

  // A stranger's flagged message to an intake without shared memory, then a good one.
  auto flagged = message({8192});
  auto bulk = runtime::SharedBulk::open(settings_, metrics_);
  ASSERT_TRUE(bulk);
  ASSERT_TRUE((*bulk)->export_frames((*bulk)->node(), flagged));
  EXPECT_EQ(files(), 2u);  // the sender's arena and this one
  zmq::socket_t stranger(context, zmq::socket_type::dealer);
  stranger.set(zmq::sockopt::linger, 0);
  stranger.connect(plain.endpoint());
  ASSERT_TRUE(wire::send(stranger, std::move(flagged)));
  ASSERT_TRUE(sender.send({plain.endpoint(), "", plain.node()}, message({100})));
  auto next = receive(plain);
  ASSERT_TRUE(next);
  EXPECT_EQ(next->bulk.size(), 1u);
  EXPECT_EQ(next->bulk[0].size(), 100u);
  // The two came on two connections, so the good one may be read first: the refusal is counted
  // once the intake has read the stranger's too.
  auto rejected = [&] {
    return metrics_
        .counter("moeline_wire_rejected_frames_total", "",
                 {{"peer", "intake"}, {"reason", "shared_bulk"}})
        .value();
  };
  for (int i = 0; i < 500 && rejected() < 1; ++i) {
    EXPECT_FALSE(plain.receive()) << "the stranger's flagged message was taken";
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(rejected(), 1);
}

}  // namespace
}  // namespace moeline
