#include "stages/runtime/shared_bulk.h"

#include <dirent.h>
#include <fcntl.h>
#include <sodium.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>

#include "schemas/wire.h"
#include "stages/runtime/metrics.h"

namespace moeline::runtime {
namespace {

// An arena file: a header page (magic, slot count, where the data starts and how long it is), one
// 64-bit word per slot, then the data. A slot's word is (generation << 2) | state.
constexpr char kArenaMagic[8] = {'M', 'O', 'E', 'L', 'A', 'R', 'N', '1'};
constexpr uint32_t kSlots = 1024;
constexpr size_t kSlotWordsAt = 64;
constexpr size_t kDataAt = 12288;  // past the header and 1024 slot words, page-aligned
static_assert(kSlotWordsAt + 8 * kSlots <= kDataAt);
enum SlotState : uint64_t { kFree = 0, kFull = 1, kDone = 2 };
uint64_t slot_word(uint64_t generation, SlotState state) {
  return generation << 2 | state;
}

struct ArenaHeader {
  char magic[8];
  uint32_t slots;
  uint32_t reserved;
  uint64_t data_at;
  uint64_t data_bytes;
};

// The reference frame, little-endian: magic, the arena's name (NUL-padded), the slot, its
// generation, the offset of the first frame in the data, the number of bulk frames, then each
// frame's size. The frames lie in order, each at an offset aligned to kFrameAlignment.
constexpr char kReferenceMagic[8] = {'M', 'O', 'E', 'L', 'S', 'H', 'M', '2'};
constexpr size_t kNameBytes = 64;
struct ReferenceHeader {
  char magic[8];
  char name[kNameBytes];
  uint32_t slot;
  uint32_t reserved;
  uint64_t generation;
  uint64_t offset;
  uint64_t count;
};
static_assert(sizeof(ReferenceHeader) == 104);
constexpr size_t kFrameAlignment = 64;
constexpr const char* kSuffix = ".arena";

size_t aligned(size_t offset) {
  return (offset + kFrameAlignment - 1) & ~(kFrameAlignment - 1);
}

// Where each frame starts, relative to the first, and the length of them all.
std::vector<size_t> layout(const std::vector<uint64_t>& sizes, size_t& total) {
  std::vector<size_t> offsets;
  size_t offset = 0;
  total = 0;
  for (uint64_t size : sizes) {
    offset = aligned(offset);
    offsets.push_back(offset);
    offset += size;
    total = offset;
  }
  return offsets;
}

// "<pid>-<16 hex>.arena": the creator's pid, so that a sweep can tell a dead sender's arena.
std::optional<pid_t> arena_creator(const std::string& name) {
  const size_t dash = name.find('-');
  if (dash == std::string::npos || dash == 0 || dash > 10 ||
      name.size() != dash + 1 + 16 + std::strlen(kSuffix) || !name.ends_with(kSuffix))
    return std::nullopt;
  for (size_t i = 0; i < dash; ++i)
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
  for (size_t i = dash + 1; i < dash + 17; ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i])) || std::isupper(name[i]))
      return std::nullopt;
  const long pid = std::stol(name.substr(0, dash));
  if (pid <= 0 || pid > 0x7fffffff) return std::nullopt;
  return static_cast<pid_t>(pid);
}

std::string hex(const uint8_t* bytes, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 15];
  }
  return out;
}

std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

uint16_t header_flags(const zmq::message_t& header) {
  uint16_t flags = 0;
  std::memcpy(&flags, static_cast<const uint8_t*>(header.data()) + 10, 2);
  return flags;
}

zmq::message_t header_with_flags(const zmq::message_t& header, uint16_t flags) {
  zmq::message_t copy(header.data(), header.size());
  std::memcpy(static_cast<uint8_t*>(copy.data()) + 10, &flags, 2);
  return copy;
}

std::atomic_ref<uint64_t> word_of(uint8_t* base, uint32_t slot) {
  return std::atomic_ref<uint64_t>(
      *reinterpret_cast<uint64_t*>(base + kSlotWordsAt + 8 * size_t{slot}));
}

}  // namespace

// The sender's arena, mapped for its life, and which of its slots hold what.
struct SharedBulk::Arena {
  std::string name;
  int fd = -1;          // kept to reserve pages before they are written (fallocate)
  size_t reserved = 0;  // the file's pages up to here exist
  uint8_t* base = nullptr;
  size_t length = 0, data_bytes = 0;
  struct Slot {
    uint64_t generation = 0;
    size_t offset = 0, length = 0;
    bool in_use = false;
    std::chrono::steady_clock::time_point since;
  };
  std::vector<Slot> slots = std::vector<Slot>(kSlots);
  size_t in_use_bytes = 0;
  ~Arena() {
    if (base != nullptr) ::munmap(base, length);
    if (fd >= 0) ::close(fd);
  }
  void release(uint32_t slot) {
    if (!slots[slot].in_use) return;
    slots[slot].in_use = false;
    in_use_bytes -= slots[slot].length;
  }
};

// An arena of another process, mapped by this receiver.
struct SharedBulk::Mapped {
  std::string name;
  ino_t inode = 0;
  uint8_t* base = nullptr;
  size_t length = 0, data_bytes = 0;
  uint32_t slots = 0;
  ~Mapped() {
    if (base != nullptr) ::munmap(base, length);
  }
};

bool has_shared_bulk_flag(const std::vector<zmq::message_t>& frames) {
  return !frames.empty() && frames[0].size() == wire::kHeaderBytes &&
         (header_flags(frames[0]) & kSharedBulkFlag) != 0;
}

SharedBulkSettings shared_bulk_settings(const std::string& mode, int64_t min_bytes,
                                        int64_t arena_bytes) {
  SharedBulkSettings settings;
  settings.enabled = mode != "off";
  if (mode != "auto" && mode != "off") settings.folder = mode;
  settings.min_bytes = static_cast<size_t>(std::max<int64_t>(0, min_bytes));
  settings.arena_bytes = static_cast<size_t>(std::max<int64_t>(0, arena_bytes));
  return settings;
}

Expected<std::unique_ptr<SharedBulk>> SharedBulk::open(const SharedBulkSettings& settings,
                                                       Registry& metrics) {
  if (!settings.enabled) return Error{"shared-memory hand-over is off", StatusCode::kUnavailable};
  if (sodium_init() < 0) return Error{"libsodium could not be initialised", StatusCode::kInternal};
  const uid_t uid = ::geteuid();
  std::string folder = settings.folder;
  if (folder.empty()) {
    struct stat shm {};
    if (::stat("/dev/shm", &shm) != 0 || !S_ISDIR(shm.st_mode))
      return Error{"no /dev/shm on this host", StatusCode::kUnavailable};
    folder = "/dev/shm/moeline-" + std::to_string(uid);
  }
  if (::mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST)
    return Error{errno_text("cannot create " + folder), StatusCode::kIoError};
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Error{errno_text("cannot open " + folder), StatusCode::kIoError};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_uid != uid || (st.st_mode & 0022) != 0) {
    ::close(fd);
    return Error{folder + " belongs to another user or others may write it: not used",
                 StatusCode::kInvalidArgument};
  }
  // The token: the same kernel, the same folder (not a namesake in another container's
  // /dev/shm), the same pid namespace (a sweep judges senders by their pid), the same user.
  struct stat pid_namespace {};
  ::stat("/proc/self/ns/pid", &pid_namespace);
  const std::string identity = first_line("/proc/sys/kernel/random/boot_id") + "|" +
                               std::to_string(st.st_dev) + "|" + std::to_string(st.st_ino) + "|" +
                               std::to_string(pid_namespace.st_ino) + "|" + std::to_string(uid);
  uint8_t hash[16];
  crypto_generichash(hash, sizeof hash, reinterpret_cast<const uint8_t*>(identity.data()),
                     identity.size(), nullptr, 0);
  auto bulk = std::unique_ptr<SharedBulk>(
      new SharedBulk(settings, fd, std::move(folder), hex(hash, sizeof hash), metrics));
  bulk->sweep(true);
  return bulk;
}

SharedBulk::SharedBulk(SharedBulkSettings settings, int folder_fd, std::string folder,
                       std::string node, Registry& metrics)
    : settings_(std::move(settings)),
      folder_fd_(folder_fd),
      folder_(std::move(folder)),
      node_(std::move(node)) {
  const char* help_sent = "Bulk transfers handed to a peer of this node through shared memory";
  sent_ = &metrics.counter("moeline_shm_handover_total", help_sent, {{"direction", "sent"}});
  received_ =
      &metrics.counter("moeline_shm_handover_total", help_sent, {{"direction", "received"}});
  const char* help_bytes = "Bulk bytes handed to a peer of this node through shared memory";
  sent_bytes_ =
      &metrics.counter("moeline_shm_handover_bytes_total", help_bytes, {{"direction", "sent"}});
  received_bytes_ =
      &metrics.counter("moeline_shm_handover_bytes_total", help_bytes, {{"direction", "received"}});
  no_room_ = &metrics.counter(
      "moeline_shm_handover_no_room_total",
      "Transfers to a peer of this node that did not fit this process's shared-memory arena (or "
      "it could not be made): the socket carried them");
  swept_ = &metrics.counter("moeline_shm_handover_swept_total",
                            "Shared-memory arenas of senders that are gone, removed");
}

SharedBulk::~SharedBulk() {
  if (arena_) {
    // Left for the sweep while a receiver may still have to read a slot (it finds the file by
    // name); nothing in flight: gone now.
    reclaim();
    if (arena_->in_use_bytes == 0) ::unlinkat(folder_fd_, arena_->name.c_str(), 0);
  }
  if (folder_fd_ >= 0) ::close(folder_fd_);
}

SharedBulk::Arena* SharedBulk::own_arena() {
  if (arena_ || arena_failed_) return arena_.get();
  uint8_t random[8];
  randombytes_buf(random, sizeof random);
  auto arena = std::make_unique<Arena>();
  arena->name = std::to_string(::getpid()) + "-" + hex(random, sizeof random) + kSuffix;
  arena->data_bytes = settings_.arena_bytes;
  arena->length = kDataAt + arena->data_bytes;
  const int fd = ::openat(folder_fd_, arena->name.c_str(),
                          O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    arena_failed_ = true;
    return nullptr;
  }
  arena->fd = fd;
  void* base = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(arena->length)) == 0 &&
      ::posix_fallocate(fd, 0, static_cast<off_t>(kDataAt)) == 0) {
    arena->reserved = kDataAt;
    base = ::mmap(nullptr, arena->length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (base == MAP_FAILED) {
    ::unlinkat(folder_fd_, arena->name.c_str(), 0);
    arena_failed_ = true;
    return nullptr;
  }
  arena->base = static_cast<uint8_t*>(base);
  ArenaHeader header{};
  std::memcpy(header.magic, kArenaMagic, sizeof header.magic);
  header.slots = kSlots;
  header.data_at = kDataAt;
  header.data_bytes = arena->data_bytes;
  std::memcpy(arena->base, &header, sizeof header);
  arena_ = std::move(arena);
  return arena_.get();
}

void SharedBulk::reclaim() {
  const auto now = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < kSlots; ++i) {
    Arena::Slot& slot = arena_->slots[i];
    if (!slot.in_use) continue;
    std::atomic_ref<uint64_t> word = word_of(arena_->base, i);
    if (word.load(std::memory_order_acquire) == slot_word(slot.generation, kDone)) {
      arena_->release(i);
    } else if (now - slot.since > settings_.stale_after) {
      // Its receiver is gone (or hopelessly late: taking it now fails, the generation moved on).
      uint64_t full = slot_word(slot.generation, kFull);
      word.compare_exchange_strong(full, slot_word(slot.generation, kFree));
      arena_->release(i);
    }
  }
}

std::optional<uint32_t> SharedBulk::export_frames(const std::string& route_node,
                                                  std::vector<zmq::message_t>& frames) {
  if (route_node.empty() || route_node != node_ || frames.size() < 3 ||
      frames[0].size() != wire::kHeaderBytes)
    return std::nullopt;
  std::vector<uint64_t> sizes;
  size_t bulk_bytes = 0;
  for (size_t i = 2; i < frames.size(); ++i) {
    sizes.push_back(frames[i].size());
    bulk_bytes += frames[i].size();
  }
  if (bulk_bytes < settings_.min_bytes) return std::nullopt;
  size_t total = 0;
  const std::vector<size_t> offsets = layout(sizes, total);
  Arena* arena = own_arena();
  if (arena == nullptr || total > arena->data_bytes) {
    no_room_->inc();
    return std::nullopt;
  }
  reclaim();
  // First fit between the slots in use, in the order of their offsets.
  std::vector<std::pair<size_t, size_t>> used;  // offset, end
  std::optional<uint32_t> free_slot;
  for (uint32_t i = 0; i < kSlots; ++i) {
    const Arena::Slot& slot = arena->slots[i];
    if (slot.in_use)
      used.emplace_back(slot.offset, slot.offset + aligned(slot.length));
    else if (!free_slot)
      free_slot = i;
  }
  std::sort(used.begin(), used.end());
  std::optional<size_t> at;
  size_t cursor = 0;
  for (const auto& [begin, end] : used) {
    if (begin >= cursor + total) break;
    cursor = std::max(cursor, end);
  }
  if (cursor + total <= arena->data_bytes) at = cursor;
  if (!free_slot || !at) {
    no_room_->inc();
    return std::nullopt;
  }
  // The pages a write is about to touch exist first: a full /dev/shm (a container's 64 MiB) is
  // an error here, where writing into a page it cannot supply would be SIGBUS. Pages stay once
  // reserved, so only the arena's first reach into new space pays for it.
  if (const size_t end = kDataAt + *at + total; end > arena->reserved) {
    if (::posix_fallocate(arena->fd, static_cast<off_t>(arena->reserved),
                          static_cast<off_t>(end - arena->reserved)) != 0) {
      no_room_->inc();
      return std::nullopt;
    }
    arena->reserved = end;
  }
  Arena::Slot& slot = arena->slots[*free_slot];
  slot = {slot.generation + 1, *at, total, true, std::chrono::steady_clock::now()};
  arena->in_use_bytes += total;
  for (size_t i = 0; i < sizes.size(); ++i)
    std::memcpy(arena->base + kDataAt + *at + offsets[i], frames[i + 2].data(), sizes[i]);
  word_of(arena->base, *free_slot)
      .store(slot_word(slot.generation, kFull), std::memory_order_release);

  zmq::message_t reference(sizeof(ReferenceHeader) + 8 * sizes.size());
  ReferenceHeader header{};
  std::memcpy(header.magic, kReferenceMagic, sizeof header.magic);
  std::memcpy(header.name, arena->name.data(), std::min(arena->name.size(), kNameBytes));
  header.slot = *free_slot;
  header.generation = slot.generation;
  header.offset = *at;
  header.count = sizes.size();
  std::memcpy(reference.data(), &header, sizeof header);
  std::memcpy(static_cast<uint8_t*>(reference.data()) + sizeof header, sizes.data(),
              8 * sizes.size());
  std::vector<zmq::message_t> replaced;
  replaced.push_back(header_with_flags(frames[0], header_flags(frames[0]) | kSharedBulkFlag));
  replaced.push_back(std::move(frames[1]));
  replaced.push_back(std::move(reference));
  frames = std::move(replaced);
  sent_->inc();
  sent_bytes_->inc(static_cast<double>(bulk_bytes));
  return *free_slot;
}

void SharedBulk::discard(uint32_t slot) {
  if (!arena_ || slot >= kSlots || !arena_->slots[slot].in_use) return;
  word_of(arena_->base, slot)
      .store(slot_word(arena_->slots[slot].generation, kFree), std::memory_order_release);
  arena_->release(slot);
}

size_t SharedBulk::arena_in_use() const {
  return arena_ ? arena_->in_use_bytes : 0;
}

Expected<SharedBulk::Mapped*> SharedBulk::mapped(const std::string& name) {
  for (auto it = mapped_.begin(); it != mapped_.end(); ++it)
    if ((*it)->name == name) {
      mapped_.splice(mapped_.begin(), mapped_, it);
      return mapped_.front().get();
    }
  if (!arena_creator(name)) return Error{"not an arena's name"};
  const int fd = ::openat(folder_fd_, name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Error{errno_text(name), StatusCode::kNotFound};
  struct stat st {};
  auto mapping = std::make_unique<Mapped>();
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      static_cast<uint64_t>(st.st_size) < kDataAt) {
    ::close(fd);
    return Error{name + " is not an arena (type, owner or size)"};
  }
  void* base =
      ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) return Error{errno_text("mmap " + name), StatusCode::kIoError};
  mapping->name = name;
  mapping->inode = st.st_ino;
  mapping->base = static_cast<uint8_t*>(base);
  mapping->length = static_cast<size_t>(st.st_size);
  ArenaHeader header{};
  std::memcpy(&header, mapping->base, sizeof header);
  if (std::memcmp(header.magic, kArenaMagic, sizeof header.magic) != 0 || header.slots == 0 ||
      header.slots > kSlots || header.data_at != kDataAt ||
      header.data_bytes != mapping->length - kDataAt)
    return Error{name + " does not have an arena's header"};
  mapping->slots = header.slots;
  mapping->data_bytes = header.data_bytes;
  // Arenas of senders that come and go: the least recently used is let go past a few dozen.
  if (mapped_.size() >= 32) mapped_.pop_back();
  mapped_.push_front(std::move(mapping));
  return mapped_.front().get();
}

Status SharedBulk::import_frames(std::vector<zmq::message_t>& frames, size_t max_bulk_bytes) {
  if (!has_shared_bulk_flag(frames)) return Status::ok_status();
  auto refuse = [](std::string message, StatusCode code = StatusCode::kInvalidArgument) {
    return Status(Error{"shared-memory hand-over: " + std::move(message), code});
  };
  if (frames.size() != 3) return refuse("a reference must be the only frame after the body");
  const zmq::message_t& reference = frames[2];
  ReferenceHeader header{};
  if (reference.size() < sizeof header) return refuse("not a reference frame");
  std::memcpy(&header, reference.data(), sizeof header);
  if (std::memcmp(header.magic, kReferenceMagic, sizeof header.magic) != 0)
    return refuse("not a reference frame");
  const size_t room = (reference.size() - sizeof header) / 8;
  if (header.count == 0 || header.count != room ||
      reference.size() != sizeof header + 8 * header.count)
    return refuse("reference frame of " + std::to_string(reference.size()) + " bytes for " +
                  std::to_string(header.count) + " frames");
  std::vector<uint64_t> sizes(header.count);
  std::memcpy(sizes.data(), static_cast<const uint8_t*>(reference.data()) + sizeof header,
              8 * header.count);
  uint64_t bulk_bytes = 0;
  for (uint64_t size : sizes) {
    if (size > max_bulk_bytes || bulk_bytes + size > max_bulk_bytes)
      return refuse("more than " + std::to_string(max_bulk_bytes) + " bulk bytes",
                    StatusCode::kResourceExhausted);
    bulk_bytes += size;
  }
  const std::string name(header.name, strnlen(header.name, kNameBytes));
  auto arena = mapped(name);
  if (!arena) return refuse(arena.error().message, arena.error().code);
  Mapped& m = **arena;
  size_t total = 0;
  const std::vector<size_t> offsets = layout(sizes, total);
  if (header.slot >= m.slots || header.offset > m.data_bytes ||
      total > m.data_bytes - header.offset)
    return refuse("slot " + std::to_string(header.slot) + " at " + std::to_string(header.offset) +
                  " is outside " + name);
  std::atomic_ref<uint64_t> word = word_of(m.base, header.slot);
  uint64_t expected = slot_word(header.generation, kFull);
  if (word.load(std::memory_order_acquire) != expected)
    return refuse("slot " + std::to_string(header.slot) + " of " + name +
                      " does not hold this transfer (taken, reclaimed or never filled)",
                  StatusCode::kNotFound);
  std::vector<zmq::message_t> restored;
  restored.push_back(header_with_flags(frames[0], header_flags(frames[0]) & ~kSharedBulkFlag));
  restored.push_back(std::move(frames[1]));
  for (size_t i = 0; i < sizes.size(); ++i)
    restored.emplace_back(m.base + kDataAt + header.offset + offsets[i], sizes[i]);
  // Done only if the sender did not reclaim the slot while it was read.
  if (!word.compare_exchange_strong(expected, slot_word(header.generation, kDone),
                                    std::memory_order_acq_rel))
    return refuse(
        "slot " + std::to_string(header.slot) + " of " + name + " was reclaimed while it was read",
        StatusCode::kNotFound);
  frames = std::move(restored);
  received_->inc();
  received_bytes_->inc(static_cast<double>(bulk_bytes));
  return Status::ok_status();
}

void SharedBulk::sweep(bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_sweep_ < std::chrono::minutes(1)) return;
  last_sweep_ = now;
  const int fd = ::dup(folder_fd_);
  if (fd < 0) return;
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    ::close(fd);
    return;
  }
  ::rewinddir(dir);
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    const std::optional<pid_t> creator = arena_creator(name);
    if (!creator || *creator == ::getpid()) continue;
    if (::kill(*creator, 0) != 0 && errno == ESRCH && ::unlinkat(folder_fd_, name.c_str(), 0) == 0)
      swept_->inc();
  }
  ::closedir(dir);
  // Let go of arenas that are gone (their sender left; a later one of that name is another file).
  std::erase_if(mapped_, [&](const std::unique_ptr<Mapped>& m) {
    struct stat st {};
    return ::fstatat(folder_fd_, m->name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
           st.st_ino != m->inode;
  });
}

}  // namespace moeline::runtime
