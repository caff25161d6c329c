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

namespace detail {
// How far ahead along a weight row the F32/BF16/F16 kernels prefetch (512-2048 tried on the
// benchmark shape).
constexpr int64_t kWidePrefetchBytes = 1024;

void matmul_rows_portable(const MatmulTask& task, int64_t row_begin, int64_t row_end);
void matmul_rows_avx2(const MatmulTask& task, int64_t row_begin, int64_t row_end);
void matmul_rows_avx512(const MatmulTask& task, int64_t row_begin, int64_t row_end);
}  // namespace detail

}  // namespace moeline::kernels
