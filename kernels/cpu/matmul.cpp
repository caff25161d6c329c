#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels {
namespace {
// Thread boundaries fall on multiples of the widest row tile so tiles never straddle threads.
constexpr int64_t kRowAlign = 8;
// Below this much weight traffic (bytes × tokens) a dispatch to the pool costs more than the work:
// such tasks (a router, a small batch's tiny projection) run on the calling thread.
constexpr size_t kInlineBytes = 256 << 10;
}  // namespace

void matmul_rows(const MatmulTask& task, int64_t row_begin, int64_t row_end) {
  switch (active_isa()) {
    case Isa::kAvx512:
    case Isa::kAvx512Vnni:  // the F32/BF16 kernels have no integer dot products
      return detail::matmul_rows_avx512(task, row_begin, row_end);
    case Isa::kAvx2:
      return detail::matmul_rows_avx2(task, row_begin, row_end);
    case Isa::kPortable:
      return detail::matmul_rows_portable(task, row_begin, row_end);
  }
}

namespace {

// One thread's share of a task's rows, [front, back), packed in one word so that the owner (taking
// from the front) and a thief (taking from the back) agree on what is left with one atomic.
struct alignas(64) RowShare {
  std::atomic<uint64_t> bounds{0};

  void reset(int64_t front, int64_t back) {
    bounds.store(static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32,
                 std::memory_order_relaxed);
  }
  // Claims up to `rows` rows from the front (owner) or the back (thief); false when none are left.
  bool claim(int64_t rows, bool from_front, int64_t& begin, int64_t& end) {
    uint64_t current = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(current & 0xffffffffu);
      const int64_t back = static_cast<int64_t>(current >> 32);
      if (front >= back) return false;
      begin = from_front ? front : std::max(front, back - rows);
      end = from_front ? std::min(back, front + rows) : back;
      const uint64_t next = from_front
                                ? static_cast<uint64_t>(end) | static_cast<uint64_t>(back) << 32
                                : static_cast<uint64_t>(front) | static_cast<uint64_t>(begin) << 32;
      if (bounds.compare_exchange_weak(current, next, std::memory_order_relaxed)) return true;
    }
  }
};

}  // namespace

void matmul(ThreadPool& pool, std::span<const MatmulTask> tasks) {
  size_t work = 0;
  for (const MatmulTask& task : tasks) work += task.w.bytes() * static_cast<size_t>(task.n);
  // The fast mode's quantized activations, one set per task that needs them (quant_matmul.h).
  thread_local std::vector<QuantizedActivations> per_thread;
  // A named reference: the pool's threads must see this thread's vectors, not their own.
  std::vector<QuantizedActivations>& activations = per_thread;
  const bool fast = quant_math() == QuantMath::kFast;
  if (fast) {
    if (activations.size() < tasks.size()) activations.resize(tasks.size());
    for (size_t t = 0; t < tasks.size(); ++t)
      if (is_quantized(tasks[t].w.dtype) && tasks[t].n > 0)
        quantize_activations(tasks[t].x, tasks[t].n, tasks[t].w.cols,
                             tasks[t].x_stride ? tasks[t].x_stride : tasks[t].w.cols,
                             activation_block(tasks[t].w.dtype), activations[t]);
  }
  auto rows = [&](size_t t, int64_t begin, int64_t end) {
    const MatmulTask& task = tasks[t];
    if (fast && is_quantized(task.w.dtype))
      return quant_matmul_rows(task.w, activations[t], task.y,
                               task.y_stride ? task.y_stride : task.w.rows, begin, end);
    matmul_rows(task, begin, end);
  };
  if (work < kInlineBytes) {
    for (size_t t = 0; t < tasks.size(); ++t)
      if (tasks[t].n > 0) rows(t, 0, tasks[t].w.rows);
    return;
  }
  // Each thread owns a contiguous share of every task's rows and streams through it from the
  // front; a thread that finishes its share early takes rows from the back of a slower thread's
  // share. Owning one long run keeps a single prefetch stream per thread (decode is memory-bound);
  // stealing absorbs the thread that was woken late or slowed by the memory system.
  const int threads = pool.size();
  thread_local std::vector<RowShare> shares;
  if (shares.size() < tasks.size() * static_cast<size_t>(threads))
    shares = std::vector<RowShare>(tasks.size() * static_cast<size_t>(threads));
  for (size_t t = 0; t < tasks.size(); ++t) {
    for (int thread = 0; thread < threads; ++thread) {
      auto [begin, end] = tasks[t].n > 0
                              ? ThreadPool::split(tasks[t].w.rows, thread, threads, kRowAlign)
                              : std::pair<int64_t, int64_t>{0, 0};
      shares[t * static_cast<size_t>(threads) + static_cast<size_t>(thread)].reset(begin, end);
    }
  }
  RowShare* share = shares.data();
  pool.run([&](int thread, int count) {
    for (size_t t = 0; t < tasks.size(); ++t) {
      const MatmulTask& task = tasks[t];
      // Few tokens: small claims cost nothing (a row is a whole dot product per token). Many
      // tokens: claims as large as the packing block, so packed weight tiles are reused.
      const int64_t claim_rows = task.n <= 8 ? 16 : 64;
      int64_t begin = 0, end = 0;
      RowShare* own = share + t * static_cast<size_t>(count);
      while (own[thread].claim(claim_rows, true, begin, end)) rows(t, begin, end);
      for (int other = 1; other < count; ++other) {
        RowShare& victim = own[(thread + other) % count];
        while (victim.claim(claim_rows, false, begin, end)) rows(t, begin, end);
      }
    }
  });
}

void matmul(ThreadPool& pool, const MatmulTask& task) {
  matmul(pool, std::span(&task, 1));
}

}  // namespace moeline::kernels
