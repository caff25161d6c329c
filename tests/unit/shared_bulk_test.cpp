// Bulk frames through shared memory on one node (stages/runtime/shared_bulk.h): a transfer arrives
// whole and aligned and leaves nothing behind; a sender of another node, a small transfer or a
// full folder keeps to the socket; and a reference that does not hold (a name outside the
// folder, a link, a wrong size, a count that overflows) is refused without the intake stopping.
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
  // The name in a reference frame, as a file of the folder.
  std::string file_named_by(const zmq::message_t& reference) const {
    return (folder_ / (std::string(static_cast<const char*>(reference.data()) + 8, 32) + ".bulk"))
        .string();
  }

  fs::path folder_;
  runtime::SharedBulkSettings settings_;
  runtime::Registry metrics_;
};

TEST_F(SharedBulkTest, ATransferArrivesWholeAlignedAndLeavesNothingBehind) {
  auto sender = open();
  auto receiver = open();
  ASSERT_TRUE(sender && receiver);
  EXPECT_EQ(sender->node(), receiver->node());
  EXPECT_EQ(sender->node().size(), 32u);
  EXPECT_EQ(fs::status(folder_).permissions() & fs::perms::all, fs::perms::owner_all);

  std::vector<zmq::message_t> frames = message({100000, 7, 70001, 0});
  const std::vector<std::string> original = bytes_of(frames);
  const auto name = sender->export_frames(receiver->node(), frames);
  ASSERT_TRUE(name);
  ASSERT_EQ(frames.size(), 3u);  // header (flagged), body, the reference
  EXPECT_TRUE(runtime::has_shared_bulk_flag(frames));
  EXPECT_EQ(files(), 1u);
  EXPECT_EQ(fs::status(folder_ / *name).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);

  ASSERT_TRUE(receiver->import_frames(frames, size_t{1} << 30).ok());
  EXPECT_EQ(files(), 0u) << "the receiver unlinks the file as soon as it has it";
  EXPECT_FALSE(runtime::has_shared_bulk_flag(frames));
  EXPECT_EQ(bytes_of(frames), original);
  for (size_t i = 2; i < frames.size(); ++i) {
    if (frames[i].size() == 0) continue;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(frames[i].data()) % 64, 0u) << "frame " << i;
  }
  // What the receiver hands on is an ordinary message again.
  wire::Decoded decoded = wire::decode(std::move(frames));
  ASSERT_TRUE(decoded.message) << decoded.error->detail;
  EXPECT_EQ(decoded.message->bulk.size(), 4u);
  EXPECT_EQ(counter("moeline_shm_handover_total", "sent"), 1);
  EXPECT_EQ(counter("moeline_shm_handover_total", "received"), 1);
  EXPECT_EQ(counter("moeline_shm_handover_bytes_total", "received"), 170008);
}

TEST_F(SharedBulkTest, OtherNodesSmallTransfersAndAFullFolderKeepToTheSocket) {
  auto sender = open();
  ASSERT_TRUE(sender);
  std::vector<zmq::message_t> frames = message({100000});
  const std::vector<std::string> original = bytes_of(frames);
  EXPECT_FALSE(sender->export_frames("", frames));
  EXPECT_FALSE(sender->export_frames(std::string(32, '0'), frames));
  std::vector<zmq::message_t> small = message({4095});
  EXPECT_FALSE(sender->export_frames(sender->node(), small));
  EXPECT_EQ(bytes_of(frames), original);
  EXPECT_EQ(files(), 0u);

  // The folder gone (as a full /dev/shm, the write fails): the frames stay as they were, counted.
  fs::remove_all(folder_);
  EXPECT_FALSE(sender->export_frames(sender->node(), frames));
  EXPECT_EQ(bytes_of(frames), original);
  EXPECT_EQ(counter("moeline_shm_handover_write_failures_total"), 1);
}

TEST_F(SharedBulkTest, AReferenceThatDoesNotHoldIsRefused) {
  auto sender = open();
  auto receiver = open();
  ASSERT_TRUE(sender && receiver);
  auto exported = [&](std::vector<size_t> sizes) {
    std::vector<zmq::message_t> frames = message(sizes);
    EXPECT_TRUE(sender->export_frames(sender->node(), frames));
    return frames;
  };
  auto patched = [](std::vector<zmq::message_t>& frames, size_t at, const void* bytes, size_t n) {
    zmq::message_t copy(frames[2].data(), frames[2].size());
    std::memcpy(static_cast<uint8_t*>(copy.data()) + at, bytes, n);
    frames[2] = std::move(copy);
  };

  {  // A name that leaves the folder.
    auto frames = exported({8192});
    patched(frames, 8, "../../../../../../../../etc/passw", 32);
    EXPECT_FALSE(receiver->import_frames(frames, 1 << 20).ok());
  }
  {  // A link in the folder, named as a transfer is, to a file elsewhere.
    auto frames = exported({8192});
    const std::string file = file_named_by(frames[2]);
    const fs::path elsewhere = folder_.string() + "-elsewhere";
    { std::ofstream(elsewhere) << std::string(8192, 'x'); }
    fs::remove(file);
    fs::create_symlink(elsewhere, file);
    EXPECT_FALSE(receiver->import_frames(frames, 1 << 20).ok());
    fs::remove(elsewhere);
  }
  {  // Sizes that do not match the file.
    auto frames = exported({8192});
    const uint64_t bigger = 8193;
    patched(frames, 48, &bigger, 8);
    EXPECT_FALSE(receiver->import_frames(frames, 1 << 20).ok());
  }
  {  // A count that overflows the frame, and bulk over the receiver's limit.
    auto frames = exported({8192});
    const uint64_t huge = ~uint64_t{0} / 4;
    patched(frames, 40, &huge, 8);
    EXPECT_FALSE(receiver->import_frames(frames, 1 << 20).ok());
    auto big = exported({8192});
    EXPECT_EQ(receiver->import_frames(big, 4096).code(), StatusCode::kResourceExhausted);
  }
  {  // A file already taken (a replay of the same reference).
    auto frames = exported({8192});
    std::vector<zmq::message_t> replay;
    for (auto& f : frames) replay.emplace_back(f.data(), f.size());
    EXPECT_TRUE(receiver->import_frames(frames, 1 << 20).ok());
    EXPECT_EQ(receiver->import_frames(replay, 1 << 20).code(), StatusCode::kNotFound);
  }
  receiver->sweep(true);
}

TEST_F(SharedBulkTest, ASweepRemovesOnlyTransfersNobodyTookForLong) {
  settings_.stale_after = std::chrono::seconds(60);
  auto sender = open();
  ASSERT_TRUE(sender);
  std::vector<zmq::message_t> stale = message({8192}), fresh = message({8192});
  ASSERT_TRUE(sender->export_frames(sender->node(), stale));
  ASSERT_TRUE(sender->export_frames(sender->node(), fresh));
  const std::string stale_file = file_named_by(stale[2]);
  const timespec old[2] = {{::time(nullptr) - 600, 0}, {::time(nullptr) - 600, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, stale_file.c_str(), old, 0), 0);
  { std::ofstream(folder_ / "not-a-transfer") << "kept"; }
  sender->sweep(true);
  EXPECT_FALSE(fs::exists(stale_file));
  EXPECT_TRUE(fs::exists(file_named_by(fresh[2])));
  EXPECT_TRUE(fs::exists(folder_ / "not-a-transfer"));
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
  EXPECT_EQ(files(), 0u);

  // A stranger's flagged message to an intake without shared memory, then a good one.
  auto flagged = message({8192});
  auto bulk = runtime::SharedBulk::open(settings_, metrics_);
  ASSERT_TRUE(bulk);
  ASSERT_TRUE((*bulk)->export_frames((*bulk)->node(), flagged));
  zmq::socket_t stranger(context, zmq::socket_type::dealer);
  stranger.set(zmq::sockopt::linger, 0);
  stranger.connect(plain.endpoint());
  ASSERT_TRUE(wire::send(stranger, std::move(flagged)));
  ASSERT_TRUE(sender.send({plain.endpoint(), "", plain.node()}, message({100})));
  auto next = receive(plain);
  ASSERT_TRUE(next);
  EXPECT_EQ(next->bulk.size(), 1u);
  EXPECT_EQ(next->bulk[0].size(), 100u);
  EXPECT_GE(metrics_
                .counter("moeline_wire_rejected_frames_total", "",
                         {{"peer", "intake"}, {"reason", "shared_bulk"}})
                .value(),
            1);
}

}  // namespace
}  // namespace moeline
