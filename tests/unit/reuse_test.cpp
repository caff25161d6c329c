// The snapshot store (RAM tier eviction, RocksDB disk tier: spill, restore, budget, checksums,
// restart) on real RocksDB in temporary folders, and the reuse keys and records.
#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "model/kv_cache.h"
#include "reuse/records.h"
#include "reuse/snapshot_store.h"

namespace moeline::reuse {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kKiB = 1024;
// What the disk tier adds to every value: u64 checksum, u64 sequence (snapshot_store.cpp).
constexpr uint64_t kDiskTrailer = 16;

// A unique folder under the system's temporary folder, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "moeline-reuse-test-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string db() const { return (path_ / "db").string(); }

 private:
  fs::path path_;
};

// Distinct, recognisable contents per key.
std::string value_of(uint64_t key, uint64_t bytes) {
  std::string value(bytes, '\0');
  for (size_t i = 0; i < value.size(); ++i)
    value[i] = static_cast<char>((key * 131 + i * 7) & 0xff);
  return value;
}

StoreOptions ram_only(uint64_t ram_bytes, EvictionPolicy policy = EvictionPolicy::kSegmentedLru) {
  StoreOptions options;
  options.ram_bytes = ram_bytes;
  options.disk_path.clear();
  options.policy = policy;
  return options;
}

StoreOptions with_disk(const TempDir& dir, uint64_t ram_bytes, uint64_t disk_bytes = 1 << 30) {
  StoreOptions options;
  options.ram_bytes = ram_bytes;
  options.disk_bytes = disk_bytes;
  options.disk_path = dir.db();
  return options;
}

// A store that must open (a failure ends the test with its message).
std::unique_ptr<SnapshotStore> opened_store(StoreOptions options) {
  auto store = SnapshotStore::open(std::move(options));
  if (!store) throw std::runtime_error(store.error().message);
  return std::move(*store);
}

// The store's record key: 'd' and the 8-byte big-endian store key.
std::string disk_key(uint64_t key) {
  std::string out(9, 'd');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i) + 1] = static_cast<char>(key >> (56 - 8 * i));
  return out;
}

TEST(SnapshotStore, PutThenGetFromRam) {
  auto store_opened = opened_store(ram_only(64 * kKiB));
  SnapshotStore& store = *store_opened;
  store.put(7, value_of(7, 4 * kKiB));
  ASSERT_TRUE(store.contains(7));
  Value value = store.get(7);
  ASSERT_NE(value, nullptr);
  EXPECT_EQ(*value, value_of(7, 4 * kKiB));
  EXPECT_EQ(store.get(8), nullptr);
  EXPECT_FALSE(store.contains(8));
  EXPECT_EQ(store.stats().hits_ram, 1u);
  EXPECT_EQ(store.stats().misses, 1u);
  EXPECT_EQ(store.stats().ram_entries, 1u);
  EXPECT_EQ(store.stats().ram_bytes, 4 * kKiB);
}

TEST(SnapshotStore, RamBudgetIsNeverExceeded) {
  for (EvictionPolicy policy : {EvictionPolicy::kSegmentedLru, EvictionPolicy::kLru}) {
    auto store_opened = opened_store(ram_only(50 * kKiB, policy));
    SnapshotStore& store = *store_opened;
    uint64_t evictions_seen = 0;
    for (uint64_t key = 1; key <= 200; ++key) {
      store.put(key, value_of(key, (1 + key % 7) * kKiB));
      // Re-use some entries so that the protected segment fills too.
      if (key % 3 == 0) store.get(key - 1);
      ASSERT_LE(store.stats().ram_bytes, store.options().ram_bytes) << "after key " << key;
      evictions_seen = store.stats().evictions;
    }
    EXPECT_GT(evictions_seen, 0u);
  }
}

// A key used on every round against bursts of one-off entries, each as large as the whole RAM
// budget (10 bursts: 10x the budget). Segmented LRU keeps it; plain LRU loses it to every burst.
uint64_t hot_key_ram_hits(EvictionPolicy policy) {
  constexpr uint64_t kBudget = 64 * kKiB, kEntry = 4 * kKiB, kHot = 1'000'000;
  auto store_opened = opened_store(ram_only(kBudget, policy));
  SnapshotStore& store = *store_opened;
  store.put(kHot, value_of(kHot, kEntry));
  store.get(kHot);  // its second use
  const uint64_t warm_hits = store.stats().hits_ram;
  uint64_t next_one_off = 1;
  for (int round = 0; round < 10; ++round) {
    if (!store.get(kHot)) store.put(kHot, value_of(kHot, kEntry));
    for (uint64_t bytes = 0; bytes < kBudget; bytes += kEntry, ++next_one_off)
      store.put(next_one_off, value_of(next_one_off, kEntry));
  }
  EXPECT_EQ((next_one_off - 1) * kEntry, 10 * kBudget);
  return store.stats().hits_ram - warm_hits;  // one-offs are never read: these are the hot key's
}

TEST(SnapshotStore, SegmentedLruResistsScans) {
  EXPECT_EQ(hot_key_ram_hits(EvictionPolicy::kSegmentedLru), 10u);
  // Plain LRU: a hit in the first round only (before the first burst), then a miss every round.
  EXPECT_EQ(hot_key_ram_hits(EvictionPolicy::kLru), 1u);
}

TEST(SnapshotStore, EvictionSpillsToDiskAndGetRestores) {
  TempDir dir;
  auto store_opened = opened_store(with_disk(dir, 16 * kKiB));
  SnapshotStore& store = *store_opened;
  for (uint64_t key = 1; key <= 10; ++key) store.put(key, value_of(key, 4 * kKiB));
  EXPECT_EQ(store.stats().evictions, 6u);
  EXPECT_EQ(store.stats().spills, 6u);
  EXPECT_EQ(store.stats().disk_entries, 6u);
  EXPECT_EQ(store.stats().disk_bytes, 6 * (4 * kKiB + kDiskTrailer));
  EXPECT_EQ(store.stats().ram_entries, 4u);
  for (uint64_t key = 1; key <= 10; ++key) EXPECT_TRUE(store.contains(key)) << key;

  Value value = store.get(1);  // the oldest: spilled first
  ASSERT_NE(value, nullptr);
  EXPECT_EQ(*value, value_of(1, 4 * kKiB));
  EXPECT_EQ(store.stats().hits_disk, 1u);
  EXPECT_EQ(store.stats().restores, 1u);
  EXPECT_EQ(store.stats().hits_ram, 0u);
  // Restored: the next read is served from RAM.
  ASSERT_NE(store.get(1), nullptr);
  EXPECT_EQ(store.stats().hits_ram, 1u);
  EXPECT_EQ(store.stats().hits_disk, 1u);
  EXPECT_LE(store.stats().ram_bytes, 16 * kKiB);
}

// Restored entries count as used twice (protected); they must not crowd new entries out of RAM.
TEST(SnapshotStore, RestoresRespectTheProtectedBudget) {
  TempDir dir;
  constexpr uint64_t kEntry = 4 * kKiB;
  auto store_opened = opened_store(with_disk(dir, 10 * kEntry));
  SnapshotStore& store = *store_opened;
  for (uint64_t key = 1; key <= 20; ++key) store.put(key, value_of(key, kEntry));
  for (uint64_t key = 1; key <= 20; ++key) ASSERT_NE(store.get(key), nullptr) << key;
  store.put(100, value_of(100, kEntry));
  const uint64_t hits_ram = store.stats().hits_ram;
  ASSERT_NE(store.get(100), nullptr);
  EXPECT_EQ(store.stats().hits_ram, hits_ram + 1) << "a new entry was evicted as it was inserted";
}

TEST(SnapshotStore, DiskBudgetEvictsOldestFirst) {
  TempDir dir;
  constexpr uint64_t kEntry = 4 * kKiB;
  // A 1-byte RAM tier: every value goes straight to disk, in put order.
  auto store_opened = opened_store(with_disk(dir, 1, 3 * (kEntry + kDiskTrailer)));
  SnapshotStore& store = *store_opened;
  for (uint64_t key = 1; key <= 5; ++key) store.put(key, value_of(key, kEntry));
  EXPECT_EQ(store.stats().disk_evictions, 2u);
  EXPECT_EQ(store.stats().disk_entries, 3u);
  EXPECT_LE(store.stats().disk_bytes, 3 * (kEntry + kDiskTrailer));
  EXPECT_FALSE(store.contains(1));
  EXPECT_FALSE(store.contains(2));
  for (uint64_t key = 3; key <= 5; ++key) {
    Value value = store.get(key);
    ASSERT_NE(value, nullptr) << key;
    EXPECT_EQ(*value, value_of(key, kEntry));
  }
  EXPECT_EQ(store.get(1), nullptr);
}

TEST(SnapshotStore, CorruptDiskRecordIsDroppedNotServed) {
  TempDir dir;
  constexpr uint64_t kEntry = 4 * kKiB;
  {
    auto store_opened = opened_store(with_disk(dir, 1));
    SnapshotStore& store = *store_opened;
    for (uint64_t key = 1; key <= 3; ++key) store.put(key, value_of(key, kEntry));
    ASSERT_EQ(store.stats().disk_entries, 3u);
  }
  {
    rocksdb::Options options;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(options, dir.db(), &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::string record;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), disk_key(2), &record).ok());
    ASSERT_EQ(record.size(), kEntry + kDiskTrailer);
    record[100] = static_cast<char>(record[100] ^ 0x5a);  // the payload (the trailer follows it)
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), disk_key(2), record).ok());
  }
  {
    // A disk budget of three records: the tier is full when the damage is found.
    auto store_opened = opened_store(with_disk(dir, 1, 3 * (kEntry + kDiskTrailer)));
    SnapshotStore& store = *store_opened;
    ASSERT_EQ(store.stats().disk_entries, 3u);
    EXPECT_EQ(store.get(2), nullptr);
    EXPECT_EQ(store.stats().corrupt, 1u);
    EXPECT_FALSE(store.contains(2));
    EXPECT_EQ(store.stats().disk_entries, 2u);
    EXPECT_EQ(store.stats().disk_bytes, 2 * (kEntry + kDiskTrailer));
    Value intact = store.get(3);
    ASSERT_NE(intact, nullptr);
    EXPECT_EQ(*intact, value_of(3, kEntry));
    // The dropped record left the age order too: the tier turns over oldest first as before.
    for (uint64_t key = 20; key <= 22; ++key) store.put(key, value_of(key, kEntry));
    EXPECT_EQ(store.stats().disk_entries, 3u);
    for (uint64_t key : {1, 3}) EXPECT_FALSE(store.contains(key)) << key;
    for (uint64_t key : {20, 21, 22}) EXPECT_TRUE(store.contains(key)) << key;
  }
  // Deleted from disk as well, not only from the index.
  auto store_opened = opened_store(with_disk(dir, 1));
  SnapshotStore& store = *store_opened;
  EXPECT_EQ(store.stats().disk_entries, 3u);
  EXPECT_FALSE(store.contains(2));
}

// A damaged disk tier is an error with its code at the library's boundary, and the resilient
// open moves it aside and starts a new one.
TEST(SnapshotStore, ADamagedDiskTierIsACorruptionError) {
  TempDir dir;
  { opened_store(with_disk(dir, 1))->put(1, value_of(1, 4 * kKiB)); }
  {
    std::ofstream current(fs::path(with_disk(dir, 1).disk_path) / "CURRENT", std::ios::trunc);
    current << "MANIFEST-no-such-file";  // no newline: RocksDB's own check fails
  }
  auto damaged = SnapshotStore::open(with_disk(dir, 1));
  ASSERT_FALSE(damaged);
  EXPECT_EQ(damaged.error().code, StatusCode::kCorruption) << damaged.error().message;
  EXPECT_NE(damaged.error().message.find(with_disk(dir, 1).disk_path), std::string::npos);
  StoreOpenReport report;
  auto store = SnapshotStore::open_resilient(with_disk(dir, 1), report);
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(report.disk_tier);
  EXPECT_FALSE(report.moved_aside_to.empty());
  EXPECT_FALSE(store->contains(1)) << "what the damaged tier held is gone, never served";
}

TEST(SnapshotStore, SpilledEntriesSurviveRestart) {
  TempDir dir;
  constexpr uint64_t kEntry = 4 * kKiB;
  StoreStats before;
  {
    auto store_opened = opened_store(with_disk(dir, 8 * kKiB));
    SnapshotStore& store = *store_opened;
    for (uint64_t key = 1; key <= 6; ++key) store.put(key, value_of(key, kEntry));
    before = store.stats();
    ASSERT_EQ(before.disk_entries, 4u);  // 1..4 spilled; 5 and 6 only in RAM
  }
  auto store_opened = opened_store(with_disk(dir, 8 * kKiB));
  SnapshotStore& store = *store_opened;
  EXPECT_EQ(store.stats().disk_entries, before.disk_entries);
  EXPECT_EQ(store.stats().disk_bytes, before.disk_bytes);
  EXPECT_EQ(store.stats().ram_entries, 0u);
  for (uint64_t key = 1; key <= 4; ++key) {
    Value value = store.get(key);
    ASSERT_NE(value, nullptr) << key;
    EXPECT_EQ(*value, value_of(key, kEntry));
  }
  EXPECT_EQ(store.stats().hits_disk, 4u);
  // What was only in RAM is gone with the process.
  EXPECT_EQ(store.get(5), nullptr);
}

// The disk tier's age order is restored too: after a restart, new spills are younger than old ones.
TEST(SnapshotStore, DiskAgeOrderSurvivesRestart) {
  TempDir dir;
  constexpr uint64_t kEntry = 4 * kKiB, kRecord = kEntry + kDiskTrailer;
  {
    auto store_opened = opened_store(with_disk(dir, 1, 3 * kRecord));
    SnapshotStore& store = *store_opened;
    for (uint64_t key = 1; key <= 3; ++key) store.put(key, value_of(key, kEntry));
  }
  auto store_opened = opened_store(with_disk(dir, 1, 3 * kRecord));
  SnapshotStore& store = *store_opened;
  ASSERT_EQ(store.stats().disk_entries, 3u);
  store.put(10, value_of(10, kEntry));
  EXPECT_EQ(store.stats().disk_evictions, 1u);
  EXPECT_FALSE(store.contains(1));
  for (uint64_t key : {2, 3, 10}) EXPECT_TRUE(store.contains(key)) << key;
  // Two more: the records from before the restart go in their order, then none of the new ones.
  store.put(11, value_of(11, kEntry));
  store.put(12, value_of(12, kEntry));
  EXPECT_EQ(store.stats().disk_evictions, 3u);
  EXPECT_EQ(store.stats().disk_entries, 3u);
  for (uint64_t key : {1, 2, 3}) EXPECT_FALSE(store.contains(key)) << key;
  for (uint64_t key : {10, 11, 12}) EXPECT_TRUE(store.contains(key)) << key;
}

// A disk without room for the free-space reserve (here: a reserve larger than any disk): the
// spills are refused, counted, and said why; what was put stays served from RAM while it fits.
TEST(SnapshotStore, SpillsPastTheDiskReserveAreRefusedAndCounted) {
  TempDir dir;
  constexpr uint64_t kEntry = 4 * kKiB;
  StoreOptions options = with_disk(dir, 2 * kEntry);
  options.disk_reserve_bytes = uint64_t{1} << 62;
  auto store_opened = opened_store(options);
  SnapshotStore& store = *store_opened;
  for (uint64_t key = 1; key <= 4; ++key) store.put(key, value_of(key, kEntry));
  EXPECT_EQ(store.stats().disk_entries, 0u);
  // Every entry the RAM budget pushed out was a refused spill.
  ASSERT_GE(store.stats().ram_entries, 1u);
  EXPECT_EQ(store.stats().spill_failures, 4u - store.stats().ram_entries);
  EXPECT_FALSE(store.contains(1));
  ASSERT_NE(store.get(4), nullptr);
  EXPECT_EQ(*store.get(4), value_of(4, kEntry));
}

// `du`'s count, written here rather than taken from the store (whose disk_file_bytes() the test
// checks against it).
uint64_t bytes_under(const std::string& path) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& entry : fs::recursive_directory_iterator(path, ec)) {
    std::error_code entry_error;
    const uintmax_t size = entry.is_regular_file(entry_error) ? entry.file_size(entry_error) : 0;
    if (!entry_error) total += size;
  }
  return total;
}

// The tier turns over ten times: what it evicts must leave the disk, not only its count. Values
// live in blob files that are written in spill order and evicted oldest first, so each file
// becomes all garbage as a whole and RocksDB drops it once compaction has counted it (no blob
// garbage collection: that rewrote the live values of the oldest files, soon evicted anyway, and
// made each spill cost more the more the tier held). On disk: the budget, plus what the last
// flushes and the memtable hold before a compaction counts them (a few write buffers).
TEST(SnapshotStore, EvictedBytesLeaveTheDiskAsTheTierTurnsOver) {
  TempDir dir;
  constexpr uint64_t kMiB = 1024 * kKiB, kEntry = 64 * kKiB;
  StoreOptions options = with_disk(dir, 1, 8 * kMiB);
  options.disk_reserve_bytes = 4 * kMiB;  // a write buffer of a quarter of it: 1 MiB
  auto store_opened = opened_store(options);
  SnapshotStore& store = *store_opened;
  for (uint64_t key = 1; key <= 80 * kMiB / kEntry; ++key) store.put(key, value_of(key, kEntry));
  EXPECT_LE(store.stats().disk_bytes, 8 * kMiB);
  EXPECT_EQ(store.stats().spill_failures, 0u);
  // Compactions run in the background: give them time to count the garbage.
  const uint64_t bound = 8 * kMiB + 8 * kMiB;
  uint64_t on_disk = bytes_under(dir.db());
  for (int wait = 0; wait < 300 && on_disk > bound; ++wait) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    on_disk = bytes_under(dir.db());
  }
  EXPECT_LE(on_disk, bound) << "the tier holds " << store.stats().disk_bytes << " bytes";
  std::cout << "on disk after 80 MiB through an 8 MiB tier: " << on_disk << " bytes\n";
  // What the probe exports as moeline_probe_store_disk_file_bytes: the same count, give or take
  // a file RocksDB writes or drops between the two walks (at most a write buffer, 1 MiB here).
  // A compaction still finishing can swap files between them (seen once: 1.07 MiB apart), so the
  // two are taken again, a tenth of a second later, until a pair is taken between changes.
  double reported = 0, walked = 0;
  for (int attempt = 0; attempt < 30; ++attempt) {
    reported = static_cast<double>(store.disk_file_bytes());
    walked = static_cast<double>(bytes_under(dir.db()));
    if (std::abs(reported - walked) <= static_cast<double>(kMiB)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GE(reported, static_cast<double>(store.stats().disk_bytes));
  EXPECT_NEAR(reported, walked, static_cast<double>(kMiB));
  Value newest = store.get(80 * kMiB / kEntry);
  ASSERT_NE(newest, nullptr);
  EXPECT_EQ(*newest, value_of(80 * kMiB / kEntry, kEntry));
}

TEST(SnapshotStore, ValueLargerThanRamGoesStraightToDisk) {
  TempDir dir;
  auto store_opened = opened_store(with_disk(dir, 16 * kKiB));
  SnapshotStore& store = *store_opened;
  store.put(1, value_of(1, 32 * kKiB));
  EXPECT_EQ(store.stats().ram_bytes, 0u);
  EXPECT_EQ(store.stats().ram_entries, 0u);
  EXPECT_EQ(store.stats().evictions, 0u);
  EXPECT_EQ(store.stats().spills, 1u);
  EXPECT_EQ(store.stats().disk_entries, 1u);
  Value value = store.get(1);
  ASSERT_NE(value, nullptr);
  EXPECT_EQ(*value, value_of(1, 32 * kKiB));
  EXPECT_EQ(store.stats().hits_disk, 1u);
  EXPECT_EQ(store.stats().ram_bytes, 0u);
}

TEST(SnapshotStore, NoDiskTierWithoutPath) {
  auto store_opened = opened_store(ram_only(16 * kKiB));
  SnapshotStore& store = *store_opened;
  for (uint64_t key = 1; key <= 10; ++key) store.put(key, value_of(key, 4 * kKiB));
  EXPECT_EQ(store.stats().evictions, 6u);
  EXPECT_EQ(store.stats().spills, 0u);
  EXPECT_EQ(store.stats().disk_entries, 0u);
  EXPECT_FALSE(store.contains(1));
  EXPECT_EQ(store.get(1), nullptr);
  EXPECT_EQ(store.stats().misses, 1u);
  // A value larger than RAM with nowhere to go is dropped.
  store.put(99, value_of(99, 32 * kKiB));
  EXPECT_FALSE(store.contains(99));
}

// --- records ---------------------------------------------------------------------------------

std::vector<int32_t> tokens_of(size_t count, int32_t first = 1) {
  std::vector<int32_t> tokens(count);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

constexpr size_t kBlock = static_cast<size_t>(model::kBlockTokens);

TEST(ReuseKeys, EqualInputsGiveEqualKeys) {
  const auto tokens = tokens_of(3 * kBlock + 5);
  const auto a = block_chain(tokens, 11, 22), b = block_chain(tokens, 11, 22);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(prompt_key(tokens, a, 11, 22), prompt_key(tokens, b, 11, 22));
}

TEST(ReuseKeys, AnyDifferenceGivesDifferentKeys) {
  const auto tokens = tokens_of(3 * kBlock + 5);
  const auto chain = block_chain(tokens, 11, 22);
  const uint64_t key = prompt_key(tokens, chain, 11, 22);

  auto changed = tokens;
  changed[kBlock + 3] += 1000;  // inside the second block
  const auto changed_chain = block_chain(changed, 11, 22);
  EXPECT_EQ(changed_chain[0], chain[0]);  // the prefix before the change is shared
  EXPECT_NE(changed_chain[1], chain[1]);
  EXPECT_NE(changed_chain[2], chain[2]);  // and everything after it differs
  EXPECT_NE(prompt_key(changed, changed_chain, 11, 22), key);

  const auto other_model = block_chain(tokens, 12, 22);
  const auto other_namespace = block_chain(tokens, 11, 23);
  for (size_t b = 0; b < chain.size(); ++b) {
    EXPECT_NE(other_model[b], chain[b]);
    EXPECT_NE(other_namespace[b], chain[b]);
  }
  EXPECT_NE(prompt_key(tokens, other_model, 12, 22), key);
  EXPECT_NE(prompt_key(tokens, other_namespace, 11, 23), key);
}

TEST(ReuseKeys, PartialLastBlockAndLengthChangeThePromptKey) {
  auto a = tokens_of(2 * kBlock + 5);
  auto b = a;
  b.back() += 1;  // differs only in the partial last block
  const auto chain_a = block_chain(a, 1, 0), chain_b = block_chain(b, 1, 0);
  EXPECT_EQ(chain_a, chain_b);
  EXPECT_NE(prompt_key(a, chain_a, 1, 0), prompt_key(b, chain_b, 1, 0));

  // A prompt vs the same prompt plus one token: at a block boundary and inside a block.
  for (size_t length : {2 * kBlock, 2 * kBlock - 1, 2 * kBlock + 3}) {
    const auto shorter = tokens_of(length), longer = tokens_of(length + 1);
    EXPECT_NE(prompt_key(shorter, block_chain(shorter, 1, 0), 1, 0),
              prompt_key(longer, block_chain(longer, 1, 0), 1, 0))
        << length;
  }
}

TEST(ReuseKeys, EntryKindsHaveSeparateKeySpaces) {
  const uint64_t base = 0x1234'5678'9abc'def0ULL;
  model::SamplingParams greedy;
  const uint64_t b = block_entry(base), p = prompt_entry(base), r = result_entry(base, greedy);
  EXPECT_NE(b, p);
  EXPECT_NE(b, r);
  EXPECT_NE(p, r);
  EXPECT_NE(b, base);
  EXPECT_NE(p, base);
}

TEST(ReuseKeys, ResultKeyDependsOnWhatDecidesTheCompletion) {
  const uint64_t base = 42;
  model::SamplingParams greedy;
  const uint64_t key = result_entry(base, greedy);

  auto knobs = greedy;
  knobs.top_k = 5;
  knobs.top_p = 0.5;
  knobs.seed = 9;
  EXPECT_EQ(result_entry(base, knobs), key) << "greedy ignores top_k, top_p and seed";

  model::SamplingParams sampled;
  sampled.temperature = 0.7;
  sampled.seed = 1;
  const uint64_t sampled_key = result_entry(base, sampled);
  EXPECT_NE(sampled_key, key);
  auto other = sampled;
  other.top_k = 5;
  EXPECT_NE(result_entry(base, other), sampled_key);
  other = sampled;
  other.top_p = 0.9;
  EXPECT_NE(result_entry(base, other), sampled_key);
  other = sampled;
  other.seed = 2;
  EXPECT_NE(result_entry(base, other), sampled_key);
  other = sampled;
  other.temperature = 0.8;
  EXPECT_NE(result_entry(base, other), sampled_key);

  auto changed = greedy;
  changed.max_tokens = greedy.max_tokens + 1;
  EXPECT_NE(result_entry(base, changed), key);
  changed = greedy;
  changed.stop_token_ids = {7};
  EXPECT_NE(result_entry(base, changed), key);
  auto two_stops = changed;
  two_stops.stop_token_ids = {7, 8};
  EXPECT_NE(result_entry(base, two_stops), result_entry(base, changed));
  changed = greedy;
  changed.ignore_eos = true;
  EXPECT_NE(result_entry(base, changed), key);
  EXPECT_NE(result_entry(base + 1, greedy), key);
  // A logit bias changes greedy tokens; the same bias in another order is the same request.
  auto biased = greedy;
  biased.logit_bias = {{7, 2.5f}, {3, -100.0f}};
  EXPECT_NE(result_entry(base, biased), key);
  auto reordered = greedy;
  reordered.logit_bias = {{3, -100.0f}, {7, 2.5f}};
  EXPECT_EQ(result_entry(base, reordered), result_entry(base, biased));
  auto other_bias = greedy;
  other_bias.logit_bias = {{7, 2.0f}, {3, -100.0f}};
  EXPECT_NE(result_entry(base, other_bias), result_entry(base, biased));
  // A grammar changes greedy tokens: each kind, and each schema, has results of its own.
  auto object = greedy;
  object.structured = moeline::model::StructuredOutput::kJsonObject;
  EXPECT_NE(result_entry(base, object), key);
  auto schema = greedy;
  schema.structured = moeline::model::StructuredOutput::kJsonSchema;
  schema.json_schema = R"({"type": "integer"})";
  EXPECT_NE(result_entry(base, schema), key);
  EXPECT_NE(result_entry(base, schema), result_entry(base, object));
  auto other_schema = schema;
  other_schema.json_schema = R"({"type": "string"})";
  EXPECT_NE(result_entry(base, other_schema), result_entry(base, schema));
}

TEST(ReuseRecords, PromptRecordRoundTripsAndRejectsBadSizes) {
  constexpr size_t kVocab = 50, kBlockBytes = 96;
  PromptRecord record;
  record.logits.resize(kVocab);
  for (size_t i = 0; i < kVocab; ++i) record.logits[i] = 0.25f * static_cast<float>(i) - 3.0f;
  record.tail_kv = std::string(kBlockBytes, 'k');
  const std::string bytes = encode(record);
  auto decoded = decode_prompt(bytes, kVocab, kBlockBytes);
  ASSERT_TRUE(decoded.has_value());
  EXPECT_EQ(decoded->logits, record.logits);
  EXPECT_EQ(decoded->tail_kv, record.tail_kv);

  PromptRecord no_tail{record.logits, {}};
  auto decoded_no_tail = decode_prompt(encode(no_tail), kVocab, kBlockBytes);
  ASSERT_TRUE(decoded_no_tail.has_value());
  EXPECT_TRUE(decoded_no_tail->tail_kv.empty());

  for (size_t cut : {size_t{0}, size_t{4}, size_t{7}, size_t{8}, bytes.size() - 1})
    EXPECT_FALSE(decode_prompt(bytes.substr(0, cut), kVocab, kBlockBytes).has_value()) << cut;
  EXPECT_FALSE(decode_prompt(bytes + "x", kVocab, kBlockBytes).has_value());
  EXPECT_FALSE(decode_prompt(bytes, kVocab + 1, kBlockBytes).has_value());  // another vocabulary
  EXPECT_FALSE(decode_prompt(bytes, kVocab, kBlockBytes * 2).has_value());  // another block size
  PromptRecord short_tail{record.logits, std::string(kBlockBytes - 1, 'k')};
  EXPECT_FALSE(decode_prompt(encode(short_tail), kVocab, kBlockBytes).has_value());
}

TEST(ReuseRecords, ResultRecordRoundTripsAndRejectsBadSizes) {
  ResultRecord record{{5, -1, 70000, 3}, "stop"};
  const std::string bytes = encode(record);
  auto decoded = decode_result(bytes);
  ASSERT_TRUE(decoded.has_value());
  EXPECT_EQ(decoded->tokens, record.tokens);
  EXPECT_EQ(decoded->finish_reason, "stop");

  auto empty = decode_result(encode(ResultRecord{}));
  ASSERT_TRUE(empty.has_value());
  EXPECT_TRUE(empty->tokens.empty());
  EXPECT_TRUE(empty->finish_reason.empty());

  for (size_t cut : {size_t{0}, size_t{3}, size_t{8}, bytes.size() - 1})
    EXPECT_FALSE(decode_result(bytes.substr(0, cut)).has_value()) << cut;
  EXPECT_FALSE(decode_result(bytes + "x").has_value());
}

TEST(Records, SignatureAndQualityRoundTripAndRefuseDamage) {
  RouterSums block{{0.25, 1.5, 3.0, 0.0}, {16, 16}, {{1, 2}, {3}}};
  SignatureRecord signature{
      "tenant:acme", {5, 6, 7}, {0.6f, 0.8f}, {{1, 4}, {}, {0, 7, 9}}, {{2, block}, {3, block}}};
  const std::string bytes = encode(signature);
  auto back = decode_signature(bytes);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->cache_namespace, "tenant:acme");
  EXPECT_EQ(back->tokens, signature.tokens);
  EXPECT_EQ(back->signature, signature.signature);
  EXPECT_EQ(back->expert_sets, signature.expert_sets);
  ASSERT_EQ(back->block_sums.size(), 2u);
  EXPECT_EQ(back->block_sums[1].first, 3u);
  EXPECT_EQ(back->block_sums[1].second.sums, block.sums);  // exact in f32
  EXPECT_EQ(back->block_sums[1].second.tokens, block.tokens);
  EXPECT_EQ(back->block_sums[1].second.chosen, block.chosen);
  for (size_t cut : {size_t{0}, size_t{15}, size_t{21}, bytes.size() - 1})
    EXPECT_FALSE(decode_signature(bytes.substr(0, cut)).has_value()) << cut;
  EXPECT_FALSE(decode_signature("XXXX" + bytes.substr(4)).has_value());
  EXPECT_FALSE(decode_signature(bytes + "x").has_value());
  // A length that runs past the end.
  std::string overrun = bytes;
  overrun[overrun.size() - 8] = 100;
  EXPECT_FALSE(decode_signature(overrun).has_value());
  // A signature entry lives in its own key space.
  EXPECT_NE(signature_entry(42), prompt_entry(42));

  QualityRecord quality{3007, true, 0.25f};
  auto q = decode_quality(encode(quality));
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->cell, 3007);
  EXPECT_TRUE(q->correct);
  EXPECT_FLOAT_EQ(q->kl, 0.25f);
  EXPECT_FALSE(decode_quality(encode(quality) + "x").has_value());
  std::string bad = encode(quality);
  bad[4] = 7;
  EXPECT_FALSE(decode_quality(bad).has_value());
}

TEST(ReuseLevels, ParseAndPrint) {
  EXPECT_EQ(parse_levels("prefix"), uint32_t{kPrefix});
  EXPECT_EQ(parse_levels("prefix,result"), uint32_t{kPrefix | kResult});
  EXPECT_EQ(parse_levels("full,prefix,full"), uint32_t{kPrefix | kFull});
  EXPECT_EQ(parse_levels("all"), kAllLevels);
  EXPECT_EQ(parse_levels("none"), 0u);
  EXPECT_EQ(parse_levels(""), 0u);
  EXPECT_EQ(levels_text(0), "none");
  EXPECT_EQ(levels_text(kAllLevels), "prefix,full,result,response,blend");
  EXPECT_EQ(parse_levels("exact"), kExactLevels);
  EXPECT_EQ(parse_levels("approximate"), uint32_t{kResponse | kBlend});
  EXPECT_EQ(parse_levels("exact,blend"), kExactLevels | kBlend);
  EXPECT_EQ(levels_text(kPrefix | kResult), "prefix,result");
  for (uint32_t mask = 0; mask <= kAllLevels; ++mask)
    EXPECT_EQ(parse_levels(levels_text(mask)), mask) << mask;
  EXPECT_THROW(parse_levels("prefix,bogus"), std::invalid_argument);
  EXPECT_THROW(parse_levels("Prefix"), std::invalid_argument);
  try {
    parse_levels("bogus");
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("bogus"), std::string::npos);
  }
}

}  // namespace
}  // namespace moeline::reuse
