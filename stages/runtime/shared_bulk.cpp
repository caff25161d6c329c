#include "stages/runtime/shared_bulk.h"

#include <dirent.h>
#include <fcntl.h>
#include <sodium.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "schemas/wire.h"
#include "stages/runtime/metrics.h"

namespace moeline::runtime {
namespace {

// The reference frame, little-endian: magic, the file's name, the number of bulk frames, then
// each frame's size. The frames lie in the file in order, each at an offset aligned to
// kFrameAlignment (so they are handed out aligned, as wire::AlignedFrame wants them).
constexpr char kReferenceMagic[8] = {'M', 'O', 'E', 'L', 'S', 'H', 'M', '1'};
constexpr size_t kNameBytes = 32;  // 16 random bytes in hex
constexpr size_t kReferenceHeader = sizeof kReferenceMagic + kNameBytes + 8;
constexpr size_t kFrameAlignment = 64;
constexpr const char* kSuffix = ".bulk";

size_t aligned(size_t offset) {
  return (offset + kFrameAlignment - 1) & ~(kFrameAlignment - 1);
}

// Where each frame starts, and the file's length.
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

bool is_transfer_name(const std::string& name) {
  if (name.size() != kNameBytes + std::strlen(kSuffix) || !name.ends_with(kSuffix)) return false;
  for (size_t i = 0; i < kNameBytes; ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i])) || std::isupper(name[i])) return false;
  return true;
}

std::string random_name() {
  uint8_t bytes[kNameBytes / 2];
  randombytes_buf(bytes, sizeof bytes);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name;
  for (uint8_t b : bytes) {
    name += kHex[b >> 4];
    name += kHex[b & 15];
  }
  return name + kSuffix;
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

// One mapped file shared by the frames cut from it: unmapped when the last is released.
struct Mapping {
  void* base = nullptr;
  size_t length = 0;
  std::atomic<size_t> frames{0};
};

void release_frame(void*, void* hint) {
  auto* mapping = static_cast<Mapping*>(hint);
  if (mapping->frames.fetch_sub(1) == 1) {
    ::munmap(mapping->base, mapping->length);
    delete mapping;
  }
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

}  // namespace

bool has_shared_bulk_flag(const std::vector<zmq::message_t>& frames) {
  return !frames.empty() && frames[0].size() == wire::kHeaderBytes &&
         (header_flags(frames[0]) & kSharedBulkFlag) != 0;
}

SharedBulkSettings shared_bulk_settings(const std::string& mode, int64_t min_bytes) {
  SharedBulkSettings settings;
  settings.enabled = mode != "off";
  if (mode != "auto" && mode != "off") settings.folder = mode;
  settings.min_bytes = static_cast<size_t>(std::max<int64_t>(0, min_bytes));
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
  // /dev/shm), the same user.
  const std::string identity = boot_id() + "|" + std::to_string(st.st_dev) + "|" +
                               std::to_string(st.st_ino) + "|" + std::to_string(uid);
  uint8_t hash[16];
  crypto_generichash(hash, sizeof hash, reinterpret_cast<const uint8_t*>(identity.data()),
                     identity.size(), nullptr, 0);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string node;
  for (uint8_t b : hash) {
    node += kHex[b >> 4];
    node += kHex[b & 15];
  }
  auto bulk = std::unique_ptr<SharedBulk>(
      new SharedBulk(settings, fd, std::move(folder), std::move(node), metrics));
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
  write_failures_ = &metrics.counter(
      "moeline_shm_handover_write_failures_total",
      "Shared-memory hand-overs that could not be written (full or missing folder): the socket "
      "carried them");
  swept_ = &metrics.counter(
      "moeline_shm_handover_swept_total",
      "Shared-memory transfer files removed unreceived (their receiver went away)");
}

SharedBulk::~SharedBulk() {
  if (folder_fd_ >= 0) ::close(folder_fd_);
}

std::optional<std::string> SharedBulk::export_frames(const std::string& route_node,
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
  const std::string name = random_name();
  const int fd = ::openat(folder_fd_, name.c_str(),
                          O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    write_failures_->inc();
    return std::nullopt;
  }
  bool written = ::ftruncate(fd, static_cast<off_t>(total)) == 0;
  for (size_t i = 0; written && i < sizes.size(); ++i) {
    const auto* data = static_cast<const uint8_t*>(frames[i + 2].data());
    size_t done = 0;
    while (done < sizes[i]) {
      const ssize_t n =
          ::pwrite(fd, data + done, sizes[i] - done, static_cast<off_t>(offsets[i] + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        written = false;  // ENOSPC on a full /dev/shm, above all
        break;
      }
      done += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  if (!written) {
    ::unlinkat(folder_fd_, name.c_str(), 0);
    write_failures_->inc();
    return std::nullopt;
  }
  zmq::message_t reference(kReferenceHeader + 8 * sizes.size());
  auto* p = static_cast<uint8_t*>(reference.data());
  std::memcpy(p, kReferenceMagic, sizeof kReferenceMagic);
  std::memcpy(p + sizeof kReferenceMagic, name.data(), kNameBytes);
  const uint64_t count = sizes.size();
  std::memcpy(p + sizeof kReferenceMagic + kNameBytes, &count, 8);
  std::memcpy(p + kReferenceHeader, sizes.data(), 8 * sizes.size());
  std::vector<zmq::message_t> replaced;
  replaced.push_back(header_with_flags(frames[0], header_flags(frames[0]) | kSharedBulkFlag));
  replaced.push_back(std::move(frames[1]));
  replaced.push_back(std::move(reference));
  frames = std::move(replaced);
  sent_->inc();
  sent_bytes_->inc(static_cast<double>(bulk_bytes));
  return name;
}

void SharedBulk::discard(const std::string& name) {
  if (is_transfer_name(name)) ::unlinkat(folder_fd_, name.c_str(), 0);
}

Status SharedBulk::import_frames(std::vector<zmq::message_t>& frames, size_t max_bulk_bytes) {
  if (!has_shared_bulk_flag(frames)) return Status::ok_status();
  auto refuse = [](std::string message, StatusCode code = StatusCode::kInvalidArgument) {
    return Status(Error{"shared-memory hand-over: " + std::move(message), code});
  };
  if (frames.size() != 3) return refuse("a reference must be the only frame after the body");
  const zmq::message_t& reference = frames[2];
  const auto* p = static_cast<const uint8_t*>(reference.data());
  if (reference.size() < kReferenceHeader ||
      std::memcmp(p, kReferenceMagic, sizeof kReferenceMagic) != 0)
    return refuse("not a reference frame");
  uint64_t count = 0;
  std::memcpy(&count, p + sizeof kReferenceMagic + kNameBytes, 8);
  if (count == 0 || count > (reference.size() - kReferenceHeader) / 8 ||
      reference.size() != kReferenceHeader + 8 * count)
    return refuse("reference frame of " + std::to_string(reference.size()) + " bytes for " +
                  std::to_string(count) + " frames");
  std::vector<uint64_t> sizes(count);
  std::memcpy(sizes.data(), p + kReferenceHeader, 8 * count);
  uint64_t bulk_bytes = 0;
  for (uint64_t size : sizes) {
    if (size > max_bulk_bytes || bulk_bytes + size > max_bulk_bytes)
      return refuse("more than " + std::to_string(max_bulk_bytes) + " bulk bytes",
                    StatusCode::kResourceExhausted);
    bulk_bytes += size;
  }
  const std::string name =
      std::string(reinterpret_cast<const char*>(p + sizeof kReferenceMagic), kNameBytes) + kSuffix;
  if (!is_transfer_name(name)) return refuse("not a transfer's file name");
  const int fd = ::openat(folder_fd_, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return refuse(errno_text(name), StatusCode::kNotFound);
  ::unlinkat(folder_fd_, name.c_str(), 0);  // claimed: whatever happens next, no one else takes it
  size_t total = 0;
  const std::vector<size_t> offsets = layout(sizes, total);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      static_cast<uint64_t>(st.st_size) != total) {
    ::close(fd);
    return refuse(name + " is not the reference's file (type, owner or size)");
  }
  void* base =
      total == 0 ? nullptr : ::mmap(nullptr, total, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) return refuse(errno_text("mmap " + name), StatusCode::kIoError);
  std::vector<zmq::message_t> restored;
  restored.push_back(header_with_flags(frames[0], header_flags(frames[0]) & ~kSharedBulkFlag));
  restored.push_back(std::move(frames[1]));
  auto* mapping = new Mapping{base, total};
  mapping->frames = 1;  // held until every frame is made, so an early release cannot unmap
  for (size_t i = 0; i < count; ++i) {
    if (sizes[i] == 0) {
      restored.emplace_back();
      continue;
    }
    mapping->frames.fetch_add(1);
    restored.emplace_back(static_cast<uint8_t*>(base) + offsets[i], sizes[i], &release_frame,
                          mapping);
  }
  release_frame(nullptr, mapping);
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
  const auto stale = std::chrono::system_clock::now() - settings_.stale_after;
  const time_t stale_seconds = std::chrono::system_clock::to_time_t(stale);
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (!is_transfer_name(name)) continue;
    struct stat st {};
    if (::fstatat(folder_fd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (st.st_mtime < stale_seconds && ::unlinkat(folder_fd_, name.c_str(), 0) == 0) swept_->inc();
  }
  ::closedir(dir);
}

}  // namespace moeline::runtime
