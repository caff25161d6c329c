#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <string_view>
#include <vector>

#include "base/environment.h"

#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels {
namespace {
// Thread boundaries fall on multiples of the widest row tile so tiles never straddle threads.
constexpr int64_t kRowAlign = 8;
// Below this much weight traffic (bytes × tokens) a dispatch to the pool costs more than the work:
// such tasks (a router, a small batch's tiny projection) run on the calling thread.
constexpr size_t kInlineBytes = 256 << 10;
// Tasks of at most this many tokens read their weights as decode does (one row at a time, tiles of
// tokens), in StreamTuning::decode_streams streams per thread.
constexpr int64_t kStreamTokens = 6;
// Rows per claim in decode. The Q4_K decode kernel reads rows in groups of 16 and sets up per call
// and per group, so its claims are four groups (mini Q4_K_M decode, two threads: 396-417 -> 424-468
// t/s against 16-row claims; one thread within the noise); the other kernels read row by row and
// their claims stay at 16 rows (larger ones made Q8_0 decode a few percent slower, BF16 no
// faster).
int64_t decode_claim_rows(DType weights) {
  return weights == DType::kQ4_K ? 64 : 16;
}
}  // namespace

namespace {

StreamTuning default_stream_tuning() {
  StreamTuning tuning;
  __builtin_cpu_init();
  // AMD: two decode streams per thread (the AVX2 path's wide kernels read them since session 39:
  // before, it read one). Without AVX-512 (Zen 3 and earlier: the AVX2 path) the wide kernels'
  // decode also prefetches 1 KiB ahead: `mini` BF16 decode on one thread, one stream, 33-35 ->
  // 41-44 t/s (512 B: 68% of the roofline, 2 KiB 72-76%, 4 KiB 66%); with two streams 1 KiB was
  // again the fastest (median 20.8 GB/s; none 19.6, 512 B 19.5, 2 KiB 17.7).
  if (__builtin_cpu_is("amd"))
    tuning = {.decode_streams = 2,
              .prefetch_bytes = __builtin_cpu_supports("avx512f") ? 0 : 1024,
              .quant_prefetch_bytes = 0};
  if (const char* text = env::get(env::kKernelTuning)) {
    StreamTuning overridden = tuning;
    if (parse_stream_tuning(text, overridden)) tuning = overridden;
  }
  return tuning;
}

std::atomic<int>& decode_streams_setting() {
  static std::atomic<int> streams{default_stream_tuning().decode_streams};
  return streams;
}
std::atomic<int64_t>& prefetch_bytes_setting() {
  static std::atomic<int64_t> bytes{default_stream_tuning().prefetch_bytes};
  return bytes;
}
std::atomic<int64_t>& quant_prefetch_bytes_setting() {
  static std::atomic<int64_t> bytes{default_stream_tuning().quant_prefetch_bytes};
  return bytes;
}

}  // namespace

StreamTuning stream_tuning() {
  return {.decode_streams = decode_streams_setting().load(std::memory_order_relaxed),
          .prefetch_bytes = prefetch_bytes_setting().load(std::memory_order_relaxed),
          .quant_prefetch_bytes = quant_prefetch_bytes_setting().load(std::memory_order_relaxed)};
}

void set_stream_tuning(const StreamTuning& tuning) {
  decode_streams_setting().store(tuning.decode_streams, std::memory_order_relaxed);
  prefetch_bytes_setting().store(tuning.prefetch_bytes, std::memory_order_relaxed);
  quant_prefetch_bytes_setting().store(tuning.quant_prefetch_bytes, std::memory_order_relaxed);
}

bool parse_stream_tuning(const char* text, StreamTuning& tuning) {
  StreamTuning parsed = tuning;
  std::string_view rest(text);
  for (bool more = true; more;) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    more = comma != std::string_view::npos;
    if (more) rest = rest.substr(comma + 1);
    const size_t equals = item.find('=');
    if (equals == std::string_view::npos) return false;
    const std::string_view name = item.substr(0, equals), value = item.substr(equals + 1);
    int64_t number = 0;
    const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), number);
    if (error != std::errc() || end != value.data() + value.size()) return false;
    if (name == "decode_streams" && number >= 1 && number <= 2)
      parsed.decode_streams = static_cast<int>(number);
    else if (name == "prefetch_bytes" && number >= 0 && number <= 65536)
      parsed.prefetch_bytes = number;
    else if (name == "quant_prefetch_bytes" && number >= 0 && number <= 65536)
      parsed.quant_prefetch_bytes = number;
    else
      return false;
  }
  tuning = parsed;
  return true;
}

namespace detail {
int64_t quant_prefetch_bytes() {
  return quant_prefetch_bytes_setting().load(std::memory_order_relaxed);
}

int64_t wide_prefetch_bytes() {
  return prefetch_bytes_setting().load(std::memory_order_relaxed);
}

void start_stream(const void* row) {
  const char* start = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < wide_prefetch_bytes(); offset += 64)
    __builtin_prefetch(start + offset, 0, 3);
}
}  // namespace detail

void matmul_rows_two_streams(const MatmulTask& task, int64_t a_begin, int64_t a_end,
                             int64_t b_begin, int64_t b_end) {
  if (active_isa() == Isa::kAvx512 || active_isa() == Isa::kAvx512Vnni)
    return detail::matmul_rows_two_streams_avx512(task, a_begin, a_end, b_begin, b_end);
  if (active_isa() == Isa::kAvx2)
    return detail::matmul_rows_two_streams_avx2(task, a_begin, a_end, b_begin, b_end);
  matmul_rows(task, a_begin, a_end);
  matmul_rows(task, b_begin, b_end);
}

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
  // The BF16 fast mode's rounded activations likewise (bf16_matmul.h).
  thread_local std::vector<Bf16Activations> per_thread_bf16;
  std::vector<Bf16Activations>& bf16_activations = per_thread_bf16;
  const bool bf16_fast = bf16_fast_in_use();
  // Which task's quantized activations a task reads: its own, or an earlier task's of the same
  // input and block (q, k and v share theirs, as do an expert's gate and up): quantizing is work
  // done on the calling thread alone while the others wait, so each input is quantized once.
  thread_local std::vector<size_t> quantized_by_task;
  std::vector<size_t>& quantized_by = quantized_by_task;
  quantized_by.resize(tasks.size());
  auto same_input = [&](const MatmulTask& a, const MatmulTask& b) {
    return a.x == b.x && a.n == b.n && a.w.cols == b.w.cols &&
           (a.x_stride ? a.x_stride : a.w.cols) == (b.x_stride ? b.x_stride : b.w.cols) &&
           activation_block(a.w.dtype) == activation_block(b.w.dtype);
  };
  for (size_t t = 0; t < tasks.size(); ++t) {
    const MatmulTask& task = tasks[t];
    quantized_by[t] = t;
    if (task.n <= 0) continue;
    const int64_t x_stride = task.x_stride ? task.x_stride : task.w.cols;
    if (fast && is_quantized(task.w.dtype)) {
      if (activations.size() < tasks.size()) activations.resize(tasks.size());
      for (size_t earlier = 0; earlier < t; ++earlier)
        if (quantized_by[earlier] == earlier && is_quantized(tasks[earlier].w.dtype) &&
            same_input(tasks[earlier], task)) {
          quantized_by[t] = earlier;
          break;
        }
      if (quantized_by[t] == t)
        quantize_activations(task.x, task.n, task.w.cols, x_stride, activation_block(task.w.dtype),
                             activations[t]);
    } else if (bf16_fast && task.w.dtype == DType::kBF16) {
      if (bf16_activations.size() < tasks.size()) bf16_activations.resize(tasks.size());
      round_activations_to_bf16(task.x, task.n, task.w.cols, x_stride, bf16_activations[t]);
    }
  }
  auto rows = [&](size_t t, int64_t begin, int64_t end) {
    const MatmulTask& task = tasks[t];
    const int64_t y_stride = task.y_stride ? task.y_stride : task.w.rows;
    if (fast && is_quantized(task.w.dtype))
      return quant_matmul_rows(task.w, activations[quantized_by[t]], task.y, y_stride, begin, end);
    if (bf16_fast && task.w.dtype == DType::kBF16)
      return bf16_matmul_rows(task.w, bf16_activations[t], task.y, y_stride, begin, end);
    matmul_rows(task, begin, end);
  };
  auto two_streams = [&](size_t t, int64_t a_begin, int64_t a_end, int64_t b_begin, int64_t b_end) {
    const MatmulTask& task = tasks[t];
    if (fast && is_quantized(task.w.dtype))
      return quant_matmul_rows_two_streams(task.w, activations[quantized_by[t]], task.y,
                                           task.y_stride ? task.y_stride : task.w.rows, a_begin,
                                           a_end, b_begin, b_end);
    if (bf16_fast && task.w.dtype == DType::kBF16)
      return bf16_matmul_rows_two_streams(task.w, bf16_activations[t], task.y,
                                          task.y_stride ? task.y_stride : task.w.rows, a_begin,
                                          a_end, b_begin, b_end);
    matmul_rows_two_streams(task, a_begin, a_end, b_begin, b_end);
  };
  if (work < kInlineBytes) {
    for (size_t t = 0; t < tasks.size(); ++t)
      if (tasks[t].n > 0) rows(t, 0, tasks[t].w.rows);
    return;
  }
  // Each thread owns a contiguous share of every task's rows and streams through it from the
  // front; a thread that finishes its share early takes rows from the back of a slower thread's
  // share. Owning one long run keeps the memory streams per thread few and long (decode is
  // memory-bound); stealing absorbs the thread that was woken late or slowed by the memory system.
  // With two decode streams (StreamTuning) a thread's share is two halves, read side by side.
  const int threads = pool.size();
  const int decode_streams = stream_tuning().decode_streams;
  auto streams_of = [&](const MatmulTask& task) {
    const bool wide =
        task.w.dtype == DType::kF32 || task.w.dtype == DType::kBF16 || task.w.dtype == DType::kF16;
    const bool streamed = wide || (fast && quant_two_streams(task.w.dtype));
    return streamed && task.n <= kStreamTokens ? decode_streams : 1;
  };
  const size_t slots = tasks.size() * static_cast<size_t>(threads) * 2;
  thread_local std::vector<RowShare> shares;
  if (shares.size() < slots) shares = std::vector<RowShare>(slots);
  for (size_t t = 0; t < tasks.size(); ++t) {
    for (int thread = 0; thread < threads; ++thread) {
      auto [begin, end] = tasks[t].n > 0
                              ? ThreadPool::split(tasks[t].w.rows, thread, threads, kRowAlign)
                              : std::pair<int64_t, int64_t>{0, 0};
      const int64_t middle =
          streams_of(tasks[t]) == 2
              ? std::min(end, begin + ((end - begin) / 2 + kRowAlign - 1) / kRowAlign * kRowAlign)
              : end;
      RowShare* own = &shares[(t * static_cast<size_t>(threads) + static_cast<size_t>(thread)) * 2];
      own[0].reset(begin, middle);
      own[1].reset(middle, end);
    }
  }
  RowShare* share = shares.data();
  pool.run([&](int thread, int count) {
    for (size_t t = 0; t < tasks.size(); ++t) {
      const MatmulTask& task = tasks[t];
      // Few tokens: small claims (decode_claim_rows). Many tokens: claims as large as the
      // packing block, so packed weight tiles are reused.
      const int64_t claim_rows = task.n <= 8 ? decode_claim_rows(task.w.dtype) : 64;
      RowShare* own = share + t * static_cast<size_t>(count) * 2;
      RowShare* mine = own + static_cast<size_t>(thread) * 2;
      for (;;) {
        int64_t a_begin = 0, a_end = 0, b_begin = 0, b_end = 0;
        const bool a = mine[0].claim(claim_rows, true, a_begin, a_end);
        const bool b = mine[1].claim(claim_rows, true, b_begin, b_end);
        if (a && b)
          two_streams(t, a_begin, a_end, b_begin, b_end);
        else if (a || b)
          rows(t, a ? a_begin : b_begin, a ? a_end : b_end);
        else
          break;
      }
      int64_t begin = 0, end = 0;
      for (int other = 1; other < count; ++other) {
        RowShare* victim = own + static_cast<size_t>((thread + other) % count) * 2;
        for (int half : {1, 0})
          while (victim[half].claim(claim_rows, false, begin, end)) rows(t, begin, end);
      }
    }
  });
}

void matmul(ThreadPool& pool, const MatmulTask& task) {
  matmul(pool, std::span(&task, 1));
}

}  // namespace moeline::kernels
