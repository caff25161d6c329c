#pragma once
// The snapshot store behind exact reuse: values (KV blocks, a prompt's first-token logits, a
// deterministic request's completion) under 64-bit keys, in two tiers.
//
// RAM tier: a byte budget, eviction by recency and frequency that resists scans (segmented LRU:
// an entry enters a probation segment and moves to a protected one on its second use; eviction
// takes probation first, so a burst of one-off prompts cycles through probation and never flushes
// what is used again and again — a shared system prompt). Plain LRU is available for comparison.
//
// Disk tier: RocksDB with blob files (values are large and incompressible: compression off), its
// own byte budget (oldest spilled first out), every value stored with its xxHash and checked on
// every read: a corrupt entry is deleted and counted, never served. Entries evicted from RAM spill
// here, come back to RAM when read, and survive a restart of the process.
//
// Thread-safety: one thread at a time (the probe's loop).

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/status.h"

namespace rocksdb {
class DB;
}

namespace moeline::reuse {

enum class EvictionPolicy { kSegmentedLru, kLru };

struct StoreOptions {
  uint64_t ram_bytes = uint64_t{256} << 20;
  uint64_t disk_bytes = uint64_t{4} << 30;  // 0: no disk tier
  std::string disk_path;                    // empty: no disk tier
  EvictionPolicy policy = EvictionPolicy::kSegmentedLru;
  // Free space the disk tier leaves on its file system: below it, nothing is spilled and a disk
  // tier is not opened. RocksDB must never meet a full disk: its write path then fails an
  // assertion and aborts the process instead of returning an error.
  uint64_t disk_reserve_bytes = 0;
  double protected_fraction = 0.8;  // of the RAM budget, for entries used more than once
};

struct StoreStats {
  uint64_t ram_bytes = 0, ram_entries = 0, disk_bytes = 0, disk_entries = 0;
  uint64_t hits_ram = 0, hits_disk = 0, misses = 0;
  uint64_t evictions = 0, spills = 0, restores = 0, disk_evictions = 0, corrupt = 0;
  // Spills the disk tier refused (a full or failing disk): the entry is dropped, not kept.
  uint64_t spill_failures = 0;
};

// What opening a store took when its disk tier could not be opened as it was.
struct StoreOpenReport {
  std::string error;           // why the disk tier as found could not be opened; empty: it could
  std::string moved_aside_to;  // where the unusable disk tier was moved; empty: not moved
  bool disk_tier = true;       // false: the store runs on its RAM tier alone
};

using Value = std::shared_ptr<const std::string>;

class SnapshotStore {
 public:
  // Opens (or creates) the disk tier (none when `options` names no path or budget). Errors: the
  // tier cannot be opened (I/O error) or RocksDB finds it damaged (corruption).
  static Expected<std::unique_ptr<SnapshotStore>> open(StoreOptions options);
  // Never throws for a bad disk: a disk tier that cannot be opened (a corrupt MANIFEST, a full
  // disk) is moved aside to "<path>.unusable-<unix time>" and a new one opened; when that fails
  // too, the store runs without a disk tier. `report` says which.
  static std::unique_ptr<SnapshotStore> open_resilient(StoreOptions options,
                                                       StoreOpenReport& report);
  // The last error the disk tier returned (empty: none).
  const std::string& disk_error() const { return disk_error_; }
  ~SnapshotStore();
  SnapshotStore(const SnapshotStore&) = delete;
  SnapshotStore& operator=(const SnapshotStore&) = delete;

  void put(uint64_t key, std::string value);
  // RAM first, then disk (restored into RAM); nullptr on a miss.
  Value get(uint64_t key);
  // Writes every RAM entry not yet on disk to the disk tier (a graceful stop keeps them).
  void flush();
  // True if either tier holds the key (no promotion, no restore, no stats).
  bool contains(uint64_t key) const;
  // Every key either tier holds (what a restart rebuilds an index from).
  std::vector<uint64_t> keys() const;
  const StoreStats& stats() const { return stats_; }
  const StoreOptions& options() const { return options_; }
  // What the disk tier's files take on their file system, as `du` counts them: the values and
  // whatever RocksDB has not yet dropped (flushed files a compaction has not counted, its log).
  // stats().disk_bytes is the values alone, which the budget bounds; this shows what the budget
  // costs the disk. A walk of the tier's directory: call it seldom. 0 without a disk tier.
  uint64_t disk_file_bytes() const;

 private:
  explicit SnapshotStore(StoreOptions options);
  Status open_disk_tier();
  struct Entry {
    Value value;
    bool is_protected = false;
    std::list<uint64_t>::iterator position;
  };
  void insert_ram(uint64_t key, Value value, bool is_protected);
  void touch(uint64_t key, Entry& entry);
  void enforce_protected_budget();
  void enforce_ram_budget();
  void evict(uint64_t key);
  void spill(uint64_t key, const Value& value);
  Value read_disk(uint64_t key);
  void enforce_disk_budget();
  void load_disk_index();

  StoreOptions options_;
  StoreStats stats_;
  std::unordered_map<uint64_t, Entry> ram_;
  std::list<uint64_t> probation_, protected_;  // most recent at the front
  uint64_t probation_bytes_ = 0, protected_bytes_ = 0;

  std::unique_ptr<rocksdb::DB> db_;
  struct DiskEntry {
    uint64_t bytes;
    uint64_t sequence;
  };
  std::unordered_map<uint64_t, DiskEntry> disk_;
  std::map<uint64_t, uint64_t> disk_order_;  // sequence -> key, oldest first
  uint64_t next_sequence_ = 1;
  std::string disk_error_;
};

}  // namespace moeline::reuse
