#include "reuse/snapshot_store.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <xxhash.h>

#include <cstring>
#include <stdexcept>

namespace moeline::reuse {
namespace {

// A record is the value, then u64 sequence, then u64 xxHash of everything before it: with the
// trailer at the end, a record read into a string becomes the value by truncation (no copy).
constexpr size_t kDiskTrailer = 16;

// Two keys per entry: 'd' + key holds the record, 'm' + key a small index entry (sequence and
// size), so that opening the store reads the index, not every record.
std::string disk_key(uint64_t key, char space = 'd') {
  std::string out(9, space);
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i) + 1] = static_cast<char>(key >> (56 - 8 * i));
  return out;
}

uint64_t parse_disk_key(const rocksdb::Slice& slice) {
  uint64_t key = 0;
  for (size_t i = 1; i < 9 && i < slice.size(); ++i)
    key = (key << 8) | static_cast<uint8_t>(slice.data()[i]);
  return key;
}

void erase_disk(rocksdb::DB& db, uint64_t key) {
  rocksdb::WriteBatch batch;
  batch.Delete(disk_key(key));
  batch.Delete(disk_key(key, 'm'));
  db.Write(rocksdb::WriteOptions(), &batch);
}

// Free bytes for an unprivileged writer on the file system holding `path` (or its nearest
// existing parent); the maximum when it cannot be told.
uint64_t free_disk_bytes(const std::string& path) {
  std::filesystem::path at = path;
  std::error_code ec;
  while (!at.empty() && !std::filesystem::exists(at, ec)) at = at.parent_path();
  struct statvfs info {};
  if (at.empty() || ::statvfs(at.c_str(), &info) != 0) return UINT64_MAX;
  return static_cast<uint64_t>(info.f_bavail) * static_cast<uint64_t>(info.f_frsize);
}

// RocksDB deletes files while the walk runs: a file gone between listing and size counts nothing
// (file_size reports an error as the largest value).
uint64_t bytes_of_files_under(const std::string& path) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(path, ec)) {
    std::error_code entry_error;
    if (!entry.is_regular_file(entry_error)) continue;
    const uintmax_t size = entry.file_size(entry_error);
    if (!entry_error) total += size;
  }
  return total;
}

uint64_t read_u64(const char* p) {
  uint64_t value;
  std::memcpy(&value, p, 8);
  return value;
}

}  // namespace

Expected<std::unique_ptr<SnapshotStore>> SnapshotStore::open(StoreOptions options) {
  std::unique_ptr<SnapshotStore> store(new SnapshotStore(std::move(options)));
  if (Status opened = store->open_disk_tier(); !opened.ok()) return opened.error();
  return store;
}

SnapshotStore::SnapshotStore(StoreOptions options) : options_(std::move(options)) {}

Status SnapshotStore::open_disk_tier() {
  if (options_.disk_path.empty() || options_.disk_bytes == 0) return Status::ok_status();
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  // KV blocks and logits do not compress; large values live in blob files so that compaction
  // does not rewrite them.
  db_options.compression = rocksdb::kNoCompression;
  db_options.enable_blob_files = true;
  db_options.min_blob_size = 4096;
  db_options.blob_compression_type = rocksdb::kNoCompression;
  // No blob garbage collection: the tier evicts oldest first, and blob files hold values in spill
  // order, so each file turns to garbage whole and is dropped once compaction has counted it. The
  // collection instead rewrote the live values of the oldest quarter of the files at every
  // compaction, values about to be evicted anyway: a spill's CPU doubled as the tier filled, and
  // the files on disk ran 50-70% over the budget (moeline_reuse_bench --sustained-mib).
  db_options.enable_blob_garbage_collection = false;
  // A flush writes about what the write-ahead log holds: with the memtable at most a quarter of
  // the free-space reserve, the log and the flush together stay inside it.
  db_options.write_buffer_size =
      options_.disk_reserve_bytes > 0
          ? std::clamp<size_t>(options_.disk_reserve_bytes / 4, 1 << 20, 64 << 20)
          : 64 << 20;
  db_options.avoid_flush_during_shutdown = true;  // the log keeps it; no write at exit
  db_options.max_background_jobs = 2;
  rocksdb::DB* db = nullptr;
  rocksdb::Status status = rocksdb::DB::Open(db_options, options_.disk_path, &db);
  if (!status.ok())
    return Error{
        "cannot open the snapshot disk tier at " + options_.disk_path + ": " + status.ToString(),
        status.IsCorruption() ? StatusCode::kCorruption : StatusCode::kIoError};
  db_.reset(db);
  try {
    load_disk_index();
  } catch (const std::exception& e) {
    return Error{"cannot read the snapshot disk tier at " + options_.disk_path + ": " + e.what(),
                 StatusCode::kIoError};
  }
  return Status::ok_status();
}

SnapshotStore::~SnapshotStore() = default;

std::unique_ptr<SnapshotStore> SnapshotStore::open_resilient(StoreOptions options,
                                                             StoreOpenReport& report) {
  if (!options.disk_path.empty() && options.disk_bytes > 0 && options.disk_reserve_bytes > 0) {
    const uint64_t free = free_disk_bytes(options.disk_path);
    if (free < options.disk_reserve_bytes) {
      // A full disk is not a broken store: keep it for when space comes back.
      report.error = "only " + std::to_string(free) + " bytes free under " + options.disk_path +
                     ", under the reserve of " + std::to_string(options.disk_reserve_bytes);
      report.disk_tier = false;
      options.disk_path.clear();
      return std::unique_ptr<SnapshotStore>(new SnapshotStore(options));
    }
  }
  auto opened = open(options);
  if (opened) return std::move(*opened);
  report.error = opened.error().message;
  std::error_code ec;
  if (std::filesystem::exists(options.disk_path, ec)) {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    const std::string aside =
        options.disk_path + ".unusable-" +
        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count());
    std::filesystem::rename(options.disk_path, aside, ec);
    if (!ec) {
      report.moved_aside_to = aside;
      auto fresh = open(options);
      if (fresh) return std::move(*fresh);
      report.error += "; a new disk tier could not be opened either: " + fresh.error().message;
    } else {
      report.error += "; it could not be moved aside: " + ec.message();
    }
  }
  report.disk_tier = false;
  options.disk_path.clear();
  return std::unique_ptr<SnapshotStore>(new SnapshotStore(options));
}

void SnapshotStore::load_disk_index() {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("m"); it->Valid() && it->key().starts_with("m"); it->Next()) {
    const rocksdb::Slice value = it->value();
    if (value.size() != 16) continue;
    const uint64_t sequence = read_u64(value.data());
    const uint64_t bytes = read_u64(value.data() + 8);
    const uint64_t key = parse_disk_key(it->key());
    disk_[key] = {bytes, sequence};
    disk_order_[sequence] = key;
    stats_.disk_bytes += bytes;
    next_sequence_ = std::max(next_sequence_, sequence + 1);
  }
  stats_.disk_entries = disk_.size();
  enforce_disk_budget();
}

std::vector<uint64_t> SnapshotStore::keys() const {
  std::vector<uint64_t> out;
  out.reserve(ram_.size() + disk_.size());
  for (const auto& [key, entry] : ram_) out.push_back(key);
  for (const auto& [key, entry] : disk_)
    if (!ram_.count(key)) out.push_back(key);
  return out;
}

uint64_t SnapshotStore::disk_file_bytes() const {
  return db_ ? bytes_of_files_under(options_.disk_path) : 0;
}

bool SnapshotStore::contains(uint64_t key) const {
  return ram_.count(key) != 0 || disk_.count(key) != 0;
}

void SnapshotStore::put(uint64_t key, std::string value) {
  auto shared = std::make_shared<const std::string>(std::move(value));
  if (auto it = ram_.find(key); it != ram_.end()) {
    // Same key, same content (keys hash what the value was computed from): keep it, count a use.
    touch(key, it->second);
    return;
  }
  insert_ram(key, std::move(shared), false);
}

void SnapshotStore::insert_ram(uint64_t key, Value value, bool is_protected) {
  if (value->size() > options_.ram_bytes) {
    spill(key, value);  // larger than the whole RAM tier: straight to disk
    return;
  }
  const bool segmented = options_.policy == EvictionPolicy::kSegmentedLru;
  std::list<uint64_t>& segment = segmented && is_protected ? protected_ : probation_;
  segment.push_front(key);
  (segmented && is_protected ? protected_bytes_ : probation_bytes_) += value->size();
  stats_.ram_bytes += value->size();
  ram_[key] = Entry{std::move(value), segmented && is_protected, segment.begin()};
  stats_.ram_entries = ram_.size();
  // Restored entries enter the protected segment: keep it within its share, or it would crowd
  // probation out and every new entry would be evicted as it is inserted.
  if (segmented && is_protected) enforce_protected_budget();
  enforce_ram_budget();
}

void SnapshotStore::touch(uint64_t key, Entry& entry) {
  if (options_.policy == EvictionPolicy::kLru || entry.is_protected) {
    std::list<uint64_t>& segment = entry.is_protected ? protected_ : probation_;
    segment.splice(segment.begin(), segment, entry.position);
    return;
  }
  // Second use: probation -> protected.
  probation_.erase(entry.position);
  probation_bytes_ -= entry.value->size();
  protected_.push_front(key);
  protected_bytes_ += entry.value->size();
  entry.position = protected_.begin();
  entry.is_protected = true;
  enforce_protected_budget();
}

void SnapshotStore::enforce_protected_budget() {
  // An over-full protected segment demotes its oldest back to probation, where it may be evicted.
  const auto protected_budget =
      static_cast<uint64_t>(static_cast<double>(options_.ram_bytes) * options_.protected_fraction);
  while (protected_bytes_ > protected_budget && protected_.size() > 1) {
    const uint64_t oldest = protected_.back();
    Entry& demoted = ram_.at(oldest);
    protected_.pop_back();
    protected_bytes_ -= demoted.value->size();
    probation_.push_front(oldest);
    probation_bytes_ += demoted.value->size();
    demoted.position = probation_.begin();
    demoted.is_protected = false;
  }
}

void SnapshotStore::enforce_ram_budget() {
  while (stats_.ram_bytes > options_.ram_bytes) {
    const bool from_probation = !probation_.empty();
    const uint64_t victim = from_probation ? probation_.back() : protected_.back();
    evict(victim);
  }
}

void SnapshotStore::evict(uint64_t key) {
  auto it = ram_.find(key);
  Entry& entry = it->second;
  const uint64_t bytes = entry.value->size();
  if (entry.is_protected) {
    protected_.erase(entry.position);
    protected_bytes_ -= bytes;
  } else {
    probation_.erase(entry.position);
    probation_bytes_ -= bytes;
  }
  stats_.ram_bytes -= bytes;
  ++stats_.evictions;
  Value value = std::move(entry.value);
  ram_.erase(it);
  stats_.ram_entries = ram_.size();
  spill(key, value);
}

void SnapshotStore::spill(uint64_t key, const Value& value) {
  if (!db_ || disk_.count(key)) return;
  if (options_.disk_reserve_bytes > 0) {
    const uint64_t free = free_disk_bytes(options_.disk_path);
    if (free < options_.disk_reserve_bytes + value->size()) {
      ++stats_.spill_failures;
      disk_error_ = "only " + std::to_string(free) + " bytes free, under the reserve of " +
                    std::to_string(options_.disk_reserve_bytes);
      return;
    }
  }
  const uint64_t sequence = next_sequence_++;
  // Written from its parts, without first copying them into one buffer.
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, value->data(), value->size());
  XXH3_64bits_update(state, &sequence, 8);
  const uint64_t checksum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  char trailer[kDiskTrailer];
  std::memcpy(trailer, &sequence, 8);
  std::memcpy(trailer + 8, &checksum, 8);
  const uint64_t bytes = value->size() + kDiskTrailer;
  const std::string data_key = disk_key(key);
  const rocksdb::Slice key_part(data_key);
  const rocksdb::Slice value_parts[2] = {rocksdb::Slice(*value),
                                         rocksdb::Slice(trailer, kDiskTrailer)};
  char index[16];
  std::memcpy(index, &sequence, 8);
  std::memcpy(index + 8, &bytes, 8);
  rocksdb::WriteBatch batch;
  batch.Put(rocksdb::SliceParts(&key_part, 1), rocksdb::SliceParts(value_parts, 2));
  batch.Put(disk_key(key, 'm'), rocksdb::Slice(index, 16));
  if (rocksdb::Status written = db_->Write(rocksdb::WriteOptions(), &batch); !written.ok()) {
    ++stats_.spill_failures;
    disk_error_ = written.ToString();
    return;
  }
  disk_[key] = {bytes, sequence};
  disk_order_[sequence] = key;
  stats_.disk_bytes += bytes;
  stats_.disk_entries = disk_.size();
  ++stats_.spills;
  enforce_disk_budget();
}

void SnapshotStore::enforce_disk_budget() {
  while (stats_.disk_bytes > options_.disk_bytes && !disk_order_.empty()) {
    const auto oldest = disk_order_.begin();
    const uint64_t key = oldest->second;
    erase_disk(*db_, key);
    stats_.disk_bytes -= disk_.at(key).bytes;
    disk_.erase(key);
    disk_order_.erase(oldest);
    ++stats_.disk_evictions;
  }
  stats_.disk_entries = disk_.size();
}

void SnapshotStore::flush() {
  if (!db_) return;
  for (const auto& [key, entry] : ram_) spill(key, entry.value);
}

Value SnapshotStore::read_disk(uint64_t key) {
  auto it = disk_.find(key);
  if (it == disk_.end() || !db_) return nullptr;
  auto record = std::make_shared<std::string>();
  // Our own checksum covers the whole record; RocksDB's block and blob CRCs would check it twice.
  rocksdb::ReadOptions read_options;
  read_options.verify_checksums = false;
  rocksdb::Status status = db_->Get(read_options, disk_key(key), record.get());
  const bool valid = status.ok() && record->size() >= kDiskTrailer &&
                     read_u64(record->data() + record->size() - 8) ==
                         XXH3_64bits(record->data(), record->size() - 8);
  if (!valid) {
    // Never served: dropped and counted.
    ++stats_.corrupt;
    erase_disk(*db_, key);
    stats_.disk_bytes -= it->second.bytes;
    disk_order_.erase(it->second.sequence);
    disk_.erase(it);
    stats_.disk_entries = disk_.size();
    return nullptr;
  }
  record->resize(record->size() - kDiskTrailer);
  return record;
}

Value SnapshotStore::get(uint64_t key) {
  if (auto it = ram_.find(key); it != ram_.end()) {
    ++stats_.hits_ram;
    touch(key, it->second);
    return it->second.value;
  }
  Value value = read_disk(key);
  if (!value) {
    ++stats_.misses;
    return nullptr;
  }
  ++stats_.hits_disk;
  ++stats_.restores;
  // Back in RAM as an entry that has proven itself (it was used before it spilled).
  insert_ram(key, value, true);
  return value;
}

}  // namespace moeline::reuse
