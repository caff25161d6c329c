#include "kernels/cpu/matmul.h"

#include "kernels/cpu/cpu_features.h"

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
      return detail::matmul_rows_avx512(task, row_begin, row_end);
    case Isa::kAvx2:
      return detail::matmul_rows_avx2(task, row_begin, row_end);
    case Isa::kPortable:
      return detail::matmul_rows_portable(task, row_begin, row_end);
  }
}

void matmul(ThreadPool& pool, std::span<const MatmulTask> tasks) {
  size_t work = 0;
  for (const MatmulTask& task : tasks) work += task.w.bytes() * static_cast<size_t>(task.n);
  if (work < kInlineBytes) {
    for (const MatmulTask& task : tasks)
      if (task.n > 0) matmul_rows(task, 0, task.w.rows);
    return;
  }
  pool.run([&](int thread, int threads) {
    for (const MatmulTask& task : tasks) {
      if (task.n == 0) continue;
      auto [begin, end] = ThreadPool::split(task.w.rows, thread, threads, kRowAlign);
      if (begin < end) matmul_rows(task, begin, end);
    }
  });
}

void matmul(ThreadPool& pool, const MatmulTask& task) {
  matmul(pool, std::span(&task, 1));
}

}  // namespace moeline::kernels
