#pragma once
// y = x · Wᵀ for a batch of independent tasks (all projections of a layer, all active experts of a
// step), run on the thread pool in one dispatch. W is a weight matrix [out, in] in any DType,
// used in place; x and y are F32. Block-quantized W goes through quant_matmul.h's integer dot
// products in the fast mode (the default), or is dequantized to F32 in the exact mode.
//
// Determinism: every y element is the dot product of one x row and one W row accumulated in a
// fixed lane/order pattern that does not depend on n, the tile a row falls in, or the thread
// count. A sequence's results are therefore bit-identical whatever else is in its batch.

#include <cstdint>
#include <span>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/thread_pool.h"

namespace moeline::kernels {

struct MatmulTask {
  const float* x = nullptr;  // [n, w.cols], rows x_stride floats apart
  int64_t n = 0;
  MatrixView w;
  float* y = nullptr;    // [n, w.rows], rows y_stride floats apart
  int64_t x_stride = 0;  // 0 means w.cols
  int64_t y_stride = 0;  // 0 means w.rows
};

void matmul(ThreadPool& pool, std::span<const MatmulTask> tasks);
void matmul(ThreadPool& pool, const MatmulTask& task);

// Computes rows [row_begin, row_end) of W for every x row, on the calling thread (with F32
// activations: the exact mode for quantized W).
void matmul_rows(const MatmulTask& task, int64_t row_begin, int64_t row_end);
// Rows [a_begin, a_end) and [b_begin, b_end) together, row a_begin + i beside b_begin + i: two
// memory streams for decode (StreamTuning::decode_streams). The same results as matmul_rows on
// each range.
void matmul_rows_two_streams(const MatmulTask& task, int64_t a_begin, int64_t a_end,
                             int64_t b_begin, int64_t b_end);

// How decode streams weights from memory, chosen per host from the CPU's vendor (measured with
// bench/ on each: docs/PERFORMANCE.md), overridden by MOELINE_KERNEL_TUNING
// ("decode_streams=2,prefetch_bytes=0,quant_prefetch_bytes=0"), and shown by the kernel report.
// Neither changes results.
struct StreamTuning {
  // Weight streams per thread when a task has few tokens: 1, or 2 (a thread's rows in two halves,
  // read side by side). Intel (the Xeon tuned on): 1; AMD: 2 (a Zen 5 core's dot product over one
  // stream read 27-34 GB/s, over two 37-40, a plain read 33-40; a Zen 3 core's BF16 decode on the
  // AVX2 path 15.9 -> 20.8 GB/s median, mini on one thread 37-44 -> 54-59 t/s).
  int decode_streams = 1;
  // How far ahead along a weight row the F32/BF16/F16 kernels prefetch; 0: no software prefetch,
  // the hardware prefetchers alone. Intel: 1024 (its prefetchers stop at 4 KiB pages; 512-2048
  // tried); AMD Zen 4/5: 0 (software prefetches there cost more bandwidth than they gain).
  int64_t prefetch_bytes = 1024;
  // The same for the block-quantized kernels (quant_matmul.h), whose rows are denser in weights.
  // Intel: 2048; AMD Zen 5: 0 (mini Q8_0 decode on one thread: docs/PERFORMANCE.md).
  int64_t quant_prefetch_bytes = 2048;
};
StreamTuning stream_tuning();
// For benchmarks and tests; the default is chosen once at start.
void set_stream_tuning(const StreamTuning& tuning);
// "decode_streams=N,prefetch_bytes=N,quant_prefetch_bytes=N" (any of them) over `tuning`; false
// when malformed or out of range (streams 1-2, prefetch 0-65536).
bool parse_stream_tuning(const char* text, StreamTuning& tuning);

namespace detail {
// StreamTuning::prefetch_bytes, read by the kernels once per tile.
int64_t wide_prefetch_bytes();
// Columns per pass of the AVX2 path's packed prefill tile over a token block (matmul_avx2.cpp):
// longer rows are multiplied a block at a time so that it stays in L1; the other paths take a
// whole row per pass.
constexpr int64_t kAvx2PackedKBlock = 1024;
// Prefetches the first wide_prefetch_bytes() of a weight stream starting at `row`, which would
// otherwise be demand misses before the kernels' own prefetches run ahead of it.
void start_stream(const void* row);

void matmul_rows_portable(const MatmulTask& task, int64_t row_begin, int64_t row_end);
void matmul_rows_avx2(const MatmulTask& task, int64_t row_begin, int64_t row_end);
void matmul_rows_two_streams_avx2(const MatmulTask& task, int64_t a_begin, int64_t a_end,
                                  int64_t b_begin, int64_t b_end);
void matmul_rows_avx512(const MatmulTask& task, int64_t row_begin, int64_t row_end);
void matmul_rows_two_streams_avx512(const MatmulTask& task, int64_t a_begin, int64_t a_end,
                                    int64_t b_begin, int64_t b_end);
}  // namespace detail

}  // namespace moeline::kernels
