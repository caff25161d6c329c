#pragma once
// A fixed set of worker threads, created once and reused for every op. `run(fn)` calls
// fn(thread_index, thread_count) on every thread — the caller is thread 0 — and returns when all
// are done. Workers spin briefly before sleeping, because ops arrive microseconds apart during
// decode and waking a sleeping core costs tens of microseconds on a VM.
//
// Thread-safety: one caller at a time; run() is not reentrant.

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace moeline::kernels {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  void run(const std::function<void(int thread, int threads)>& fn);

  // Splits [0, n) into `threads` contiguous ranges whose boundaries are multiples of `align`.
  static std::pair<int64_t, int64_t> split(int64_t n, int thread, int threads, int64_t align = 1);

  // While on, every run() with more than one thread records how long it took and how long the
  // caller then waited for the other threads after finishing its own share: the cost of
  // imbalance, of waking the workers and of a worker descheduled mid-op (benchmarks report it;
  // off by default, since two clock reads per op are not free).
  struct Timings {
    std::vector<float> waits;  // seconds, one per op
    double in_ops = 0.0;       // seconds inside run(), all ops
  };
  void record_timings(bool on);
  Timings take_timings();

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stopping_{false};
  bool record_timings_ = false;
  Timings timings_;
};

}  // namespace moeline::kernels
