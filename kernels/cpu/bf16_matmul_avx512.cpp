// The BF16 fast mode on AVX512_BF16 (bf16_matmul.h): one vdpbf16ps per 32 weights of a row and
// token, the weights loaded as stored. A tile of M rows × N tokens keeps M·N accumulators; every
// (row, token) sum runs over the row's 32-value chunks in order, its ragged end through a masked
// load, and is reduced once, so a row's result is the same in every tile shape.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels::detail {
namespace {

constexpr int64_t kChunk = 32;  // BF16 values per vdpbf16ps
// Prefill tiles: 4 rows × up to 6 tokens = 24 accumulators, 4 weight registers and one activation
// register of the 32 zmm registers. The weight rows are read from memory once per block of
// tokens and stay in L1 while the block's token tiles pass; a tile takes as many tokens as leave
// its rows and activations in L1 together (prefill_tile_tokens).
constexpr int kRowTile = 4;
constexpr int kTokenTile = 6;
constexpr int kMinTokenTile = 4;
constexpr int64_t kTokenBlock = 64;
// Fewer tokens (decode): rows one at a time, or two at a time from a thread's two streams
// (matmul.h's StreamTuning).
constexpr int64_t kRowTilesFromTokens = 2 * kTokenTile;

// The sums of 16 or 8 accumulators at once. Each sum pairs lanes as _mm512_reduce_add_ps does
// (i with i + 8, then i with i + 4 of those, i with i + 2, then 0 with 1), so it has the bits that
// one reduction per accumulator gives (the decode tiles reduce so); the shuffles shared between
// vectors take a third of the instructions, which at 32 chunks per row were a fifth of a prefill
// tile's time. Lane 4q + e of the result is the sum of v[q + 4e].
inline __m512 halves_added(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 quarters_added(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 pairs_added(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 neighbours_added(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 sums_of_8(const __m512* v) {
  const __m512 first = quarters_added(halves_added(v[0], v[1]), halves_added(v[2], v[3]));
  const __m512 second = quarters_added(halves_added(v[4], v[5]), halves_added(v[6], v[7]));
  const __m512 paired = pairs_added(first, second);
  return neighbours_added(paired, paired);  // lanes 4q + 2, 4q + 3 repeat 4q, 4q + 1
}
inline __m512 sums_of_16(const __m512* v) {
  const __m512 a = quarters_added(halves_added(v[0], v[1]), halves_added(v[2], v[3]));
  const __m512 b = quarters_added(halves_added(v[4], v[5]), halves_added(v[6], v[7]));
  const __m512 c = quarters_added(halves_added(v[8], v[9]), halves_added(v[10], v[11]));
  const __m512 d = quarters_added(halves_added(v[12], v[13]), halves_added(v[14], v[15]));
  return neighbours_added(pairs_added(a, b), pairs_added(c, d));
}

// y[t * y_stride + m] = the sum of acc[m][t]'s lanes.
template <int M, int N>
void store_sums(__m512 (&acc)[M][N], float* y, int64_t y_stride) {
  constexpr int kCount = M * N;
  const __m512* v = &acc[0][0];  // v[m * N + t]
  auto put = [&](int index, float sum) { y[(index % N) * y_stride + index / N] = sum; };
  int done = 0;
  // A group of `size` sums from v + done: lane 4q + e holds accumulator done + q + 4e.
  auto put_group = [&](__m512 group, int size) {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, group);
    for (int q = 0; q < 4; ++q)
      for (int e = 0; e < size / 4; ++e) put(done + q + 4 * e, sums[4 * q + e]);
    done += size;
  };
  while (done + 16 <= kCount) put_group(sums_of_16(v + done), 16);
  if (done + 8 <= kCount) put_group(sums_of_8(v + done), 8);
  for (; done < kCount; ++done) put(done, _mm512_reduce_add_ps(v[done]));
}

// A tile's ragged end (the activations are zero-padded; the weights past the row's end are
// masked off) and its sums.
template <int M, int N>
void finish_tile(__m512 (&acc)[M][N], const uint16_t* const* w_rows, const uint16_t* const* x_rows,
                 int64_t K, int64_t k_full, float* y, int64_t y_stride) {
  if (k_full < K) {
    const __mmask32 mask = (__mmask32{1} << (K - k_full)) - 1;
    __m512i w[M];
    for (int m = 0; m < M; ++m) w[m] = _mm512_maskz_loadu_epi16(mask, w_rows[m] + k_full);
    for (int t = 0; t < N; ++t) {
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x_rows[t] + k_full));
      for (int m = 0; m < M; ++m)
        acc[m][t] = _mm512_dpbf16_ps(acc[m][t], reinterpret_cast<__m512bh>(w[m]), x);
    }
  }
  store_sums(acc, y, y_stride);
}

// The elements of a row that does not start on a cache line, read with aligned loads: a 64-byte
// load across two lines costs two (safetensors data starts 8-byte aligned; a decode stream of such
// loads read 27 GB/s on a Zen 5 core against 37-40 aligned) while the exact kernels' 32-byte loads
// split half as often and were not slowed. Each chunk is two aligned lines, the second kept for
// the next chunk, joined by one permute: the same 32 values, so the same sums. The row's first and
// last lines are read masked, only the row's own elements: the lanes outside it are never selected,
// and a read outside the row, harmless inside a line, is one AddressSanitizer rightly reports.
template <int M>
struct AlignedRows {
  const uint16_t* line[M];  // the cache line each row starts in
  __m512i index[M];         // permutex2var indices: the row's offset in its line + lane
  __m512i low[M];           // the line the next chunk starts in
  int64_t end[M];           // where the row ends, counted in elements from `line`

  bool set(const uint16_t* const* rows, int64_t K) {
    for (int m = 0; m < M; ++m) {
      const auto address = reinterpret_cast<uintptr_t>(rows[m]);
      const auto shift = static_cast<int16_t>((address & 63) / 2);
      // A row on a line boundary would read the line after its end below: loads as they are.
      if (shift == 0 || (address & 1) != 0) return false;
      line[m] = reinterpret_cast<const uint16_t*>(address & ~uintptr_t{63});
      index[m] = _mm512_add_epi16(
          _mm512_set1_epi16(shift),
          _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                           13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
      end[m] = shift + K;
      low[m] = _mm512_maskz_loadu_epi16(~__mmask32{0} << shift, line[m]);
    }
    return true;
  }
  // Chunk k of row m (the chunks in order, k counting elements, all but the last).
  __m512i chunk(int m, int64_t k) { return joined(m, _mm512_load_si512(line[m] + k + kChunk)); }
  // The last whole chunk, whose second line holds the row's end.
  __m512i last_chunk(int m, int64_t k) {
    const int64_t in_row = end[m] - (k + kChunk);
    const __mmask32 mask = in_row >= kChunk ? ~__mmask32{0} : (__mmask32{1} << in_row) - 1;
    return joined(m, _mm512_maskz_loadu_epi16(mask, line[m] + k + kChunk));
  }

 private:
  __m512i joined(int m, __m512i high) {
    const __m512i values = _mm512_permutex2var_epi16(low[m], index[m], high);
    low[m] = high;
    return values;
  }
};

template <int M, int N>
void tile(const uint16_t* const* w_rows, const uint16_t* const* x_rows, int64_t K, float* y,
          int64_t y_stride) {
  __m512 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < N; ++t) acc[m][t] = _mm512_setzero_ps();
  const int64_t k_full = K - K % kChunk;
  const int64_t prefetch_bytes = wide_prefetch_bytes();
  // Decode's streams (one or two rows) from memory; prefill's row tiles read from L1, where split
  // loads cost less than the permutes.
  if constexpr (M <= 2) {
    AlignedRows<M> aligned;
    if (prefetch_bytes == 0 && k_full > 0 && aligned.set(w_rows, K)) {
      auto step = [&](int64_t k, bool last) {
        __m512i w[M];
        for (int m = 0; m < M; ++m) w[m] = last ? aligned.last_chunk(m, k) : aligned.chunk(m, k);
        for (int t = 0; t < N; ++t) {
          const __m512bh x = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x_rows[t] + k));
          for (int m = 0; m < M; ++m)
            acc[m][t] = _mm512_dpbf16_ps(acc[m][t], reinterpret_cast<__m512bh>(w[m]), x);
        }
      };
      int64_t k = 0;
      for (; k + kChunk < k_full; k += kChunk) step(k, false);
      step(k, true);
      finish_tile<M, N>(acc, w_rows, x_rows, K, k_full, y, y_stride);
      return;
    }
  }
  for (int64_t k = 0; k < k_full; k += kChunk) {
    __m512i w[M];
    // A chunk is one cache line of each row: one prefetch per line, where the host wants them
    // (matmul.h's StreamTuning).
    if (prefetch_bytes > 0)
      for (int m = 0; m < M; ++m)
        _mm_prefetch(reinterpret_cast<const char*>(w_rows[m] + k) + prefetch_bytes, _MM_HINT_T0);
    for (int m = 0; m < M; ++m) w[m] = _mm512_loadu_si512(w_rows[m] + k);
    for (int t = 0; t < N; ++t) {
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x_rows[t] + k));
      for (int m = 0; m < M; ++m)
        acc[m][t] = _mm512_dpbf16_ps(acc[m][t], reinterpret_cast<__m512bh>(w[m]), x);
    }
  }
  finish_tile<M, N>(acc, w_rows, x_rows, K, k_full, y, y_stride);
}

const uint16_t* bf16_row(const MatrixView& w, int64_t r) {
  return reinterpret_cast<const uint16_t*>(w.row(r));
}

// Tokens per prefill tile for rows of `row_bytes`: as many as keep the tile's 4 weight rows and
// its activation rows in L1 together (15/16 of it), 4 to 6. A tile reads every row of both chunk
// by chunk once; when they do not fit, each chunk comes back from L2. On a Zen 5 core (48 KiB L1),
// mini's down projection (rows of 2816 values, 5.5 KiB): 4 × 6 tiles (56 KiB) ran 140-142 G
// multiply-adds/s, 4 × 4 (45 KiB) 163-166; its 1024-value rows keep 6 tokens (155 against 145).
int64_t prefill_tile_tokens(int64_t row_bytes) {
  const int64_t rows_in_l1 = l1_data_cache_bytes() * 15 / 16 / row_bytes;
  return std::clamp<int64_t>(rows_in_l1 - kRowTile, kMinTokenTile, kTokenTile);
}

// Rows [row, row + rows) times tokens [t_begin, t_end), in token tiles of up to `tile_tokens`.
void run_tokens(const MatrixView& w, const Bf16Activations& x, float* y, int64_t y_stride,
                int64_t row, int64_t rows, int64_t t_begin, int64_t t_end,
                int64_t tile_tokens = kTokenTile) {
  const uint16_t* w_rows[kRowTile];
  for (int64_t m = 0; m < rows; ++m) w_rows[m] = bf16_row(w, row + m);
  for (int64_t t = t_begin; t < t_end; t += tile_tokens) {
    const int64_t tokens = std::min(tile_tokens, t_end - t);
    const uint16_t* x_rows[kTokenTile];
    for (int64_t i = 0; i < tokens; ++i) x_rows[i] = x.row(t + i);
    float* out = y + t * y_stride + row;
    with_token_count<kRowTile>(rows, [&](auto row_count) {
      with_token_count<kTokenTile>(tokens, [&](auto token_count) {
        tile<decltype(row_count)::value, decltype(token_count)::value>(w_rows, x_rows, w.cols, out,
                                                                       y_stride);
      });
    });
  }
}

}  // namespace

void round_activations_to_bf16_avx512(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                                      Bf16Activations& out) {
  out.rows = rows;
  out.cols = cols;
  out.padded_cols = (cols + kChunk - 1) / kChunk * kChunk;
  out.values.resize(static_cast<size_t>(rows * out.padded_cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * x_stride;
    uint16_t* dst = out.values.data() + r * out.padded_cols;
    for (int64_t k = 0; k < cols; k += kChunk) {
      // Masked loads read nothing past the row and give zeros for the padding.
      const int64_t rest = std::min<int64_t>(kChunk, cols - k);
      const __mmask16 low = rest >= 16 ? __mmask16{0xffff} : (__mmask16{1} << rest) - 1;
      const __mmask16 high = rest >= 32   ? __mmask16{0xffff}
                             : rest <= 16 ? __mmask16{0}
                                          : (__mmask16{1} << (rest - 16)) - 1;
      const __m512bh rounded = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, src + k + 16),
                                                   _mm512_maskz_loadu_ps(low, src + k));
      _mm512_storeu_si512(dst + k, reinterpret_cast<__m512i>(rounded));
    }
  }
}

void bf16_matmul_rows_avx512(const MatrixView& w, const Bf16Activations& x, float* y,
                             int64_t y_stride, int64_t row_begin, int64_t row_end) {
  if (row_begin >= row_end || x.rows == 0) return;
  if (x.rows < kRowTilesFromTokens) {
    start_stream(w.row(row_begin));
    for (int64_t row = row_begin; row < row_end; ++row)
      run_tokens(w, x, y, y_stride, row, 1, 0, x.rows);
    return;
  }
  const int64_t tile_tokens = prefill_tile_tokens(static_cast<int64_t>(w.row_bytes()));
  for (int64_t t0 = 0; t0 < x.rows; t0 += kTokenBlock) {
    const int64_t t1 = std::min(x.rows, t0 + kTokenBlock);
    for (int64_t row = row_begin; row < row_end; row += kRowTile)
      run_tokens(w, x, y, y_stride, row, std::min<int64_t>(kRowTile, row_end - row), t0, t1,
                 tile_tokens);
  }
}

void bf16_matmul_rows_two_streams_avx512(const MatrixView& w, const Bf16Activations& x, float* y,
                                         int64_t y_stride, int64_t a_begin, int64_t a_end,
                                         int64_t b_begin, int64_t b_end) {
  // Rows a_begin + i and b_begin + i as one two-row tile (each row's sum is the one any tile
  // computes), their outputs put back in place. Decode only: more tokens take the row tiles.
  const int64_t common =
      x.rows <= kTokenTile ? std::min(a_end - a_begin, b_end - b_begin) : int64_t{0};
  if (common > 0) {
    const uint16_t* x_rows[kTokenTile];
    for (int64_t t = 0; t < x.rows; ++t) x_rows[t] = x.row(t);
    start_stream(w.row(a_begin));
    start_stream(w.row(b_begin));
    float pair[2 * kTokenTile];
    with_token_count<kTokenTile>(x.rows, [&](auto token_count) {
      constexpr int kTokens = decltype(token_count)::value;
      for (int64_t i = 0; i < common; ++i) {
        const uint16_t* w_rows[2] = {bf16_row(w, a_begin + i), bf16_row(w, b_begin + i)};
        tile<2, kTokens>(w_rows, x_rows, w.cols, pair, 2);
        for (int t = 0; t < kTokens; ++t) {
          y[t * y_stride + a_begin + i] = pair[2 * t];
          y[t * y_stride + b_begin + i] = pair[2 * t + 1];
        }
      }
    });
  }
  bf16_matmul_rows_avx512(w, x, y, y_stride, a_begin + common, a_end);
  bf16_matmul_rows_avx512(w, x, y, y_stride, b_begin + common, b_end);
}

}  // namespace moeline::kernels::detail
