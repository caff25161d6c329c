#include "kernels/cpu/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace moeline::kernels {
namespace {

// IEEE binary16, round to nearest even (subnormals included, overflow to infinity).
uint16_t to_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0));
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (magnitude < 0x38800000u) {  // subnormal half: value / 2^-24, rounded to nearest even
    float scaled;
    const uint32_t m = magnitude;
    std::memcpy(&scaled, &m, sizeof scaled);
    return static_cast<uint16_t>(sign |
                                 static_cast<uint32_t>(std::nearbyint(scaled * 16777216.0f)));
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u) - (112u << 23);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

void put_half(uint8_t* at, float value) {
  const uint16_t half = to_half(value);
  std::memcpy(at, &half, sizeof half);
}

float stored_half(float value) {
  return f16_to_float(to_half(value));
}

int nearest(float value) {
  return static_cast<int>(std::nearbyint(value));
}

void q8_0(const float* x, uint8_t* block) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
  put_half(block, d);
  for (int i = 0; i < 32; ++i)
    block[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(nearest(x[i] * inverse)));
}

void q4_0(const float* x, uint8_t* block) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < 32; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  const float d = max / -8.0f;  // the largest magnitude maps to -8
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(block, d);
  for (int j = 0; j < 16; ++j) {
    const int low = std::min(15, static_cast<int>(x[j] * inverse + 8.5f));
    const int high = std::min(15, static_cast<int>(x[j + 16] * inverse + 8.5f));
    block[2 + j] = static_cast<uint8_t>(std::max(0, low) | (std::max(0, high) << 4));
  }
}

// x ≈ scale * q - min with q in [0, levels] over n weights: the (scale, min >= 0) of least squared
// error over a sweep of candidate step sizes, each refined by least squares for its rounding.
void fit_affine(const float* x, int n, int levels, float& scale, float& min) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  lo = std::min(lo, 0.0f);
  if (hi <= lo) {
    scale = 0.0f;
    min = -lo;
    return;
  }
  scale = (hi - lo) / static_cast<float>(levels);
  min = -lo;
  auto error_of = [&](float s, float m) {
    double e = 0.0;
    const float inverse = s > 0 ? 1.0f / s : 0.0f;
    for (int i = 0; i < n; ++i) {
      const int q = std::clamp(nearest((x[i] + m) * inverse), 0, levels);
      const double diff = static_cast<double>(s) * q - m - x[i];
      e += diff * diff;
    }
    return e;
  };
  double best = error_of(scale, min);
  for (int step = -10; step <= 10; ++step) {
    const float inverse =
        (static_cast<float>(levels) + 0.1f * static_cast<float>(step)) / (hi - lo);
    // Least squares of s * q + b over the rounding this step gives, then min = -b clamped.
    double sq = 0, sqq = 0, sx = 0, sqx = 0;
    for (int i = 0; i < n; ++i) {
      const int q = std::clamp(nearest(inverse * (x[i] - lo)), 0, levels);
      sq += q;
      sqq += static_cast<double>(q) * q;
      sx += x[i];
      sqx += static_cast<double>(q) * x[i];
    }
    const double det = n * sqq - sq * sq;
    if (det <= 0) continue;
    double s = (n * sqx - sq * sx) / det;
    double b = (sqq * sx - sq * sqx) / det;
    if (b > 0) {  // the min must not be negative: refit the scale with b = 0
      b = 0;
      s = sqq > 0 ? sqx / sqq : 0;
    }
    if (s <= 0) continue;
    const double e = error_of(static_cast<float>(s), static_cast<float>(-b));
    if (e < best) {
      best = e;
      scale = static_cast<float>(s);
      min = static_cast<float>(-b);
    }
  }
}

// Q4_K (levels 15) and Q5_K (levels 31): eight 32-weight sub-blocks, 6-bit scales and mins.
void q45_k(const float* x, uint8_t* block, bool fifth) {
  const int levels = fifth ? 31 : 15;
  float scales[8], mins[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    fit_affine(x + 32 * j, 32, levels, scales[j], mins[j]);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float d = stored_half(max_scale / 63.0f), dmin = stored_half(max_min / 63.0f);
  put_half(block, d);
  put_half(block + 2, dmin);
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = static_cast<uint8_t>(std::clamp(d > 0 ? nearest(scales[j] / d) : 0, 0, 63));
    mn[j] = static_cast<uint8_t>(std::clamp(dmin > 0 ? nearest(mins[j] / dmin) : 0, 0, 63));
  }
  uint8_t* packed = block + 4;
  for (int j = 0; j < 4; ++j) {
    packed[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    packed[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    packed[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
  uint8_t q[256];
  for (int j = 0; j < 8; ++j) {
    const float step = d * sc[j], offset = dmin * mn[j];
    for (int i = 0; i < 32; ++i)
      q[32 * j + i] = static_cast<uint8_t>(
          step > 0 ? std::clamp(nearest((x[32 * j + i] + offset) / step), 0, levels) : 0);
  }
  uint8_t* high = block + 16;
  uint8_t* nibbles = block + (fifth ? 48 : 16);
  if (fifth) std::memset(high, 0, 32);
  for (int group = 0; group < 4; ++group)
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = q[64 * group + l], b = q[64 * group + 32 + l];
      nibbles[32 * group + l] = static_cast<uint8_t>((a & 0xF) | ((b & 0xF) << 4));
      if (fifth)
        high[l] = static_cast<uint8_t>(high[l] | ((a >> 4) << (2 * group)) |
                                       ((b >> 4) << (2 * group + 1)));
    }
}

// x ≈ scale * q, q in [-32, 31] over 16 weights: the scale of least squared error over a sweep.
float fit_symmetric(const float* x) {
  float amax = 0, max = 0;
  for (int i = 0; i < 16; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  if (amax == 0) return 0;
  float best_scale = max / -32.0f;
  double best = 1e300;
  for (int step = -9; step <= 9; ++step) {
    const float inverse = -(32.0f + 0.1f * static_cast<float>(step)) / max;
    double sqx = 0, sqq = 0;
    for (int i = 0; i < 16; ++i) {
      const int q = std::clamp(nearest(inverse * x[i]), -32, 31);
      sqx += static_cast<double>(q) * x[i];
      sqq += static_cast<double>(q) * q;
    }
    if (sqq <= 0) continue;
    const double s = sqx / sqq;
    double e = 0;
    for (int i = 0; i < 16; ++i) {
      const int q = std::clamp(nearest(static_cast<float>(x[i] / s)), -32, 31);
      e += (s * q - x[i]) * (s * q - x[i]);
    }
    if (e < best) {
      best = e;
      best_scale = static_cast<float>(s);
    }
  }
  return best_scale;
}

void q6_k(const float* x, uint8_t* block) {
  float scales[16];
  float max_abs = 0, max_scale = 0;
  for (int s = 0; s < 16; ++s) {
    scales[s] = fit_symmetric(x + 16 * s);
    if (std::fabs(scales[s]) > max_abs) {
      max_abs = std::fabs(scales[s]);
      max_scale = scales[s];
    }
  }
  const float d = stored_half(max_scale / -128.0f);
  auto* sc = reinterpret_cast<int8_t*>(block + 192);
  uint8_t q[256];
  for (int s = 0; s < 16; ++s) {
    sc[s] = static_cast<int8_t>(std::clamp(d != 0 ? nearest(scales[s] / d) : 0, -128, 127));
    const float step = d * sc[s];
    for (int i = 0; i < 16; ++i)
      q[16 * s + i] = static_cast<uint8_t>(
          (step != 0 ? std::clamp(nearest(x[16 * s + i] / step), -32, 31) : 0) + 32);
  }
  put_half(block + 208, d);
  for (int half = 0; half < 2; ++half) {
    uint8_t* low = block + 64 * half;
    uint8_t* high = block + 128 + 32 * half;
    const uint8_t* v = q + 128 * half;
    for (int l = 0; l < 32; ++l) {
      low[l] = static_cast<uint8_t>((v[l] & 0xF) | ((v[l + 64] & 0xF) << 4));
      low[l + 32] = static_cast<uint8_t>((v[l + 32] & 0xF) | ((v[l + 96] & 0xF) << 4));
      high[l] = static_cast<uint8_t>((v[l] >> 4) | ((v[l + 32] >> 4) << 2) |
                                     ((v[l + 64] >> 4) << 4) | ((v[l + 96] >> 4) << 6));
    }
  }
}

}  // namespace

void quantize_row(DType dtype, const float* x, int64_t n, void* out) {
  auto* bytes = static_cast<uint8_t*>(out);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, x, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) put_half(bytes + 2 * i, x[i]);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = float_to_bf16(x[i]);
        std::memcpy(bytes + 2 * i, &b, 2);
      }
      return;
    case DType::kQ8_0:
      for (int64_t b = 0; b < n / 32; ++b) q8_0(x + 32 * b, bytes + 34 * b);
      return;
    case DType::kQ4_0:
      for (int64_t b = 0; b < n / 32; ++b) q4_0(x + 32 * b, bytes + 18 * b);
      return;
    case DType::kQ4_K:
      for (int64_t b = 0; b < n / 256; ++b) q45_k(x + 256 * b, bytes + 144 * b, false);
      return;
    case DType::kQ5_K:
      for (int64_t b = 0; b < n / 256; ++b) q45_k(x + 256 * b, bytes + 176 * b, true);
      return;
    case DType::kQ6_K:
      for (int64_t b = 0; b < n / 256; ++b) q6_k(x + 256 * b, bytes + 210 * b);
      return;
    case DType::kQ4_1:  // read only: llama.cpp's fallbacks, which moeline quantize never picks
    case DType::kQ5_0:
    case DType::kQ5_1:
    case DType::kF8E4M3:  // read only: FP8 checkpoints are converted from, never written
      std::memset(out, 0, stored_bytes(dtype, n));
      return;
  }
}

}  // namespace moeline::kernels
