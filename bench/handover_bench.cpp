// moeline_handover_bench: what one peer-to-peer transfer (a prompt's KV, a snapshot put) costs by
// the way it travels — an intake's socket over tcp:// (with and without CurveZMQ) or ipc://, or
// shared memory on one node (stages/runtime/shared_bulk.h) with the body over tcp:// — for bulk
// sizes from a few pages to tens of MiB. A sender (PeerSender) and a receiving Intake in two
// ZeroMQ contexts (two I/O threads, as two processes have); the receiver checks each bulk frame's
// xxHash as a stage does (wire::check_bulk), then the sender sends the next. Printed as one JSON
// object: per mode and size, the wall time and the CPU time (all threads) per transfer.
//
//   moeline_handover_bench [--sizes 4096,65536,262144,1048576,4194304,16777216]
//                          [--modes tcp,tcp+curve,ipc,shm,shm+curve] [--bytes 268435456]
//                          [--repeat 3]   (the run of median wall time is reported)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "schemas/wire.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/security.h"

namespace {

using namespace moeline;

template <class T>
std::vector<T> parse_list(const std::string& text) {
  std::vector<T> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if constexpr (std::is_same_v<T, std::string>)
      out.push_back(item);
    else
      out.push_back(static_cast<T>(std::stoull(item)));
  }
  return out;
}
using Clock = std::chrono::steady_clock;

double cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

std::vector<zmq::message_t> transfer(size_t bytes) {
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(wire::CreateCredit(builder, 1), wire::HelloIdentifier());
  std::vector<zmq::message_t> bulk;
  zmq::message_t frame(bytes);
  std::memset(frame.data(), 0x5a, bytes);
  bulk.push_back(std::move(frame));
  return wire::encode(wire::MessageType::Credit, builder, std::move(bulk));
}

nlohmann::json run(const std::string& mode, size_t bytes, size_t total_bytes,
                   const std::string& shm_folder) {
  const bool curve = mode.find("curve") != std::string::npos;
  const bool shm = mode.rfind("shm", 0) == 0;
  const bool ipc = mode == "ipc";
  runtime::Logger log("bench", "bench");
  runtime::Registry metrics;
  zmq::context_t receiver_context(1), sender_context(1);
  std::unique_ptr<runtime::ZapHandler> zap;
  runtime::IntakeSettings settings;
  settings.bind = ipc ? "ipc://" + (std::filesystem::temp_directory_path() /
                                    ("moeline-handover-bench-" + std::to_string(::getpid())))
                                       .string()
                      : "tcp://127.0.0.1:*";
  settings.shared_bulk.enabled = shm;
  settings.shared_bulk.folder = shm_folder;
  settings.shared_bulk.min_bytes = 0;
  std::optional<runtime::CurveKeyPair> client_keys;
  if (curve) {
    zap = std::make_unique<runtime::ZapHandler>(receiver_context, log, metrics);
    settings.curve_keys = runtime::generate_curve_keypair();
    client_keys = runtime::generate_curve_keypair();
  }
  runtime::Intake intake(receiver_context, settings, log, metrics, zap.get());
  runtime::PeerSender sender(sender_context, client_keys, settings.shared_bulk, metrics, log);
  const runtime::PeerAddress to{intake.endpoint(), intake.public_key(), intake.node()};

  std::atomic<size_t> received{0};
  std::atomic<uint64_t> checksums{0};  // kept, so that the checks are not optimised away
  std::atomic<bool> stop{false};
  std::thread receiver([&] {
    while (!stop) {
      zmq::pollitem_t item{intake.socket().handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(20));
      while (auto message = intake.receive()) {
        uint64_t sum = 0;
        for (const auto& frame : message->bulk) sum ^= wire::checksum(frame.bytes());
        checksums.fetch_xor(sum);
        received.fetch_add(1);
      }
    }
  });
  auto one = [&](size_t n) {
    // Refused only while the connection comes up (no pipe yet): try again.
    for (int tries = 0; !sender.send(to, transfer(bytes)); ++tries) {
      if (tries == 5000) throw std::runtime_error(mode + ": the intake takes no transfer");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    while (received.load() < n) std::this_thread::yield();
  };
  for (size_t i = 1; i <= 3; ++i) one(i);  // connection and handshake
  const size_t count = std::clamp<size_t>(total_bytes / std::max<size_t>(bytes, 1), 20, 2000);
  const double cpu_before = cpu_seconds();
  const auto wall_before = Clock::now();
  for (size_t i = 0; i < count; ++i) one(4 + i);
  const double wall = std::chrono::duration<double>(Clock::now() - wall_before).count();
  const double cpu = cpu_seconds() - cpu_before;
  stop = true;
  receiver.join();
  // The sender's and receiver's threads spin while they wait for each other; what the transfer
  // itself costs is in the wall time, which on two busy cores is also what it takes from others.
  return {{"mode", mode},
          {"bytes", bytes},
          {"transfers", count},
          {"wall_us_per_transfer", wall / static_cast<double>(count) * 1e6},
          {"cpu_us_per_transfer", cpu / static_cast<double>(count) * 1e6},
          {"gb_per_s", static_cast<double>(bytes) * static_cast<double>(count) / wall / 1e9},
          {"checksums", checksums.load()}};
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {
      {"--sizes", "4096,65536,262144,1048576,4194304,16777216"},
      {"--modes", "tcp,tcp+curve,ipc,shm,shm+curve"},
      {"--bytes", "268435456"},
      {"--repeat", "3"}};
  for (int i = 1; i < argc; i += 2) {
    if (!flags.count(argv[i]) || i + 1 >= argc) {
      std::cerr << "usage: moeline_handover_bench [--sizes N,...] [--modes M,...] [--bytes N] "
                   "[--repeat N]\n";
      return 2;
    }
    flags[argv[i]] = argv[i + 1];
  }
  const std::string folder =
      ((std::filesystem::exists("/dev/shm") ? std::filesystem::path("/dev/shm")
                                            : std::filesystem::temp_directory_path()) /
       ("moeline-handover-bench-" + std::to_string(::getpid())))
          .string();
  nlohmann::json results = nlohmann::json::array();
  for (const std::string& mode : parse_list<std::string>(flags["--modes"]))
    for (const size_t bytes : parse_list<size_t>(flags["--sizes"])) {
      // The median of --repeat runs (each with its own sockets and arena): a 2-core VM's
      // neighbours move single runs by 2x.
      std::vector<nlohmann::json> runs;
      for (int r = 0; r < std::stoi(flags["--repeat"]); ++r)
        runs.push_back(run(mode, bytes, std::stoull(flags["--bytes"]), folder));
      std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) {
        return a["wall_us_per_transfer"].template get<double>() <
               b["wall_us_per_transfer"].template get<double>();
      });
      results.push_back(runs[runs.size() / 2]);
      results.back()["repeats"] = runs.size();
      std::cerr << results.back().dump() << "\n";
    }
  std::filesystem::remove_all(folder);
  std::cout << nlohmann::json{{"handover", results}}.dump() << "\n";
}
