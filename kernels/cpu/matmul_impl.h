#pragma once
// The matmul algorithm, written once and instantiated per instruction set: each matmul_*.cpp
// defines a `Simd` traits type (vector type, lane count, tile shape, loads, fused multiply-add,
// reduction) in an anonymous namespace and includes this file. Internal to kernels/cpu.
//
// Shape of the computation: an MR-row × NR-token tile keeps MR*NR vector accumulators, each
// summing one (row, token) dot product lane-wise over k; the lanes are reduced once at the end.
// For large n the MR weight rows are first widened to F32 in a per-thread buffer, so the
// conversion is paid once per token block rather than once per token tile; widening is exact, so
// both routes give identical bits.

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/scratch_vector.h"

namespace moeline::kernels::detail {

template <class Simd>
struct MatmulKernel {
  using V = typename Simd::V;
  static constexpr int kLanes = Simd::kLanes;
  static constexpr int kMR = Simd::kMR;
  static constexpr int kNR = Simd::kNR;
  // Tokens per block when packing: the block's x rows stay in L2 while every row tile passes.
  static constexpr int64_t kTokenBlock = 64;
  // Streamed (unpacked) rows, read from memory as stored and widened in registers: a tile call
  // takes one row (decode) or two (two streams) and up to kStreamedTileTokens tokens, or
  // kTwoStreamTileTokens with two rows. Up to kDirectTokens tokens (decode's batches) every row
  // streams so, its tokens taken in chunks of a tile call: the first chunk reads the row from
  // memory, the others from L1.
  static constexpr int kStreamedTileTokens = Simd::kStreamedTileTokens;
  static constexpr int kTwoStreamTileTokens = Simd::kTwoStreamTileTokens;
  static constexpr int kDirectTokens = Simd::kDirectTokens;
  // From this many tokens on, widening the weight tile once beats widening it per token tile.
  static constexpr int64_t kPackFromTokens = std::max(2 * kNR, kDirectTokens + 1);
  static constexpr int kStreamedRows = 2;
  static_assert(Simd::kDirectRows <= kStreamedRows && kTwoStreamTileTokens <= kStreamedTileTokens &&
                kNR <= kStreamedTileTokens);
  // Unpacked (few tokens: decode) the weights stream from memory once, kDirectRows rows at a time.
  // On AVX-512 one row: a single stream per thread keeps more of the memory bandwidth busy than
  // several interleaved short ones (measured: 1 row 15.0 GB/s, 2 rows 12.9, 4 rows 12.2 on one
  // core, against 15.3 for a plain read); AVX2 too, with 16 lanes in two registers so that one
  // row's sums run in two chains of FMAs. Each row's sum is the same whatever the tile, so
  // results do not change.
  static constexpr int kDirectRows = Simd::kDirectRows;
  // Columns of k per pass over a token block for packed rows (0: the whole row in one pass).
  static_assert(Simd::kKBlock % kLanes == 0);

  static V load(const void* row, DType dtype, int64_t k) {
    switch (dtype) {
      case DType::kF32:
        return Simd::load_f32(static_cast<const float*>(row) + k);
      case DType::kBF16:
        return Simd::load_bf16(static_cast<const uint16_t*>(row) + k);
      case DType::kF16:
        return Simd::load_f16(static_cast<const uint16_t*>(row) + k);
      default:  // quantized rows are always dequantized into a packed F32 tile first
        return Simd::zero();
    }
  }

  // The ragged end of a row, widened through a zero-padded buffer: the same path for every tile.
  static V load_tail(const void* row, DType dtype, int64_t k, int64_t count) {
    alignas(64) float buffer[kLanes] = {};
    widen(static_cast<const std::byte*>(row) + k * static_cast<int64_t>(dtype_size(dtype)), dtype,
          count, buffer);
    return Simd::load_f32(buffer);
  }

  static void widen_row(const MatrixView& w, int64_t r, float* dst) {
    const void* row = w.row(r);
    const int64_t K = w.cols;
    if (has_block_scales(w.dtype)) return widen_e4m3_row(w, r, dst);
    if (is_quantized(w.dtype)) {
      widen(row, w.dtype, K, dst);
      return;
    }
    if (w.dtype == DType::kF32) {
      std::memcpy(dst, row, static_cast<size_t>(K) * sizeof(float));
      return;
    }
    const auto* src = static_cast<const uint16_t*>(row);
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes)
      Simd::store(dst + k,
                  w.dtype == DType::kBF16 ? Simd::load_bf16(src + k) : Simd::load_f16(src + k));
    widen(src + k, w.dtype, K - k, dst + k);
  }

  // An FP8 row times its block scales: Simd::load_e4m3 yields 2^-8 of each value (dtype.h), so
  // the scale is taken 2^8 times larger. Both factors are exact powers of two apart from the
  // product itself, which is rounded once, as the scalar e4m3_to_float(q) * scale is.
  static void widen_e4m3_row(const MatrixView& w, int64_t r, float* dst) {
    const auto* src = static_cast<const uint8_t*>(static_cast<const void*>(w.row(r)));
    const float* scales = w.row_scales(r);
    const int64_t block = w.scale_block_cols;
    for (int64_t begin = 0; begin < w.cols; begin += block) {
      const int64_t end = std::min(w.cols, begin + block);
      const float scale = scales[begin / block];
      const V scale_256 = Simd::broadcast(scale * 256.0f);
      int64_t k = begin;
      for (; k + kLanes <= end; k += kLanes)
        Simd::store(dst + k, Simd::mul(Simd::load_e4m3(src + k), scale_256));
      for (; k < end; ++k) dst[k] = e4m3_to_float(src[k]) * scale;
    }
  }

  // The part of k one tile call covers. The whole row (decode, and packed rows that fit the
  // cache) in one call; packed rows longer than Simd::kKBlock in blocks, each tile's
  // accumulators kept in `partial` from one block to the next, which leaves every lane's chain
  // of multiply-adds, and so the result, exactly as in one call.
  struct KSpan {
    int64_t cols = 0;            // the row length
    int64_t begin = 0, end = 0;  // end == cols on the last block
    float* partial = nullptr;    // M * N accumulators of kLanes; nullptr: the whole row at once
  };

  // Streamed rows (decode, read once from memory) are prefetched ahead where the host wants it;
  // packed rows are in the cache already. The loops over the tile's accumulators are unrolled
  // by pragma: GCC 12 leaves the ones that save and restore them rolled, which indexes the
  // accumulators at run time and so keeps them on the stack (a store per accumulator per step of
  // the k loop, 30% slower).
  template <int M, int N, DType W, bool kStreamed>
  static void tile(const void* const* w_rows, const float* const* x_rows, const KSpan& span,
                   float* y, int64_t y_stride) {
    const int64_t K = span.cols;
    V acc[M][N];
    const bool resume = span.partial != nullptr && span.begin > 0;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int t = 0; t < N; ++t)
        acc[m][t] = resume ? Simd::load_f32(span.partial + (m * N + t) * kLanes) : Simd::zero();
    const int64_t k_full = K - K % kLanes;
    const int64_t k_stop = std::min(span.end, k_full);
    constexpr int64_t element_bytes = static_cast<int64_t>(dtype_size(W));
    const int64_t prefetch_bytes = kStreamed ? wide_prefetch_bytes() : 0;
    for (int64_t k = span.begin; k < k_stop; k += kLanes) {
      V w[M];
      // One prefetch per cache line of each weight row, prefetch_bytes ahead where the host
      // wants it (StreamTuning): Intel's hardware prefetchers stop at 4 KiB page boundaries, and
      // decode reads every weight exactly once.
      if (prefetch_bytes > 0 && ((k * element_bytes) & 63) == 0)
        for (int m = 0; m < M; ++m)
          Simd::prefetch(static_cast<const char*>(w_rows[m]) + k * element_bytes + prefetch_bytes);
      for (int m = 0; m < M; ++m) w[m] = load(w_rows[m], W, k);
      for (int t = 0; t < N; ++t) {
        const V x = Simd::load_f32(x_rows[t] + k);
        for (int m = 0; m < M; ++m) acc[m][t] = Simd::fmadd(w[m], x, acc[m][t]);
      }
    }
    if (span.end < K) {
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
        for (int t = 0; t < N; ++t) Simd::store(span.partial + (m * N + t) * kLanes, acc[m][t]);
      return;
    }
    if (k_full < K) {
      const int64_t rest = K - k_full;
      V w[M];
      for (int m = 0; m < M; ++m) w[m] = load_tail(w_rows[m], W, k_full, rest);
      for (int t = 0; t < N; ++t) {
        const V x = load_tail(x_rows[t], DType::kF32, k_full, rest);
        for (int m = 0; m < M; ++m) acc[m][t] = Simd::fmadd(w[m], x, acc[m][t]);
      }
    }
    for (int t = 0; t < N; ++t)
      for (int m = 0; m < M; ++m) y[t * y_stride + m] = Simd::reduce(acc[m][t]);
  }

  using TileFn = void (*)(const void* const*, const float* const*, const KSpan&, float*, int64_t);

  template <DType W, bool kStreamed, int Tokens, int M, int... Ns>
  static constexpr std::array<TileFn, Tokens> tiles_for_rows(std::integer_sequence<int, Ns...>) {
    return {&tile<M, Ns + 1, W, kStreamed>...};
  }
  template <DType W, bool kStreamed, int Tokens, int... Ms>
  static constexpr std::array<std::array<TileFn, Tokens>, sizeof...(Ms)> tile_table(
      std::integer_sequence<int, Ms...>) {
    return {
        tiles_for_rows<W, kStreamed, Tokens, Ms + 1>(std::make_integer_sequence<int, Tokens>{})...};
  }
  template <DType W, bool kStreamed, int Rows, int Tokens>
  static constexpr auto kTiles =
      tile_table<W, kStreamed, Tokens>(std::make_integer_sequence<int, Rows>{});

  // Rows as stored (streamed from memory), or rows already widened into the packed F32 tile.
  static TileFn pick(DType dtype, int rows, int tokens) {
    switch (dtype) {
      case DType::kF32:
        return kTiles<DType::kF32, true, kStreamedRows, kStreamedTileTokens>[rows - 1][tokens - 1];
      case DType::kBF16:
        return kTiles<DType::kBF16, true, kStreamedRows, kStreamedTileTokens>[rows - 1][tokens - 1];
      case DType::kF16:
        return kTiles<DType::kF16, true, kStreamedRows, kStreamedTileTokens>[rows - 1][tokens - 1];
      default:
        return nullptr;
    }
  }
  // The streamed tile for each chunk of n tokens taken `chunk` at a time, `rows` rows a call:
  // looked up once per task rather than once per row. Returns the number of chunks.
  static int pick_chunks(DType dtype, int rows, int64_t n, int chunk, TileFn* tiles) {
    int count = 0;
    for (int64_t t = 0; t < n; t += chunk)
      tiles[count++] = pick(dtype, rows, static_cast<int>(std::min<int64_t>(chunk, n - t)));
    return count;
  }
  static TileFn pick_packed(int rows, int tokens) {
    return kTiles<DType::kF32, false, kMR, kNR>[rows - 1][tokens - 1];
  }

  // The stored bytes of the next row tile, prefetched a share at a time while the current tile's
  // tokens run, so that widening them finds them in cache instead of waiting on memory.
  struct NextTilePrefetch {
    const char* next = nullptr;
    const char* end = nullptr;
    int64_t bytes_per_tile_call = 0;
    void step() {
      if constexpr (Simd::kPrefetchesNextTile) {
        const char* stop = std::min(end, next + bytes_per_tile_call);
        for (; next < stop; next += kCacheLineBytes) Simd::prefetch(next);
      }
    }
  };

  // Token tiles [t_begin, t_end) of one row tile (rows as stored in `dtype`, or packed F32) over
  // the k span [k_begin, k_end): a tile's accumulators go to `partials` (kMR * kNR per token
  // tile) when the span ends before the row; `next_tile`, where given, is prefetched a share per
  // tile call.
  static void run_tokens(const void* const* w_rows, bool packed, DType dtype, int rows,
                         const MatmulTask& task, int64_t x_stride, int64_t y_stride, int64_t row,
                         int64_t t_begin, int64_t t_end, int64_t k_begin = 0, int64_t k_end = -1,
                         float* partials = nullptr, NextTilePrefetch* next_tile = nullptr) {
    const float* x_rows[kNR];
    const int64_t K = task.w.cols;
    for (int64_t t = t_begin; t < t_end; t += kNR) {
      if (next_tile) next_tile->step();
      const int tokens = static_cast<int>(std::min<int64_t>(kNR, t_end - t));
      for (int i = 0; i < tokens; ++i) x_rows[i] = task.x + (t + i) * x_stride;
      const KSpan span{K, k_begin, k_end < 0 ? K : k_end,
                       partials ? partials + (t - t_begin) / kNR * (kMR * kNR * kLanes) : nullptr};
      const TileFn tile_fn = packed ? pick_packed(rows, tokens) : pick(dtype, rows, tokens);
      tile_fn(w_rows, x_rows, span, task.y + t * y_stride + row, y_stride);
    }
  }

  // The stream start's prefetch (matmul.h), on the paths that prefetch at all.
  static void begin_stream(const void* row) {
    if constexpr (Simd::kPrefetches) start_stream(row);
  }

  // Decode over two row ranges read side by side: rows a_begin + i and b_begin + i form one
  // two-row tile (each row's sum is the one any tile computes), their outputs put back in place.
  static void run_two_streams(const MatmulTask& task, int64_t a_begin, int64_t a_end,
                              int64_t b_begin, int64_t b_end) {
    const bool direct = kDirectRows == 1 && !widened_before_use(task.w.dtype) &&
                        (task.w.dtype == DType::kF32 || task.n < kPackFromTokens) &&
                        task.n <= kDirectTokens;
    const int64_t common = direct ? std::min(a_end - a_begin, b_end - b_begin) : 0;
    if (common > 0) {
      const int64_t K = task.w.cols;
      const int64_t x_stride = task.x_stride ? task.x_stride : K;
      const int64_t y_stride = task.y_stride ? task.y_stride : task.w.rows;
      const KSpan whole_rows{K, 0, K};
      const float* x_rows[kDirectTokens];
      for (int t = 0; t < task.n; ++t) x_rows[t] = task.x + t * x_stride;
      begin_stream(task.w.row(a_begin));
      begin_stream(task.w.row(b_begin));
      float pair[2 * kDirectTokens];
      TileFn tiles[kDirectTokens];
      const int chunks = pick_chunks(task.w.dtype, 2, task.n, kTwoStreamTileTokens, tiles);
      for (int64_t i = 0; i < common; ++i) {
        const void* w_rows[2] = {task.w.row(a_begin + i), task.w.row(b_begin + i)};
        for (int c = 0; c < chunks; ++c)
          tiles[c](w_rows, x_rows + c * kTwoStreamTileTokens, whole_rows,
                   pair + 2 * c * kTwoStreamTileTokens, 2);
        for (int64_t t = 0; t < task.n; ++t) {
          task.y[t * y_stride + a_begin + i] = pair[2 * t];
          task.y[t * y_stride + b_begin + i] = pair[2 * t + 1];
        }
      }
    }
    run(task, a_begin + common, a_end);
    run(task, b_begin + common, b_end);
  }

  static void run(const MatmulTask& task, int64_t row_begin, int64_t row_end) {
    if (row_begin >= row_end) return;
    const int64_t K = task.w.cols;
    const int64_t x_stride = task.x_stride ? task.x_stride : K;
    const int64_t y_stride = task.y_stride ? task.y_stride : task.w.rows;
    // Quantized and block-scaled weights are always widened into the packed tile first (for
    // quantized types the exact mode: F32 weights times F32 activations), whatever the token
    // count.
    const bool pack = widened_before_use(task.w.dtype) ||
                      (task.w.dtype != DType::kF32 && task.n >= kPackFromTokens);
    const void* w_rows[kMR];
    if (!pack) begin_stream(task.w.row(row_begin));
    if (!pack && kDirectRows == 1 && task.n <= kDirectTokens) {
      // The decode case: one tile kernel for every row (and chunk of tokens), called directly.
      const KSpan whole_rows{K, 0, K};
      const float* x_rows[kDirectTokens];
      for (int t = 0; t < task.n; ++t) x_rows[t] = task.x + t * x_stride;
      TileFn tiles[kDirectTokens];
      const int chunks = pick_chunks(task.w.dtype, 1, task.n, kStreamedTileTokens, tiles);
      for (int64_t row = row_begin; row < row_end; ++row) {
        w_rows[0] = task.w.row(row);
        for (int c = 0; c < chunks; ++c)
          tiles[c](w_rows, x_rows + c * kStreamedTileTokens, whole_rows,
                   task.y + c * kStreamedTileTokens * y_stride + row, y_stride);
      }
      return;
    }
    if (!pack) {
      for (int64_t row = row_begin; row < row_end; row += kDirectRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kDirectRows, row_end - row));
        for (int m = 0; m < rows; ++m) w_rows[m] = task.w.row(row + m);
        run_tokens(w_rows, false, task.w.dtype, rows, task, x_stride, y_stride, row, 0, task.n);
      }
      return;
    }
    thread_local ScratchVector<float> packed;
    if (packed.size() < static_cast<size_t>(kMR * K)) packed.resize(static_cast<size_t>(kMR * K));
    // Rows longer than kKBlock are multiplied a block of k at a time, so that the block of the
    // packed tile stays in L1 while every token of the token block passes (mini's down
    // projection, 2816 columns: 4 packed rows are 45 KiB; measured in docs/PERFORMANCE.md).
    const int64_t k_block = Simd::kKBlock > 0 && K > Simd::kKBlock ? Simd::kKBlock : K;
    thread_local ScratchVector<float> partials;
    if (k_block < K)
      partials.resize(static_cast<size_t>((kTokenBlock + kNR - 1) / kNR) * kMR * kNR * kLanes);
    for (int64_t t0 = 0; t0 < task.n; t0 += kTokenBlock) {
      const int64_t t1 = std::min(task.n, t0 + kTokenBlock);
      for (int64_t row = row_begin; row < row_end; row += kMR) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, row_end - row));
        for (int m = 0; m < rows; ++m) {
          float* dst = packed.data() + m * K;
          widen_row(task.w, row + m, dst);
          w_rows[m] = dst;
        }
        NextTilePrefetch next_tile;
        const int64_t next_rows = std::min<int64_t>(kMR, row_end - row - rows);
        if (next_rows > 0) {
          next_tile.next = reinterpret_cast<const char*>(task.w.row(row + rows));
          next_tile.end = next_tile.next + next_rows * static_cast<int64_t>(task.w.row_bytes());
          const int64_t calls = (K + k_block - 1) / k_block * ((t1 - t0 + kNR - 1) / kNR);
          next_tile.bytes_per_tile_call =
              ((next_tile.end - next_tile.next) / calls + kCacheLineBytes) & ~(kCacheLineBytes - 1);
        }
        for (int64_t k0 = 0; k0 < K; k0 += k_block)
          run_tokens(w_rows, true, DType::kF32, rows, task, x_stride, y_stride, row, t0, t1, k0,
                     std::min(K, k0 + k_block), partials.data(), &next_tile);
      }
    }
  }
};

}  // namespace moeline::kernels::detail
