#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#define MOELINE_CPU_RELAX() _mm_pause()
#else
#define MOELINE_CPU_RELAX() std::this_thread::yield()
#endif

namespace moeline::kernels {
namespace {
// About 100 µs of spinning (a pause is ~10 ns on the reference VM): long enough to bridge the gap
// between two ops of one forward pass, short enough not to burn a core while the process is idle.
constexpr int kSpinIterations = 10000;
// The caller waiting for stragglers yields after this many pauses, so that when the machine is
// oversubscribed (more runnable threads than cores) a descheduled worker gets the core back.
constexpr int kWaitSpinsBeforeYield = 1000;
}  // namespace

ThreadPool::ThreadPool(int threads) {
  threads = std::max(1, threads);
  workers_.reserve(static_cast<size_t>(threads - 1));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  stopping_.store(true);
  generation_.fetch_add(1);
  generation_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  const int threads = size();
  if (threads == 1) {
    fn(0, 1);
    return;
  }
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = record_timings_ ? Clock::now() : Clock::time_point{};
  job_ = &fn;
  pending_.store(threads - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  fn(0, threads);
  const Clock::time_point own_done = record_timings_ ? Clock::now() : Clock::time_point{};
  for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
    if (spin < kWaitSpinsBeforeYield) {
      MOELINE_CPU_RELAX();
    } else {
      std::this_thread::yield();
    }
  }
  if (record_timings_) {
    const Clock::time_point end = Clock::now();
    timings_.waits.push_back(std::chrono::duration<float>(end - own_done).count());
    timings_.in_ops += std::chrono::duration<double>(end - start).count();
  }
}

void ThreadPool::record_timings(bool on) {
  record_timings_ = on;
}

ThreadPool::Timings ThreadPool::take_timings() {
  return std::exchange(timings_, {});
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t current = generation_.load(std::memory_order_acquire);
    for (int spin = 0; current == seen && spin < kSpinIterations; ++spin) {
      MOELINE_CPU_RELAX();
      current = generation_.load(std::memory_order_acquire);
    }
    if (current == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      continue;
    }
    seen = current;
    if (stopping_.load()) return;
    (*job_)(index, size());
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

std::pair<int64_t, int64_t> ThreadPool::split(int64_t n, int thread, int threads, int64_t align) {
  const int64_t units = (n + align - 1) / align;
  const int64_t begin = std::min(n, units * thread / threads * align);
  const int64_t end = std::min(n, units * (thread + 1) / threads * align);
  return {begin, end};
}

}  // namespace moeline::kernels
