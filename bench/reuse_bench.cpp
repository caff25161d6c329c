// moeline_reuse_bench: the snapshot store's eviction policies on a synthetic prompt trace, and its
// RocksDB disk tier's throughput next to plain files, printed as one JSON object.
//
//   moeline_reuse_bench [--blocks 2000] [--block-kib 96] [--dir DIR] [--requests 2000]
//                       [--sustained-mib 0] [--sustained-budget-mib 1024]
//
// (a) Policy: 20 "system prompts" of 32 blocks drawn by Zipf (s = 1.1), each followed by a unique
// user suffix of 2-8 blocks, interleaved with bursts of one-off 64-block prompts (scans, ~30% of
// requests). Each request looks its blocks up in order and stops at the first miss (prefix
// semantics), then puts the blocks it had to compute. Hit rate = blocks found / blocks requested
// (the fraction of prompt tokens reused). RAM budgets are fractions of the working set (the
// system prompts' blocks); no disk tier.
// (b) Disk: N blocks written through the store's disk tier (a 1-byte RAM tier: every put spills),
// read back with get() after reopening (cold RAM tier), against one file per block written and
// read with POSIX calls. Neither side syncs or drops the page cache.
// (c) Sustained (with --sustained-mib N): N MiB of 192 KiB values (a 32-token prompt's KV on the
// demo model) spilled through a disk tier of --sustained-budget-mib with the probe's default
// reserve, as a probe under load spills them; per 256 MiB written, the CPU the process spent
// (RocksDB's background compactions included), the wall time, and the tier's size on disk. A
// store whose cost per spill grows with what it holds shows here, long before a stage runs
// for days.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "reuse/snapshot_store.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using moeline::reuse::EvictionPolicy;
using moeline::reuse::SnapshotStore;
using moeline::reuse::StoreOptions;

std::unique_ptr<SnapshotStore> opened_store(StoreOptions options) {
  auto store = SnapshotStore::open(std::move(options));
  if (!store) throw std::runtime_error(store.error().message);
  return std::move(*store);
}

constexpr int kSystemPrompts = 20;
constexpr int kSystemBlocks = 32;
constexpr int kScanBlocks = 64;
constexpr double kZipfS = 1.1;

struct Flags {
  int64_t blocks = 2000;
  int64_t block_kib = 96;
  int64_t requests = 2000;
  int64_t sustained_mib = 0;
  int64_t sustained_budget_mib = 1024;
  std::string dir;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "moeline_reuse_bench: " << problem
            << "\nusage: moeline_reuse_bench [--blocks N] [--block-kib K] [--dir DIR] "
               "[--requests R] [--sustained-mib N] [--sustained-budget-mib B]\n";
  std::exit(2);
}

Flags parse_flags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (i + 1 >= argc) usage("missing value for " + name);
    const std::string value = argv[++i];
    try {
      if (name == "--blocks")
        flags.blocks = std::stoll(value);
      else if (name == "--block-kib")
        flags.block_kib = std::stoll(value);
      else if (name == "--requests")
        flags.requests = std::stoll(value);
      else if (name == "--sustained-mib")
        flags.sustained_mib = std::stoll(value);
      else if (name == "--sustained-budget-mib")
        flags.sustained_budget_mib = std::stoll(value);
      else if (name == "--dir")
        flags.dir = value;
      else
        usage("unknown flag " + name);
    } catch (const std::logic_error&) {
      usage("bad value for " + name + ": " + value);
    }
  }
  if (flags.blocks <= 0 || flags.block_kib <= 0 || flags.requests <= 0 || flags.sustained_mib < 0 ||
      flags.sustained_budget_mib <= 0)
    usage("--blocks, --block-kib, --requests and --sustained-budget-mib must be positive");
  return flags;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

uint64_t mix(uint64_t x) {  // splitmix64: distinct synthetic block keys
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// --- (a) eviction policy ---------------------------------------------------------------------

struct Trace {
  std::vector<std::vector<uint64_t>> requests;  // block keys, in prompt order
  int64_t scans = 0;
};

Trace make_trace(int64_t requests, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weights(kSystemPrompts);
  for (int k = 0; k < kSystemPrompts; ++k) weights[k] = 1.0 / std::pow(k + 1, kZipfS);
  std::discrete_distribution<int> system_prompt(weights.begin(), weights.end());
  std::uniform_int_distribution<int> suffix_blocks(2, 8);
  // Bursts: runs of 10-36 ordinary requests (mean 23), then 5-15 scans (mean 10): ~30% scans.
  std::uniform_int_distribution<int> run_length(10, 36), burst_length(5, 15);
  uint64_t next_unique = 1;
  auto unique_key = [&] { return mix((uint64_t{1} << 62) + next_unique++); };

  Trace trace;
  while (static_cast<int64_t>(trace.requests.size()) < requests) {
    for (int r = run_length(rng); r > 0; --r) {
      const int p = system_prompt(rng);
      std::vector<uint64_t> blocks;
      for (int b = 0; b < kSystemBlocks; ++b)
        blocks.push_back(mix(static_cast<uint64_t>(p) * 1000 + static_cast<uint64_t>(b)));
      for (int b = suffix_blocks(rng); b > 0; --b) blocks.push_back(unique_key());
      trace.requests.push_back(std::move(blocks));
    }
    for (int r = burst_length(rng); r > 0; --r) {
      std::vector<uint64_t> blocks(kScanBlocks);
      for (uint64_t& key : blocks) key = unique_key();
      trace.requests.push_back(std::move(blocks));
      ++trace.scans;
    }
  }
  return trace;
}

struct Replay {
  uint64_t found = 0, requested = 0;
  double seconds = 0;
};

Replay replay(const Trace& trace, EvictionPolicy policy, uint64_t ram_bytes, size_t block_bytes) {
  StoreOptions options;
  options.ram_bytes = ram_bytes;
  options.disk_path.clear();
  options.policy = policy;
  auto store_opened = opened_store(options);
  SnapshotStore& store = *store_opened;
  Replay result;
  const auto start = Clock::now();
  for (const auto& blocks : trace.requests) {
    size_t b = 0;
    while (b < blocks.size() && store.get(blocks[b])) ++b;
    result.found += b;
    result.requested += blocks.size();
    for (; b < blocks.size(); ++b)
      if (!store.contains(blocks[b]))
        store.put(blocks[b], std::string(block_bytes, static_cast<char>(blocks[b])));
  }
  result.seconds = seconds_since(start);
  return result;
}

nlohmann::json policy_section(const Flags& flags) {
  const Trace trace = make_trace(flags.requests, 20240611);
  const size_t block_bytes = static_cast<size_t>(flags.block_kib) * 1024;
  const uint64_t working_set_blocks = kSystemPrompts * kSystemBlocks;
  // The bound any policy could reach: every block seen before is found (an unbounded RAM tier).
  const Replay unbounded =
      replay(trace, EvictionPolicy::kLru, std::numeric_limits<uint64_t>::max(), 1);
  nlohmann::json rows = nlohmann::json::array();
  for (double fraction : {0.25, 0.5}) {
    const auto ram_blocks = static_cast<uint64_t>(fraction * working_set_blocks);
    const uint64_t ram_bytes = ram_blocks * block_bytes;
    const Replay slru = replay(trace, EvictionPolicy::kSegmentedLru, ram_bytes, block_bytes);
    const Replay lru = replay(trace, EvictionPolicy::kLru, ram_bytes, block_bytes);
    rows.push_back({
        {"ram_fraction_of_working_set", fraction},
        {"ram_blocks", ram_blocks},
        {"ram_mib", static_cast<double>(ram_bytes) / (1 << 20)},
        {"segmented_lru_hit_rate",
         static_cast<double>(slru.found) / static_cast<double>(slru.requested)},
        {"lru_hit_rate", static_cast<double>(lru.found) / static_cast<double>(lru.requested)},
        {"blocks_requested", slru.requested},
        {"segmented_lru_blocks_found", slru.found},
        {"lru_blocks_found", lru.found},
        {"segmented_lru_replay_s", slru.seconds},
        {"lru_replay_s", lru.seconds},
    });
  }
  return {{"requests", trace.requests.size()},
          {"scan_requests", trace.scans},
          {"working_set_blocks", working_set_blocks},
          {"unbounded_ram_hit_rate",
           static_cast<double>(unbounded.found) / static_cast<double>(unbounded.requested)},
          {"block_kib", flags.block_kib},
          {"budgets", rows}};
}

// --- (b) disk tier throughput ----------------------------------------------------------------

void write_file(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + path);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) throw std::runtime_error("cannot write " + path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

std::string read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  struct stat info {};
  ::fstat(fd, &info);
  std::string bytes(static_cast<size_t>(info.st_size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) throw std::runtime_error("cannot read " + path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return bytes;
}

std::string make_temp_dir(const std::string& parent) {
  std::string pattern = (fs::path(parent) / "moeline-reuse-bench-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp in " + parent);
  return pattern;
}

nlohmann::json disk_section(const Flags& flags) {
  const std::string root =
      make_temp_dir(flags.dir.empty() ? fs::temp_directory_path().string() : flags.dir);
  const auto blocks = static_cast<size_t>(flags.blocks);
  const size_t block_bytes = static_cast<size_t>(flags.block_kib) * 1024;
  const double mib = static_cast<double>(blocks * block_bytes) / (1 << 20);

  // Incompressible contents, made before any timing; every block differs.
  std::mt19937_64 rng(7);
  std::vector<std::string> values(blocks, std::string(block_bytes, '\0'));
  for (auto& value : values)
    for (size_t i = 0; i + 8 <= value.size(); i += 8) {
      const uint64_t word = rng();
      std::memcpy(value.data() + i, &word, 8);
    }
  std::vector<uint64_t> keys(blocks);
  for (size_t i = 0; i < blocks; ++i) keys[i] = mix(i);
  std::vector<size_t> read_order(blocks);
  std::iota(read_order.begin(), read_order.end(), size_t{0});
  std::shuffle(read_order.begin(), read_order.end(), rng);

  // Plain files, one per block (first, while the values are still here to write from).
  const std::string files = root + "/files";
  fs::create_directories(files);
  auto file_of = [&](size_t i) { return files + "/" + std::to_string(keys[i]); };
  auto start = Clock::now();
  for (size_t i = 0; i < blocks; ++i) write_file(file_of(i), values[i]);
  const double files_write_s = seconds_since(start);
  start = Clock::now();
  for (size_t i : read_order)
    if (read_file(file_of(i)).size() != block_bytes) throw std::runtime_error("file read short");
  const double files_read_s = seconds_since(start);

  // The store's disk tier: the writes and closing the store are timed; the values are moved in.
  StoreOptions options;
  options.ram_bytes = 1;  // every value is larger: each put goes straight to disk
  options.disk_bytes = uint64_t{1} << 40;
  options.disk_path = root + "/rocksdb";
  start = Clock::now();
  {
    auto store_opened = opened_store(options);
    SnapshotStore& store = *store_opened;
    for (size_t i = 0; i < blocks; ++i) store.put(keys[i], std::move(values[i]));
    if (store.stats().spills != blocks) throw std::runtime_error("not every block spilled");
  }
  const double rocksdb_write_s = seconds_since(start);
  start = Clock::now();
  auto reopened_opened = opened_store(options);
  SnapshotStore& reopened = *reopened_opened;
  const double rocksdb_open_s = seconds_since(start);  // reads every record to index it
  start = Clock::now();
  for (size_t i : read_order) {
    auto value = reopened.get(keys[i]);
    if (!value || value->size() != block_bytes) throw std::runtime_error("rocksdb read missed");
  }
  const double rocksdb_read_s = seconds_since(start);
  const uint64_t corrupt = reopened.stats().corrupt;

  fs::remove_all(root);
  return {{"blocks", blocks},
          {"block_kib", flags.block_kib},
          {"total_mib", mib},
          {"rocksdb_write_mb_s", mib / rocksdb_write_s},
          {"rocksdb_open_s", rocksdb_open_s},
          {"rocksdb_read_mb_s", mib / rocksdb_read_s},
          {"rocksdb_corrupt", corrupt},
          {"files_write_mb_s", mib / files_write_s},
          {"files_read_mb_s", mib / files_read_s},
          {"read_order", "shuffled"},
          {"unit", "MiB/s, page cache not dropped, no fsync"}};
}

// --- (c) sustained spilling ------------------------------------------------------------------

double process_cpu_seconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

nlohmann::json sustained_section(const Flags& flags) {
  const std::string root =
      make_temp_dir(flags.dir.empty() ? fs::temp_directory_path().string() : flags.dir);
  constexpr size_t kValueBytes = 192 * 1024;
  constexpr uint64_t kWindowBytes = uint64_t{256} << 20;
  StoreOptions options;
  options.ram_bytes = 1;  // every put spills, as the probe's RAM tier does once it is full
  options.disk_bytes = static_cast<uint64_t>(flags.sustained_budget_mib) << 20;
  options.disk_reserve_bytes = uint64_t{64} << 20;  // the probe's default
  options.disk_path = root + "/rocksdb";
  std::mt19937_64 rng(11);
  std::string pattern(kValueBytes, '\0');
  for (size_t i = 0; i + 8 <= pattern.size(); i += 8) {
    const uint64_t word = rng();
    std::memcpy(pattern.data() + i, &word, 8);
  }
  nlohmann::json windows = nlohmann::json::array();
  {
    auto store_opened = opened_store(options);
    SnapshotStore& store = *store_opened;
    const uint64_t total = static_cast<uint64_t>(flags.sustained_mib) << 20;
    uint64_t written = 0, key = 0;
    while (written < total) {
      const double cpu_before = process_cpu_seconds();
      const auto start = Clock::now();
      uint64_t spills = 0;
      for (uint64_t in_window = 0; in_window < kWindowBytes && written < total;
           in_window += kValueBytes, written += kValueBytes, ++spills) {
        std::string value = pattern;  // distinct values: the key in the first word
        const uint64_t id = mix(++key);
        std::memcpy(value.data(), &id, 8);
        store.put(id, std::move(value));
      }
      const double wall_s = seconds_since(start);
      const double cpu_s = process_cpu_seconds() - cpu_before;
      windows.push_back({{"written_mib", written >> 20},
                         {"cpu_ms_per_spill", 1000 * cpu_s / static_cast<double>(spills)},
                         {"spill_mb_s", static_cast<double>(spills * kValueBytes) / 1e6 / wall_s},
                         {"disk_mib", store.disk_file_bytes() >> 20},
                         {"held_mib", store.stats().disk_bytes >> 20}});
    }
    if (store.stats().spill_failures != 0) throw std::runtime_error("a spill failed");
  }
  fs::remove_all(root);
  return {{"value_kib", kValueBytes / 1024},
          {"budget_mib", flags.sustained_budget_mib},
          {"windows", windows}};
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse_flags(argc, argv);
  try {
    nlohmann::json out;
    out["policy"] = policy_section(flags);
    out["disk"] = disk_section(flags);
    if (flags.sustained_mib > 0) out["sustained"] = sustained_section(flags);
    std::cout << out.dump() << "\n";
  } catch (const std::exception& error) {
    std::cerr << "moeline_reuse_bench: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
