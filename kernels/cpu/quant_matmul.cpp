#include "kernels/cpu/quant_matmul.h"

#include <atomic>
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_features.h"

namespace moeline::kernels {
namespace {

std::atomic<QuantMath> g_quant_math{QuantMath::kFast};

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return f16_to_float(bits);
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 scale bytes (quant.h).
void k_scale_min(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

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

void quantize_activations(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                          QuantizedActivations& out) {
  out.rows = rows;
  out.cols = cols;
  const int64_t groups = cols / kActivationGroup;
  out.q.resize(static_cast<size_t>(rows * cols));
  out.scale.resize(static_cast<size_t>(rows * groups));
  out.sum.resize(static_cast<size_t>(rows * groups));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * x_stride;
    int8_t* q = out.q.data() + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.0f;
      for (int64_t i = 0; i < kActivationGroup; ++i)
        amax = std::max(amax, std::fabs(src[g * kActivationGroup + i]));
      const float d = amax / 127.0f;
      const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int64_t i = 0; i < kActivationGroup; ++i) {
        const auto v = static_cast<int8_t>(std::lrintf(src[g * kActivationGroup + i] * inverse));
        q[g * kActivationGroup + i] = v;
        sum += v;
      }
      out.scale[static_cast<size_t>(r * groups + g)] = d;
      out.sum[static_cast<size_t>(r * groups + g)] = sum;
    }
  }
}

void unpack_group(DType dtype, const void* row, int64_t g, WeightGroup& out) {
  const auto* bytes = static_cast<const uint8_t*>(row);
  switch (dtype) {
    case DType::kQ8_0: {
      const uint8_t* block = bytes + g * 34;
      out.lo = out.hi = half_at(block);
      out.min = 0.0f;
      std::memcpy(out.q, block + 2, 32);
      return;
    }
    case DType::kQ4_0: {
      const uint8_t* block = bytes + g * 18;
      out.lo = out.hi = half_at(block);
      out.min = 0.0f;
      for (int j = 0; j < 16; ++j) {
        out.q[j] = static_cast<int8_t>((block[2 + j] & 0xF) - 8);
        out.q[j + 16] = static_cast<int8_t>((block[2 + j] >> 4) - 8);
      }
      return;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      const bool fifth = dtype == DType::kQ5_K;
      const uint8_t* block = bytes + (g / 8) * (fifth ? 176 : 144);
      const int j = static_cast<int>(g % 8);
      int scale = 0, min = 0;
      k_scale_min(j, block + 4, scale, min);
      out.lo = out.hi = half_at(block) * static_cast<float>(scale);
      out.min = half_at(block + 2) * static_cast<float>(min);
      const uint8_t* qs = block + (fifth ? 48 : 16) + 32 * (j / 2);
      const int shift = (j % 2) * 4;
      for (int l = 0; l < 32; ++l) {
        int v = (qs[l] >> shift) & 0xF;
        if (fifth && (block[16 + l] >> j) & 1) v += 16;
        out.q[l] = static_cast<int8_t>(v);
      }
      return;
    }
    case DType::kQ6_K: {
      const uint8_t* block = bytes + (g / 8) * 210;
      const int j = static_cast<int>(g % 8);  // 32-weight group in the 256: half j/4, quarter j%4
      const int half = j / 4, quarter = j % 4;
      const uint8_t* low = block + 64 * half + (quarter % 2) * 32;
      const uint8_t* high = block + 128 + 32 * half;
      const auto* scales = reinterpret_cast<const int8_t*>(block + 192) + 8 * half + 2 * quarter;
      const float d = half_at(block + 208);
      out.lo = d * static_cast<float>(scales[0]);
      out.hi = d * static_cast<float>(scales[1]);
      out.min = 0.0f;
      const int low_shift = (quarter / 2) * 4, high_shift = 2 * quarter;
      for (int l = 0; l < 32; ++l)
        out.q[l] = static_cast<int8_t>(
            (((low[l] >> low_shift) & 0xF) | (((high[l] >> high_shift) & 3) << 4)) - 32);
      return;
    }
    default:
      std::memset(out.q, 0, sizeof out.q);
      out.lo = out.hi = out.min = 0.0f;
      return;
  }
}

namespace detail {

void quant_matmul_rows_portable(const MatrixView& w, const QuantizedActivations& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end) {
  const int64_t groups = w.cols / kActivationGroup;
  WeightGroup group;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const std::byte* row = w.row(r);
    for (int64_t t = 0; t < x.rows; ++t) y[t * y_stride + r] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      unpack_group(w.dtype, row, g, group);
      for (int64_t t = 0; t < x.rows; ++t) {
        const int8_t* xq = x.row(t) + g * kActivationGroup;
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) lo += static_cast<int32_t>(group.q[i]) * xq[i];
        for (int i = 16; i < 32; ++i) hi += static_cast<int32_t>(group.q[i]) * xq[i];
        const size_t at = static_cast<size_t>(t * groups + g);
        y[t * y_stride + r] +=
            x.scale[at] * (group.lo * static_cast<float>(lo) + group.hi * static_cast<float>(hi) -
                           group.min * static_cast<float>(x.sum[at]));
      }
    }
  }
}

}  // namespace detail

void quant_matmul_rows(const MatrixView& w, const QuantizedActivations& x, float* y,
                       int64_t y_stride, int64_t row_begin, int64_t row_end) {
  if (active_isa() == Isa::kPortable)
    return detail::quant_matmul_rows_portable(w, x, y, y_stride, row_begin, row_end);
  return detail::quant_matmul_rows_avx2(w, x, y, y_stride, row_begin, row_end);
}

}  // namespace moeline::kernels
