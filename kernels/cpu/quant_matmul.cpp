#include "kernels/cpu/quant_matmul.h"

#include <atomic>
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_features.h"

namespace moeline::kernels {
namespace {

std::atomic<QuantMath> g_quant_math{QuantMath::kFast};

}  // namespace

void set_quant_math(QuantMath math) {
  g_quant_math.store(math, std::memory_order_relaxed);
}
QuantMath quant_math() {
  return g_quant_math.load(std::memory_order_relaxed);
}

bool parse_quant_math(const char* text, QuantMath& math) {
  if (std::strcmp(text, "exact") == 0) {
    math = QuantMath::kExact;
    return true;
  }
  if (std::strcmp(text, "fast") == 0) {
    math = QuantMath::kFast;
    return true;
  }
  return false;
}

int64_t activation_block(DType weights) {
  return dtype_block(weights).elements == 32 ? 32 : 256;
}

namespace {

// One activation row: per block d = max|x| / 127, q = x / d rounded to nearest even, and the sum
// of every 16 q (detail::quantize_activation_row_avx512 gives the same bytes, scales and sums).
void quantize_activation_row(const float* src, int64_t cols, int64_t block, int8_t* q,
                             float* scales, int32_t* sums) {
  for (int64_t b = 0; b < cols / block; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(src[b * block + i]));
    const float d = amax / 127.0f;
    const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    for (int64_t i = 0; i < block; ++i)
      q[b * block + i] = static_cast<int8_t>(std::lrintf(src[b * block + i] * inverse));
    scales[b] = d;
  }
  for (int64_t s = 0; s < cols / 16; ++s) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[s * 16 + i];
    sums[s] = sum;
  }
}

}  // namespace

void quantize_activations(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                          int64_t block, QuantizedActivations& out) {
  out.rows = rows;
  out.cols = cols;
  out.block = block;
  out.q.resize(static_cast<size_t>(rows * cols));
  out.scale.resize(static_cast<size_t>(rows * (cols / block)));
  out.sums.resize(static_cast<size_t>(rows * (cols / 16)));
  const Isa isa = active_isa();
  const auto row = isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni
                       ? detail::quantize_activation_row_avx512
                   : isa == Isa::kAvx2 ? detail::quantize_activation_row_avx2
                                       : quantize_activation_row;
  for (int64_t r = 0; r < rows; ++r)
    row(x + r * x_stride, cols, block, out.q.data() + r * cols,
        out.scale.data() + r * (cols / block), out.sums.data() + r * (cols / 16));
  if (block != 256) {
    out.q_nibble_order.clear();
    out.min_pairs.clear();
    return;
  }
  out.min_pairs.resize(out.sums.size() / 4);
  for (size_t i = 0; i < out.min_pairs.size(); ++i) {
    const int32_t* sums = out.sums.data() + 4 * i;
    const int32_t low = sums[0] + sums[1], high = sums[2] + sums[3];
    out.min_pairs[i] =
        static_cast<int32_t>(static_cast<uint16_t>(low) | static_cast<uint32_t>(high) << 16);
  }
  out.q_nibble_order.resize(out.q.size());
  // Quarter i of every 128 values in the nibble order is quarter kQuarterOf[i] of q.
  constexpr int kQuarterOf[4] = {0, 2, 1, 3};
  for (size_t half = 0; half < out.q.size(); half += 128)
    for (int i = 0; i < 4; ++i)
      std::memcpy(out.q_nibble_order.data() + half + 32 * i,
                  out.q.data() + half + 32 * kQuarterOf[i], 32);
}

namespace detail {

namespace {

// One row against one activation row, written from the block layouts (quant.h).
float dot_row(DType dtype, const uint8_t* w, int64_t cols, const int8_t* x, const float* dx,
              const int32_t* sums) {
  float y = 0.0f;
  switch (dtype) {
    case DType::kQ8_0:
    case DType::kQ4_0: {
      const bool q8 = dtype == DType::kQ8_0;
      const int64_t bytes = q8 ? 34 : 18;
      for (int64_t b = 0; b < cols / 32; ++b) {
        const uint8_t* block = w + b * bytes;
        const int8_t* xb = x + b * 32;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) {
          const int value = q8 ? static_cast<int8_t>(block[2 + i])
                               : (i < 16 ? (block[2 + i] & 0xF) : (block[2 + i - 16] >> 4)) - 8;
          sum += value * xb[i];
        }
        y += f16_at(block) * dx[b] * static_cast<float>(sum);
      }
      return y;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      const bool fifth = dtype == DType::kQ5_K;
      const int64_t bytes = fifth ? 176 : 144;
      for (int64_t b = 0; b < cols / 256; ++b) {
        const uint8_t* block = w + b * bytes;
        uint8_t scales[16];
        k_scales(block + 4, scales);
        const uint8_t* sc = scales;
        const uint8_t* mn = scales + 8;
        const uint8_t* qs = block + (fifth ? 48 : 16);
        const uint8_t* qh = block + 16;
        const int8_t* xb = x + b * 256;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t sum = 0;
          for (int l = 0; l < 32; ++l) {
            int value = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
            if (fifth && ((qh[l] >> j) & 1)) value += 16;
            sum += value * xb[32 * j + l];
          }
          sumi += sc[j] * sum;
          summ += mn[j] * (sums[b * 16 + 2 * j] + sums[b * 16 + 2 * j + 1]);
        }
        y += dx[b] * (f16_at(block) * static_cast<float>(sumi) -
                      f16_at(block + 2) * static_cast<float>(summ));
      }
      return y;
    }
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ5_1: {
      // w = d q + m (Q5_0: m = -16 d): y += d_w d_x Σ q x + m d_x Σ x.
      const bool fifth = dtype != DType::kQ4_1, with_min = dtype != DType::kQ5_0;
      const int64_t bytes = kernels::dtype_block(dtype).bytes;
      for (int64_t b = 0; b < cols / 32; ++b) {
        const uint8_t* block = w + b * bytes;
        const float d = f16_at(block);
        const float m = with_min ? f16_at(block + 2) : -16.0f * d;
        const uint8_t* after = block + (with_min ? 4 : 2);
        uint32_t high = 0;
        if (fifth) std::memcpy(&high, after, 4);
        const uint8_t* q = after + (fifth ? 4 : 0);
        const int8_t* xb = x + b * 32;
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) {
          const int low = (q[j] & 0xF) | (fifth ? static_cast<int>((high >> j) & 1) << 4 : 0);
          const int top = (q[j] >> 4) | (fifth ? static_cast<int>((high >> (j + 16)) & 1) << 4 : 0);
          sum += low * xb[j] + top * xb[j + 16];
        }
        y += dx[b] *
             (d * static_cast<float>(sum) + m * static_cast<float>(sums[2 * b] + sums[2 * b + 1]));
      }
      return y;
    }
    case DType::kQ6_K:
      for (int64_t b = 0; b < cols / 256; ++b) {
        const uint8_t* block = w + b * 210;
        const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
        const int8_t* xb = x + b * 256;
        int32_t sumi = 0;
        for (int s = 0; s < 16; ++s) {
          int32_t sum = 0;
          for (int i = 0; i < 16; ++i) {
            const int k = 16 * s + i;  // weight 128 h + 32 quarter + l
            const int h = k / 128, quarter = (k % 128) / 32, l = k % 32;
            const uint8_t low = block[64 * h + (quarter % 2) * 32 + l];
            const uint8_t high = block[128 + 32 * h + l];
            const int value =
                ((low >> (4 * (quarter / 2))) & 0xF) | (((high >> (2 * quarter)) & 3) << 4);
            sum += value * xb[k];
          }
          sumi += sc[s] * (sum - 32 * sums[b * 16 + s]);
        }
        y += dx[b] * f16_at(block + 208) * static_cast<float>(sumi);
      }
      return y;
    default:
      return 0.0f;
  }
}

}  // namespace

void quant_matmul_rows_portable(const MatrixView& w, const QuantizedActivations& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
    for (int64_t t = 0; t < x.rows; ++t)
      y[t * y_stride + r] = dot_row(w.dtype, row, w.cols, x.row(t), x.row_scales(t), x.row_sums(t));
  }
}

}  // namespace detail

void quant_matmul_rows(const MatrixView& w, const QuantizedActivations& x, float* y,
                       int64_t y_stride, int64_t row_begin, int64_t row_end) {
  switch (active_isa()) {
    case Isa::kAvx512Vnni:
      return detail::quant_matmul_rows_avx512_vnni(w, x, y, y_stride, row_begin, row_end);
    case Isa::kAvx512:
      return detail::quant_matmul_rows_avx512(w, x, y, y_stride, row_begin, row_end);
    case Isa::kAvx2:
      return detail::quant_matmul_rows_avx2(w, x, y, y_stride, row_begin, row_end);
    case Isa::kPortable:
      return detail::quant_matmul_rows_portable(w, x, y, y_stride, row_begin, row_end);
  }
}

bool quant_two_streams(DType weights) {
  const Isa isa = active_isa();
  // AVX2 decode reads rows in lockstep groups with the next group prefetched (one stream that
  // the software prefetches lead: faster on Zen 3 than two streams of rows read alone, and than
  // groups of four rows from each half of a thread's share, medians 3-8% slower for Q8_0, Q4_0
  // and Q6_K; session 39).
  return (isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni) &&
         (weights == DType::kQ8_0 || weights == DType::kQ4_0 || weights == DType::kQ6_K);
}

void quant_matmul_rows_two_streams(const MatrixView& w, const QuantizedActivations& x, float* y,
                                   int64_t y_stride, int64_t a_begin, int64_t a_end,
                                   int64_t b_begin, int64_t b_end) {
  switch (active_isa()) {
    case Isa::kAvx512Vnni:
      return detail::quant_matmul_rows_two_streams_avx512_vnni(w, x, y, y_stride, a_begin, a_end,
                                                               b_begin, b_end);
    case Isa::kAvx512:
      return detail::quant_matmul_rows_two_streams_avx512(w, x, y, y_stride, a_begin, a_end,
                                                          b_begin, b_end);
    default:
      quant_matmul_rows(w, x, y, y_stride, a_begin, a_end);
      quant_matmul_rows(w, x, y, y_stride, b_begin, b_end);
  }
}

}  // namespace moeline::kernels
