#include "offload/expert_pool.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "offload/pool_eviction.h"
#include "offload/pool_layout.h"

namespace moeline::offload {

using namespace pool_detail;

namespace {

void init_sync(PoolLayout* layout) {
  pthread_mutexattr_t mutex_attr;
  pthread_mutexattr_init(&mutex_attr);
  pthread_mutexattr_setpshared(&mutex_attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&mutex_attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&layout->mutex, &mutex_attr);
  pthread_mutexattr_destroy(&mutex_attr);
}

// Offsets of gate, up and down inside a slot.
std::array<size_t, 3> slot_offsets(const ExpertCatalog::Expert& expert) {
  const size_t gate = 0;
  const size_t up = round_up(gate + expert.shape.gate.bytes(), kMatrixAlign);
  const size_t down = round_up(up + expert.shape.up.bytes(), kMatrixAlign);
  return {gate, up, down};
}

constexpr uint64_t kOwnerSilenceNs = 2'000'000'000;        // no heartbeat for this long: owner gone
constexpr uint64_t kLiveClientSilenceNs = 30'000'000'000;  // ... for a client still running

uint64_t heartbeat_of(const PoolLayout* l) {
  return __atomic_load_n(&l->heartbeat_ns, __ATOMIC_ACQUIRE);
}

bool owner_alive_at(const PoolLayout* l, uint64_t now) {
  const uint64_t beat = heartbeat_of(l);
  return beat != 0 && now - std::min(now, beat) < kOwnerSilenceNs;
}

}  // namespace

bool ExpertCatalog::has(int layer, int expert) const {
  if (layer < 0 || layer >= layers || expert < 0 || expert >= experts_per_layer) return false;
  return at(layer, expert).shape.bytes() > 0;
}

const ExpertCatalog::Expert& ExpertCatalog::at(int layer, int expert) const {
  return experts[static_cast<size_t>(layer) * static_cast<size_t>(experts_per_layer) +
                 static_cast<size_t>(expert)];
}

uint64_t ExpertCatalog::total_expert_bytes() const {
  uint64_t total = 0;
  for (const Expert& e : experts) total += e.shape.bytes();
  return total;
}

uint64_t ExpertCatalog::pool_bytes_for_all() const {
  uint64_t present = 0;
  for (const Expert& e : experts) present += e.shape.bytes() > 0 ? 1 : 0;
  return present * pool_slot_bytes(*this);
}

int ExpertCatalog::moe_layers() const {
  int count = 0;
  for (int l = 0; l < layers; ++l)
    for (int e = 0; e < experts_per_layer; ++e)
      if (has(l, e)) {
        ++count;
        break;
      }
  return count;
}

uint64_t parse_expert_budget(const std::string& text, uint64_t total_expert_bytes) {
  const std::string usage = "expert budget '" + text +
                            "': expected a share of the experts (\"25%\") or a size in "
                            "bytes with an optional unit (\"512MiB\", \"1.5GB\", \"4096\")";
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument(usage);
  }
  if (!std::isfinite(value) || value <= 0) throw std::invalid_argument(usage);
  std::string unit = text.substr(used);
  unit.erase(std::remove(unit.begin(), unit.end(), ' '), unit.end());
  if (unit == "%") {
    if (value > 100) throw std::invalid_argument(usage + " (a share is at most 100%)");
    return static_cast<uint64_t>(std::floor(static_cast<double>(total_expert_bytes) * value / 100));
  }
  static const std::pair<const char*, double> units[] = {{"", 1},
                                                         {"B", 1},
                                                         {"KB", 1e3},
                                                         {"MB", 1e6},
                                                         {"GB", 1e9},
                                                         {"TB", 1e12},
                                                         {"KiB", 1024.0},
                                                         {"MiB", 1048576.0},
                                                         {"GiB", 1073741824.0},
                                                         {"TiB", 1099511627776.0},
                                                         {"K", 1024.0},
                                                         {"M", 1048576.0},
                                                         {"G", 1073741824.0},
                                                         {"T", 1099511627776.0}};
  // Case does not matter ("512mib", "8g"); KB is 1000, KiB and a bare K are 1024 (as docker's
  // sizes).
  auto lower = [](std::string word) {
    for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return word;
  };
  for (const auto& [name, scale] : units)
    if (lower(unit) == lower(name)) return static_cast<uint64_t>(std::floor(value * scale));
  throw std::invalid_argument(usage);
}

double expert_budget_fraction(const std::string& text, uint64_t total_expert_bytes) {
  return static_cast<double>(parse_expert_budget(text, total_expert_bytes)) /
         static_cast<double>(std::max<uint64_t>(total_expert_bytes, 1));
}

double expected_reuse_distance(int32_t layer, int32_t current, int32_t cycle, double uses,
                               double visits) {
  // Layer steps until `layer` runs again (a full cycle for the layer running now: its experts
  // that are not pinned were not needed this time), then whole cycles while the expert is not
  // picked, with p estimated as (uses + 1/2) / (visits + 1).
  const int32_t until = layer == current ? cycle : layers_until(layer, current, cycle);
  const double p = pick_probability(uses, visits);
  return static_cast<double>(until) + static_cast<double>(cycle) * (1.0 / p - 1.0);
}

uint64_t pool_slot_bytes(const ExpertCatalog& catalog) {
  size_t largest = 0;
  for (const ExpertCatalog::Expert& e : catalog.experts)
    if (e.shape.bytes() > 0) largest = std::max(largest, slot_offsets(e)[2] + e.shape.down.bytes());
  return round_up(largest, kPage);
}

double PoolStats::load_us_quantile(double q) const {
  uint64_t total = 0;
  for (uint64_t n : load_us_buckets) total += n;
  if (total == 0) return 0;
  const double want = q * static_cast<double>(total);
  uint64_t seen = 0;
  for (int i = 0; i < kLoadBuckets; ++i) {
    seen += load_us_buckets[static_cast<size_t>(i)];
    if (static_cast<double>(seen) >= want) return std::ldexp(1.0, i);
  }
  return std::ldexp(1.0, kLoadBuckets);
}

PoolMapping::~PoolMapping() {
  if (data_) munmap(data_, data_bytes_);
  if (layout_) munmap(layout_, layout_bytes_);
  if (fd_ >= 0) close(fd_);
}

void ExpertPool::set_prefetch_enabled(PrefetchKind kind, bool enabled) {
  PoolLock lock(layout_);
  layout_->counters.prefetch_off[static_cast<size_t>(kind)] = enabled ? 0 : 1;
}

PoolStats PoolMapping::stats() const {
  PoolStats s;
  PoolLock lock(layout_);
  const PoolCounters& c = layout_->counters;
  s.slots = layout_->slots;
  s.slot_bytes = layout_->slot_bytes;
  const PoolEntry* entries = layout_->entry_table();
  for (uint32_t i = 0; i < layout_->entries; ++i) {
    if (entries[i].state == kResident) ++s.resident;
    if (entries[i].pins > 0) ++s.pinned;
  }
  static_cast<PoolCounters&>(s) = c;
  s.layer_hits.assign(layout_->layer_hits(), layout_->layer_hits() + layout_->layers);
  s.layer_misses.assign(layout_->layer_misses(), layout_->layer_misses() + layout_->layers);
  return s;
}

std::unique_ptr<ExpertPool> ExpertPool::create_or_throw(const ExpertCatalog& catalog,
                                                        const Options& options) {
  if (options.name.empty() || options.name[0] != '/' ||
      options.name.find('/', 1) != std::string::npos)
    throw StatusError("expert pool name '" + options.name +
                      "' must start with '/' and contain no other '/'");
  uint32_t present = 0;
  for (const ExpertCatalog::Expert& e : catalog.experts)
    if (e.shape.bytes() > 0) ++present;
  if (present == 0) throw StatusError("the model has no experts to pool");
  const uint64_t slot_bytes = pool_slot_bytes(catalog);
  if (options.budget_bytes < slot_bytes)
    throw StatusError("expert budget of " + std::to_string(options.budget_bytes) +
                      " bytes is less than one expert (" + std::to_string(slot_bytes) +
                      " bytes with alignment)");
  const uint64_t slots = std::min<uint64_t>(options.budget_bytes / slot_bytes, present);
  const auto entries =
      static_cast<uint32_t>(catalog.layers) * static_cast<uint32_t>(catalog.experts_per_layer);
  const size_t layout_bytes =
      PoolLayout::bytes_for(entries, slots, static_cast<uint32_t>(catalog.layers),
                            static_cast<uint32_t>(catalog.experts_per_layer));
  const size_t data_bytes = slots * slot_bytes;

  std::unique_ptr<ExpertPool> pool(new ExpertPool());
  pool->name_ = options.name;
  pool->catalog_ = catalog;
  pool->options_ = options;
  int fd = shm_open(options.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    // Left behind by an owner that died? Take it over only then.
    // (Its heartbeat: a restarted offload manager may find its predecessor's pool a moment after
    // the crash, so a recent heartbeat is watched until it is stale or moves.)
    const int old = shm_open(options.name.c_str(), O_RDONLY, 0);
    if (old >= 0) {
      struct stat st {};
      if (fstat(old, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(PoolLayout)) {
        void* header = mmap(nullptr, sizeof(PoolLayout), PROT_READ, MAP_SHARED, old, 0);
        if (header != MAP_FAILED) {
          const auto* previous = static_cast<const PoolLayout*>(header);
          const uint64_t first = heartbeat_of(previous);
          bool alive = false;
          while (owner_alive_at(previous, now_ns())) {
            if (heartbeat_of(previous) != first) {
              alive = true;
              break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
          const int32_t old_pid = previous->owner_pid;
          munmap(header, sizeof(PoolLayout));
          if (alive) {
            close(old);
            throw StatusError("expert pool " + options.name +
                                  " is owned by a running process (pid " + std::to_string(old_pid) +
                                  " in its namespace)",
                              StatusCode::kUnavailable);
          }
        }
      }
      close(old);
    }
    shm_unlink(options.name.c_str());
    fd = shm_open(options.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0)
    throw StatusError("cannot create expert pool " + options.name + ": " + errno_text(errno),
                      StatusCode::kIoError);
  pool->fd_ = fd;
  // Reserve the memory now: a tmpfs that runs out later would SIGBUS the first loader to touch
  // an unbacked page, instead of this clear error at start.
  const int sized = ftruncate(fd, static_cast<off_t>(layout_bytes + data_bytes)) != 0
                        ? errno
                        : posix_fallocate(fd, 0, static_cast<off_t>(layout_bytes + data_bytes));
  if (sized != 0) {
    shm_unlink(options.name.c_str());
    throw StatusError("cannot reserve " + std::to_string(layout_bytes + data_bytes) +
                          " bytes of shared memory for expert pool " + options.name + ": " +
                          errno_text(sized) +
                          " (is /dev/shm large enough? docker: shm_size; or lower --expert-budget)",
                      StatusCode::kResourceExhausted);
  }
  void* layout = mmap(nullptr, layout_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* data = mmap(nullptr, data_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                    static_cast<off_t>(layout_bytes));
  if (layout == MAP_FAILED || data == MAP_FAILED) {
    const int error = errno;
    shm_unlink(options.name.c_str());
    throw StatusError("cannot map expert pool " + options.name + ": " + errno_text(error),
                      StatusCode::kIoError);
  }
  pool->layout_ = static_cast<PoolLayout*>(layout);
  pool->layout_bytes_ = layout_bytes;
  pool->data_ = static_cast<std::byte*>(data);
  pool->data_bytes_ = data_bytes;

  PoolLayout* l = pool->layout_;
  std::memset(static_cast<void*>(l), 0, layout_bytes);
  l->version = kVersion;
  l->layers = static_cast<uint32_t>(catalog.layers);
  l->experts_per_layer = static_cast<uint32_t>(catalog.experts_per_layer);
  l->entries = entries;
  l->slots = slots;
  l->slot_bytes = slot_bytes;
  l->model_id = catalog.model_id;
  l->layout_bytes = layout_bytes;
  l->data_bytes = data_bytes;
  l->owner_pid = getpid();
  l->heartbeat_ns = now_ns();
  init_sync(l);
  for (uint32_t i = 0; i < entries; ++i) l->entry_table()[i].slot = -1;
  for (uint64_t s = 0; s < slots; ++s) l->slot_owner()[s] = -1;

  // Open every file the experts live in; O_DIRECT where the filesystem allows it.
  bool all_direct = options.direct_io;
  for (const std::filesystem::path& path : catalog.files) {
    int file = -1;
    if (options.direct_io) {
      file = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
      // Some filesystems accept O_DIRECT at open and refuse the reads: try one page now.
      if (file >= 0) {
        void* page = nullptr;
        const bool readable =
            posix_memalign(&page, kPage, kPage) == 0 && pread(file, page, kPage, 0) >= 0;
        std::free(page);
        if (!readable) {
          close(file);
          file = -1;
        }
      }
    }
    if (file < 0) {
      all_direct = false;
      file = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    }
    if (file < 0)
      throw StatusError("cannot open " + path.string() + ": " + errno_text(errno),
                        StatusCode::kIoError);
    pool->files_.push_back(file);
  }
  l->counters.direct_io = all_direct ? 1 : 0;
  std::atomic_thread_fence(std::memory_order_release);
  l->magic = kMagic;  // last: a client that sees it sees a complete pool
  for (int i = 0; i < std::max(1, options.loader_threads); ++i)
    pool->loaders_.emplace_back([p = pool.get(), i] { p->loader_loop(i); });
  pool->loaders_.emplace_back([p = pool.get()] {
    for (int beat = 0; !p->stopping_; ++beat) {
      __atomic_store_n(&p->layout_->heartbeat_ns, now_ns(), __ATOMIC_RELEASE);
      if (beat % 5 == 0) p->reclaim_dead_clients();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  return pool;
}

ExpertPool::~ExpertPool() {
  stopping_ = true;
  if (layout_) {
    {
      PoolLock lock(layout_);
      layout_->stopping = 1;
      notify(&layout_->requests);
      notify(&layout_->changed);
    }
  }
  for (std::thread& t : loaders_) t.join();
  for (int file : files_) close(file);
  if (!name_.empty() && !unlinked_) shm_unlink(name_.c_str());
}

uint64_t ExpertPool::slots() const {
  return layout_->slots;
}

void ExpertPool::make_private() {
  if (!name_.empty()) shm_unlink(name_.c_str());
  unlinked_ = true;
}

void ExpertPool::reclaim_dead_clients() {
  PoolLock lock(layout_);
  PoolLayout* l = layout_;
  const uint64_t now = now_ns();
  bool freed = false;
  for (uint32_t c = 0; c < kMaxClients; ++c) {
    PoolClientSlot& client = l->clients()[c];
    if (!client.in_use) continue;
    const uint64_t beat = __atomic_load_n(&client.heartbeat_ns, __ATOMIC_ACQUIRE);
    const uint64_t silent = now - std::min(now, beat);
    if (silent < kOwnerSilenceNs) continue;
    // Taking back the pins of a live process would let it compute on a reused slot. A process
    // this one can see (same PID namespace) is given far longer before its silence counts (a
    // starved heartbeat thread); one it cannot see (another container) has only its heartbeat.
    if ((kill(client.pid, 0) == 0 || errno != ESRCH) && silent < kLiveClientSilenceNs) continue;
    uint16_t* pins = l->client_pins(c);
    for (uint32_t i = 0; i < l->entries; ++i) {
      PoolEntry& e = l->entry_table()[i];
      e.pins -= std::min<uint32_t>(e.pins, pins[i]);
      pins[i] = 0;
    }
    client.in_use = 0;
    ++l->counters.clients_reclaimed;
    freed = true;
  }
  if (freed) notify(&l->changed);
}

void ExpertPool::loader_loop(int /*index*/) {
  std::vector<std::byte> bounce;
  PoolEntry* entries = layout_->entry_table();
  while (!stopping_) {
    uint32_t pick = UINT32_MAX;
    {
      PoolLock lock(layout_);
      // Demand before prefetch, then the oldest request.
      for (uint32_t i = 0; i < layout_->entries; ++i) {
        const PoolEntry& e = entries[i];
        if (e.state != kQueued) continue;
        if (pick == UINT32_MAX || e.demanded > entries[pick].demanded ||
            (e.demanded == entries[pick].demanded && e.request_tick < entries[pick].request_tick))
          pick = i;
      }
      if (pick == UINT32_MAX) {
        lock.wait(&layout_->requests, 200);
        continue;
      }
      entries[pick].state = kReading;
    }
    load(pick, 0, bounce);
  }
}

void ExpertPool::load(uint32_t entry_index, int, std::vector<std::byte>& bounce) {
  PoolEntry& entry = layout_->entry_table()[entry_index];
  const ExpertCatalog::Expert& expert = catalog_.experts[entry_index];
  std::byte* slot = data_ + static_cast<size_t>(entry.slot) * layout_->slot_bytes;
  const std::array<size_t, 3> offsets = slot_offsets(expert);
  const uint64_t started = now_ns();
  int error = 0;
  uint64_t bytes = 0;
  bool direct = layout_->counters.direct_io != 0;
  // One read of the span covering the three matrices when they lie close together in one file
  // (as checkpoints write them), else one read each; aligned for O_DIRECT, through `bounce`.
  auto read_span = [&](uint32_t file, uint64_t offset, uint64_t length) -> const std::byte* {
    const uint64_t start = offset / kPage * kPage;
    const uint64_t end = round_up(offset + length, kPage);
    const size_t need = static_cast<size_t>(end - start) + kPage;
    if (bounce.size() < need) bounce.resize(need);
    auto* aligned =
        reinterpret_cast<std::byte*>(round_up(reinterpret_cast<uintptr_t>(bounce.data()), kPage));
    uint64_t done = 0;
    while (done < end - start) {
      const ssize_t n = pread(files_[file], aligned + done, static_cast<size_t>(end - start - done),
                              static_cast<off_t>(start + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        error = errno;
        return nullptr;
      }
      if (n == 0) break;  // end of file: the last page is short
      done += static_cast<uint64_t>(n);
    }
    if (done < offset + length - start) {
      error = EIO;
      return nullptr;
    }
    if (!direct)  // keep the page cache from becoming a second, unbounded pool
      posix_fadvise(files_[file], static_cast<off_t>(start), static_cast<off_t>(end - start),
                    POSIX_FADV_DONTNEED);
    bytes += end - start;
    return aligned + (offset - start);
  };
  const auto& r = expert.ranges;
  const uint64_t first = std::min({r[0].offset, r[1].offset, r[2].offset});
  const uint64_t last =
      std::max({r[0].offset + r[0].bytes, r[1].offset + r[1].bytes, r[2].offset + r[2].bytes});
  const uint64_t useful = r[0].bytes + r[1].bytes + r[2].bytes;
  if (r[0].file == r[1].file && r[1].file == r[2].file && last - first <= 2 * useful) {
    if (const std::byte* span = read_span(r[0].file, first, last - first))
      for (int m = 0; m < 3; ++m)
        std::memcpy(slot + offsets[static_cast<size_t>(m)],
                    span + (r[static_cast<size_t>(m)].offset - first),
                    r[static_cast<size_t>(m)].bytes);
  } else {
    for (int m = 0; m < 3 && error == 0; ++m)
      if (const std::byte* part =
              read_span(r[static_cast<size_t>(m)].file, r[static_cast<size_t>(m)].offset,
                        r[static_cast<size_t>(m)].bytes))
        std::memcpy(slot + offsets[static_cast<size_t>(m)], part, r[static_cast<size_t>(m)].bytes);
  }
  const uint64_t took = now_ns() - started;
  PoolLock lock(layout_);
  PoolCounters& c = layout_->counters;
  if (error != 0) {
    // The slot goes back to the free list; waiters see the failure.
    layout_->slot_owner()[entry.slot] = -1;
    entry.slot = -1;
    entry.state = kFailed;
    entry.error = error;
  } else {
    entry.state = kResident;
    ++c.loads;
    if (entry.prefetched) ++c.prefetch_loads;
    c.bytes_loaded += bytes;
    c.load_ns += took;
    const uint64_t us = took / 1000;
    int bucket = 0;
    while (bucket < PoolStats::kLoadBuckets - 1 && (uint64_t{1} << bucket) <= us) ++bucket;
    ++c.load_us_buckets[bucket];
  }
  notify(&layout_->changed);
}

std::unique_ptr<PoolClient> PoolClient::attach_or_throw(const std::string& name,
                                                        const ExpertCatalog& catalog) {
  std::unique_ptr<PoolClient> client(new PoolClient());
  client->name_ = name;
  client->catalog_ = catalog;
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0)
    throw StatusError("cannot open expert pool " + name + ": " + errno_text(errno) +
                          " (is the offload manager running with --expert-budget?)",
                      StatusCode::kUnavailable);
  client->fd_ = fd;
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(PoolLayout))
    throw StatusError("expert pool " + name + " is not initialised", StatusCode::kUnavailable);
  auto* header =
      static_cast<PoolLayout*>(mmap(nullptr, sizeof(PoolLayout), PROT_READ, MAP_SHARED, fd, 0));
  if (header == MAP_FAILED)
    throw StatusError("cannot map expert pool " + name, StatusCode::kIoError);
  const PoolLayout copy = *header;
  munmap(header, sizeof(PoolLayout));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (copy.magic != kMagic || copy.version != kVersion)
    throw StatusError("expert pool " + name + " has another format or is not ready",
                      StatusCode::kUnavailable);
  if (copy.model_id != catalog.model_id || copy.layers != static_cast<uint32_t>(catalog.layers) ||
      copy.experts_per_layer != static_cast<uint32_t>(catalog.experts_per_layer))
    throw StatusError("expert pool " + name + " holds another model", StatusCode::kInvalidArgument);
  if (static_cast<uint64_t>(st.st_size) < copy.layout_bytes + copy.data_bytes)
    throw StatusError("expert pool " + name + " is truncated", StatusCode::kCorruption);
  void* layout = mmap(nullptr, copy.layout_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  // The experts' bytes: read-only here; only the owner's loaders write them.
  void* data = mmap(nullptr, copy.data_bytes, PROT_READ, MAP_SHARED, fd,
                    static_cast<off_t>(copy.layout_bytes));
  if (layout == MAP_FAILED || data == MAP_FAILED)
    throw StatusError("cannot map expert pool " + name + ": " + errno_text(errno),
                      StatusCode::kIoError);
  client->layout_ = static_cast<PoolLayout*>(layout);
  client->layout_bytes_ = copy.layout_bytes;
  client->data_ = static_cast<std::byte*>(data);
  client->data_bytes_ = copy.data_bytes;
  client->offsets_.reserve(catalog.experts.size());
  for (const ExpertCatalog::Expert& e : catalog.experts)
    client->offsets_.push_back(slot_offsets(e));
  {
    PoolLock lock(client->layout_);
    PoolLayout* l = client->layout_;
    for (uint32_t c = 0; c < kMaxClients && client->client_ < 0; ++c) {
      if (l->clients()[c].in_use) continue;
      l->clients()[c].in_use = 1;
      l->clients()[c].pid = getpid();
      l->clients()[c].heartbeat_ns = now_ns();
      l->clients()[c].decode_layer = -1;
      l->clients()[c].decode_layer_ns = 0;
      l->clients()[c].wanted_layer = -1;
      std::fill_n(l->client_wanted(c), l->wanted_words(), uint64_t{0});
      client->generation_ = ++l->clients()[c].generation;
      std::fill_n(l->client_pins(c), l->entries, uint16_t{0});
      client->client_ = static_cast<int32_t>(c);
    }
    if (client->client_ < 0)
      throw StatusError("expert pool " + name + " has " + std::to_string(kMaxClients) +
                            " clients attached already",
                        StatusCode::kResourceExhausted);
  }
  client->heartbeat_ = std::thread([c = client.get()] {
    while (!c->detaching_) {
      __atomic_store_n(&c->layout_->clients()[c->client_].heartbeat_ns, now_ns(), __ATOMIC_RELEASE);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  return client;
}

namespace {

// The boundary: what the pool's setup throws becomes an Error with its code.
template <class Make>
auto as_expected(Make make) -> Expected<decltype(make())> {
  try {
    return make();
  } catch (const StatusError& e) {
    return e.error();
  } catch (const std::system_error& e) {  // a loader or heartbeat thread that could not start
    return Error{e.what(), StatusCode::kResourceExhausted};
  } catch (const std::bad_alloc&) {
    return Error{"out of memory setting up the expert pool", StatusCode::kResourceExhausted};
  }
}

}  // namespace

Expected<std::unique_ptr<ExpertPool>> ExpertPool::create(const ExpertCatalog& catalog,
                                                         const Options& options) {
  return as_expected([&] { return create_or_throw(catalog, options); });
}

Expected<std::unique_ptr<PoolClient>> PoolClient::attach(const std::string& name,
                                                         const ExpertCatalog& catalog) {
  return as_expected([&] { return attach_or_throw(name, catalog); });
}

PoolClient::~PoolClient() {
  if (client_ < 0 || !layout_) return;
  detaching_ = true;
  if (heartbeat_.joinable()) heartbeat_.join();
  // Pins still held (an engine torn down mid-forward) go back with the client.
  PoolLock lock(layout_);
  if (!owns_row()) return;
  uint16_t* pins = layout_->client_pins(static_cast<uint32_t>(client_));
  for (uint32_t i = 0; i < layout_->entries; ++i) {
    PoolEntry& e = layout_->entry_table()[i];
    e.pins -= std::min<uint32_t>(e.pins, pins[i]);
    pins[i] = 0;
  }
  layout_->clients()[client_].in_use = 0;
  notify(&layout_->changed);
}

bool PoolClient::owns_row() const {
  const PoolClientSlot& row = layout_->clients()[client_];
  return row.in_use && row.generation == generation_;
}

ExpertWeights PoolClient::views(uint32_t entry, int32_t slot) const {
  const ExpertCatalog::Expert& expert = catalog_.experts[entry];
  const std::byte* base = data_ + static_cast<size_t>(slot) * layout_->slot_bytes;
  ExpertWeights w = expert.shape;
  w.gate.data = base + offsets_[entry][0];
  w.up.data = base + offsets_[entry][1];
  w.down.data = base + offsets_[entry][2];
  return w;
}

std::optional<ExpertWeights> PoolClient::acquire_or_fail(int layer, int expert, bool may_wait) {
  if (!catalog_.has(layer, expert))
    throw StatusError("no expert " + std::to_string(expert) + " in layer " + std::to_string(layer),
                      StatusCode::kInternal);
  const auto index = static_cast<uint32_t>(layer * catalog_.experts_per_layer + expert);
  PoolLock lock(layout_);
  PoolLayout* l = layout_;
  // A caller already holding pins takes no more than its share of the slots (half the pool split
  // among the attached clients): pinned experts cannot be evicted, and processes each pinning a
  // layer's worth would leave the policy no choice of victim (docs/PERFORMANCE.md, "The shared
  // pool under a serving load"). The caller computes what it holds and asks again.
  if (!may_wait && pins_held_ >= pin_share(l)) return std::nullopt;
  PoolEntry& e = l->entry_table()[index];
  PoolCounters& c = l->counters;
  uint64_t waited_since = 0;
  bool missed = false;
  // A load another caller's demand started, which this one waits for: a miss, but one that reads
  // nothing (what a replay of the traces, which has no loads in flight, calls a hit). Waiting for
  // a prefetch no demand has joined yet is counted as late prefetch instead.
  const bool already_loading = (e.state == kQueued || e.state == kReading) && e.demanded;
  // A new pass through this layer (by this client), and this expert's use in it. A prefill
  // batch's sweep is not counted: it would make every expert look as often picked as any other.
  const bool streaming = streaming_.load(std::memory_order_relaxed);
  if (!streaming) {
    double& visits = l->layer_visits()[layer];
    if (layer != current_layer_) {
      current_layer_ = layer;
      visits += 1;
    }
    if (e.use_visit != visits) {
      e.use_visit = visits;
      e.uses += 1;
    }
    PoolClientSlot& row = l->clients()[client_];
    if (owns_row()) {
      row.decode_layer = layer;
      row.decode_layer_ns = now_ns();
    }
  }
  for (;;) {
    if (l->stopping)
      throw StatusError("expert pool " + name_ + " is shutting down", StatusCode::kUnavailable);
    if (!owns_row())
      throw StatusError(
          "expert pool " + name_ + ": this process's pins were taken back (its heartbeat stopped)",
          StatusCode::kUnavailable);
    if (e.state == kResident) {
      if (!streaming) e.streamed = 0;
      PoolClientSlot& self = l->clients()[client_];
      if (self.wanted_layer == layer && owns_row())
        l->set_wanted(static_cast<uint32_t>(client_), static_cast<uint32_t>(expert), false);
      ++e.pins;
      ++pins_held_;
      ++l->client_pins(static_cast<uint32_t>(client_))[index];
      e.previous_use = e.last_use;
      e.last_use = ++l->tick;
      if (e.prefetched) {
        ++c.prefetch_used;
        ++c.prefetch_by_kind[e.prefetched - 1u].used;
        e.prefetched = 0;
      }
      if (!missed) {
        ++c.hits;
        ++l->layer_hits()[layer];
      }
      if (waited_since) c.stall_ns += now_ns() - waited_since;
      return views(index, e.slot);
    }
    if (e.state == kFailed) {
      const int error = e.error;
      e.state = kAbsent;  // the next caller tries again
      throw StatusError("expert " + std::to_string(expert) + " of layer " + std::to_string(layer) +
                            " could not be read: " + errno_text(error),
                        StatusCode::kIoError);
    }
    if (e.state == kAbsent) {
      const int64_t slot = reserve_slot(l, layer, false, 0);
      if (slot < 0 && !may_wait) {
        if (waited_since) c.stall_ns += now_ns() - waited_since;
        return std::nullopt;
      }
      if (slot >= 0) queue_load(l, index, slot, 0, streaming);
    } else if (!e.demanded) {
      if (e.prefetched) {
        ++c.prefetch_late;
        ++c.prefetch_by_kind[e.prefetched - 1u].late;
      }
      e.demanded = 1;
    }
    if (!missed && e.state != kAbsent) {
      missed = true;
      ++c.misses;
      if (already_loading) ++c.joined;
      ++l->layer_misses()[layer];
    }
    if (!waited_since) waited_since = now_ns();
    lock.wait(&l->changed, 500);
    if (!owner_alive_at(l, now_ns()))
      throw StatusError("expert pool " + name_ + ": its owner (offload manager) is gone",
                        StatusCode::kUnavailable);
  }
}

bool PoolClient::owner_alive() const {
  return owner_alive_at(layout_, now_ns());
}

ExpertWeights PoolClient::acquire(int layer, int expert) {
  return *acquire_or_fail(layer, expert, true);
}

std::optional<ExpertWeights> PoolClient::try_acquire(int layer, int expert) {
  return acquire_or_fail(layer, expert, false);
}

void PoolClient::release(int layer, int expert) {
  if (!catalog_.has(layer, expert)) return;
  const auto index = static_cast<uint32_t>(layer * catalog_.experts_per_layer + expert);
  PoolLock lock(layout_);
  if (!owns_row()) return;  // its pins were taken back already
  PoolEntry& e = layout_->entry_table()[index];
  uint16_t& mine = layout_->client_pins(static_cast<uint32_t>(client_))[index];
  if (mine == 0) return;  // not pinned by this client (or taken back after a stall)
  --mine;
  --pins_held_;
  if (e.pins > 0 && --e.pins == 0) notify(&layout_->changed);
}

void PoolClient::expect(int layer, std::span<const int32_t> experts) {
  if (layer < 0 || layer >= catalog_.layers) return;
  PoolLock lock(layout_);
  PoolLayout* l = layout_;
  if (!owns_row()) return;
  const auto c = static_cast<uint32_t>(client_);
  std::fill_n(l->client_wanted(c), l->wanted_words(), uint64_t{0});
  for (int32_t expert : experts)
    if (catalog_.has(layer, expert)) l->set_wanted(c, static_cast<uint32_t>(expert), true);
  l->clients()[c].wanted_layer = layer;
  l->clients()[c].wanted_ns = now_ns();
}

void PoolClient::prefetch(int layer, std::span<const int32_t> experts) {
  const auto kind = static_cast<size_t>(
      streaming_.load(std::memory_order_relaxed) ? PrefetchKind::kPrefill : PrefetchKind::kDecode);
  PoolLock lock(layout_);
  PoolLayout* l = layout_;
  if (l->counters.prefetch_off[kind]) return;  // the offload manager found it does not pay
  for (int32_t expert : experts) {
    if (!catalog_.has(layer, expert)) continue;
    const auto index = static_cast<uint32_t>(layer * catalog_.experts_per_layer + expert);
    if (l->entry_table()[index].state != kAbsent) continue;
    // Expected when its layer next runs, a few steps ahead of the caller's current layer.
    const int32_t until = layers_until(layer, current_layer_, static_cast<int32_t>(l->layers));
    const int64_t slot = reserve_slot(l, current_layer_, true, static_cast<double>(until));
    if (slot < 0) {
      ++l->counters.prefetch_dropped;
      continue;
    }
    queue_load(l, index, slot, static_cast<uint8_t>(kind + 1), false);
    ++l->counters.prefetch_requests;
    ++l->counters.prefetch_by_kind[kind].requests;
  }
}

}  // namespace moeline::offload
