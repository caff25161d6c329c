#pragma once
// The expert pool's shared memory as every attached process maps it — the header, the page table
// (PoolEntry), the client table (PoolClientSlot) and the tables after them — with its lock and
// wake-ups: what the pool's owner and clients (expert_pool.cpp) and its eviction choice
// (pool_eviction.cpp) share. Internal to offload/.

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>

#include "offload/expert_pool.h"

namespace moeline::offload {

namespace pool_detail {

constexpr uint64_t kMagic = 0x4c4f4f504c454f4dULL;  // "MOELPOOL"
constexpr uint32_t kVersion = 4;  // 2: streamed entries, clients' layers; 3: wanted; 4: joined
constexpr size_t kPage = 4096;
constexpr size_t kMatrixAlign = 64;

enum EntryState : uint8_t { kAbsent, kQueued, kReading, kResident, kFailed };

inline size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

inline uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

inline std::string errno_text(int error) {
  return std::string(std::strerror(error));
}

}  // namespace pool_detail

// One expert's row of the page table.
struct PoolEntry {
  int32_t slot;
  uint8_t state;
  uint8_t prefetched;  // 1 + the PrefetchKind that brought it in (or queued it), unused since; or 0
  uint8_t demanded;    // a caller waits for it: loaded before any prefetch
  uint8_t streamed;    // brought in by a prefill batch and not used by a decode step since
  uint32_t pins;
  int32_t error;                    // errno of a failed read (state kFailed)
  uint64_t last_use, previous_use;  // ties of the eviction score go to the least recent
  uint64_t request_tick;            // queue order
  double uses;       // visits of its layer that used it (the estimate of how often it is picked)
  double use_visit;  // its layer's visit count when it was last used
};

// A compute process attached to the pool: its heartbeat, so that the owner can take back the pins
// of one that died mid-forward (kill -9), which would otherwise hold their slots forever.
struct PoolClientSlot {
  uint32_t in_use;
  int32_t pid;  // in the attaching process's PID namespace
  uint64_t heartbeat_ns;
  uint64_t generation;  // bumped at each attach: a client whose row was taken back notices
  // Where its decode steps are: the layer of its last decode acquisition and when (0: none yet).
  // Every client's eviction choice measures distances from all of them.
  int32_t decode_layer;
  // The layer its forward pass runs and the experts of it that pass has still to acquire
  // (PoolClient::expect; the bits are in client_wanted), and when it said so: evicted last.
  int32_t wanted_layer;
  uint64_t decode_layer_ns;
  uint64_t wanted_ns;
};
constexpr uint32_t kMaxClients = 64;

// The shared header; the tables follow it in the same mapping:
// PoolEntry entries[entries]; int32_t slot_owner[slots]; uint64_t layer_hits[layers],
// layer_misses[layers]; double layer_visits[layers] (forward passes through each layer);
// PoolClientSlot clients[kMaxClients]; uint16_t client_pins[kMaxClients][entries];
// uint64_t client_wanted[kMaxClients][wanted_words] (a bit per expert of one layer).
struct PoolLayout {
  uint64_t magic;
  uint32_t version;
  uint32_t layers, experts_per_layer, entries;
  uint64_t slots, slot_bytes, model_id, layout_bytes, data_bytes;
  int32_t owner_pid;
  uint32_t stopping;
  // CLOCK_MONOTONIC of the owner's last sign of life (its heartbeat thread, every 100 ms): how
  // clients in other PID namespaces (containers sharing IPC) know the owner is alive.
  uint64_t heartbeat_ns;
  pthread_mutex_t mutex;
  // Futex words, bumped on every change: not process-shared condition variables, whose state a
  // waiter killed mid-wait leaves behind (glibc's broadcast then blocks for ever, under the lock).
  uint32_t changed;   // a load finished, a pin was released
  uint32_t requests;  // a load was queued
  uint64_t tick;
  PoolCounters counters;

  PoolEntry* entry_table() { return reinterpret_cast<PoolEntry*>(this + 1); }
  int32_t* slot_owner() { return reinterpret_cast<int32_t*>(entry_table() + entries); }
  uint64_t* layer_hits() {
    return reinterpret_cast<uint64_t*>(pool_detail::round_up(
        reinterpret_cast<uintptr_t>(slot_owner() + slots), alignof(uint64_t)));
  }
  uint64_t* layer_misses() { return layer_hits() + layers; }
  double* layer_visits() { return reinterpret_cast<double*>(layer_misses() + layers); }
  PoolClientSlot* clients() { return reinterpret_cast<PoolClientSlot*>(layer_visits() + layers); }
  uint16_t* client_pins(uint32_t client) {
    return reinterpret_cast<uint16_t*>(clients() + kMaxClients) + size_t{client} * entries;
  }
  // A client's wanted experts: a bit per expert of the layer it runs, in 64-bit words.
  static uint32_t wanted_words_for(uint32_t experts_per_layer) {
    return (experts_per_layer + 63) / 64;
  }
  uint32_t wanted_words() const { return wanted_words_for(experts_per_layer); }
  uint64_t* client_wanted(uint32_t client) {
    return reinterpret_cast<uint64_t*>(pool_detail::round_up(
               reinterpret_cast<uintptr_t>(client_pins(kMaxClients)), alignof(uint64_t))) +
           size_t{client} * wanted_words();
  }
  bool wanted_by(uint32_t client, uint32_t expert) {
    return (client_wanted(client)[expert / 64] >> (expert % 64)) & 1u;
  }
  void set_wanted(uint32_t client, uint32_t expert, bool wanted) {
    uint64_t& word = client_wanted(client)[expert / 64];
    const uint64_t bit = uint64_t{1} << (expert % 64);
    word = wanted ? word | bit : word & ~bit;
  }

  static size_t bytes_for(uint32_t entries, uint64_t slots, uint32_t layers,
                          uint32_t experts_per_layer) {
    return pool_detail::round_up(
        sizeof(PoolLayout) + entries * sizeof(PoolEntry) + slots * sizeof(int32_t) +
            alignof(uint64_t) + 2 * layers * sizeof(uint64_t) + layers * sizeof(double) +
            kMaxClients * sizeof(PoolClientSlot) +
            size_t{kMaxClients} * entries * sizeof(uint16_t) + alignof(uint64_t) +
            size_t{kMaxClients} * wanted_words_for(experts_per_layer) * sizeof(uint64_t),
        pool_detail::kPage);
  }
};

namespace pool_detail {

// The pool's robust, process-shared mutex: a process that died holding it leaves it consistent
// again for the next (the tables are only ever changed in whole steps under it).
class PoolLock {
 public:
  explicit PoolLock(PoolLayout* layout) : layout_(layout) {
    const int rc = pthread_mutex_lock(&layout_->mutex);
    if (rc == EOWNERDEAD) {
      pthread_mutex_consistent(&layout_->mutex);
    } else if (rc != 0) {
      throw std::runtime_error("expert pool lock: " + errno_text(rc));
    }
  }
  ~PoolLock() { pthread_mutex_unlock(&layout_->mutex); }
  PoolLock(const PoolLock&) = delete;
  PoolLock& operator=(const PoolLock&) = delete;

  // Unlocks, waits until `word` changes (notify) or `ms` milliseconds pass, locks again. The
  // word is read under the lock, so a notify after the unlock is never missed.
  void wait(uint32_t* word, int ms) {
    const uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&layout_->mutex);
    timespec timeout{ms / 1000, static_cast<long>(ms % 1000) * 1000000L};
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &timeout, nullptr, 0);
    const int rc = pthread_mutex_lock(&layout_->mutex);
    if (rc == EOWNERDEAD) pthread_mutex_consistent(&layout_->mutex);
  }

 private:
  PoolLayout* layout_;
};

// Wakes every process waiting on `word` (PoolLock::wait).
inline void notify(uint32_t* word) {
  __atomic_add_fetch(word, 1, __ATOMIC_RELEASE);
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Layer steps from `current` forward to `layer` in a cycle of `cycle` layers (0 for the same).
inline int32_t layers_until(int32_t layer, int32_t current, int32_t cycle) {
  return ((layer - current) % cycle + cycle) % cycle;
}
}  // namespace pool_detail

}  // namespace moeline::offload
