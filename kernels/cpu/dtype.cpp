#include "kernels/cpu/dtype.h"

#include <cmath>

#include "kernels/cpu/quant.h"

namespace moeline::kernels {

// IEEE 754 binary16, including subnormals, infinities and NaN; only used off the hot path (the
// SIMD paths convert with F16C instructions).
float f16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  return sign ? -magnitude : magnitude;
}

float e4m3_to_float(uint8_t byte) {
  if (e4m3_is_nan(byte)) return NAN;
  return f16_to_float(e4m3_as_f16_bits(byte)) * 256.0f;
}

void widen(const void* src, DType dtype, int64_t count, float* dst) {
  if (is_quantized(dtype)) {
    dequantize_row(quant_type(dtype), src, count, dst);
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    switch (dtype) {
      case DType::kF32:
        dst[i] = static_cast<const float*>(src)[i];
        break;
      case DType::kBF16:
        dst[i] = bf16_to_float(static_cast<const uint16_t*>(src)[i]);
        break;
      case DType::kF16:
        dst[i] = f16_to_float(static_cast<const uint16_t*>(src)[i]);
        break;
      case DType::kF8E4M3:  // unscaled: widen_row applies a matrix's block scales
        dst[i] = e4m3_to_float(static_cast<const uint8_t*>(src)[i]);
        break;
      default:
        break;
    }
  }
}

void widen_row(const MatrixView& w, int64_t r, float* dst) {
  widen(w.row(r), w.dtype, w.cols, dst);
  if (!has_block_scales(w.dtype)) return;
  const float* scales = w.row_scales(r);
  for (int64_t c = 0; c < w.cols; ++c) dst[c] *= scales[c / w.scale_block_cols];
}

}  // namespace moeline::kernels
