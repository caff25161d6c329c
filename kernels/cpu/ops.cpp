#include "kernels/cpu/ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/exp_polynomial.h"

namespace moeline::kernels {

// Not under ThreadSanitizer: the clones' ifunc resolvers run during relocation, before its
// runtime is up, and crash the process when instrumented.
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define MOELINE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MOELINE_CLONES
#endif

namespace {
// Σ x² in double, in eight interleaved sums added pairwise at the end: one chain of dependent
// double additions was ~1.5 µs per 1024-wide row, serial work between the ops of a decode step
// (17 norms a step in `mini`). The order is fixed, so a row's bits do not depend on the batch.
MOELINE_CLONES double sum_of_squares(const float* row, int64_t dim) {
  constexpr int kChains = 8;
  double chains[kChains] = {};
  int64_t i = 0;
  for (; i + kChains <= dim; i += kChains)
    for (int c = 0; c < kChains; ++c) chains[c] += static_cast<double>(row[i + c]) * row[i + c];
  for (int c = 0; i < dim; ++i, ++c) chains[c] += static_cast<double>(row[i]) * row[i];
  return ((chains[0] + chains[1]) + (chains[2] + chains[3])) +
         ((chains[4] + chains[5]) + (chains[6] + chains[7]));
}
// e^x for x <= 0, the vectorized kernels' formula (exp_polynomial.h) written without a branch
// so that a loop of it vectorizes on every path: 2^n from the exponent's bits. Below -87 (where
// e^x leaves float's normal range) it is e^-87, as are -inf and negative NaNs (the clamp is an
// unsigned min of the bits: a more negative float has the greater bits).
float exp_nonpositive(float x) {
  using namespace detail::exp_polynomial;
  x = std::bit_cast<float>(std::min(std::bit_cast<uint32_t>(x), std::bit_cast<uint32_t>(kLowest)));
  const float n = (x * kLog2e + 12582912.0f) - 12582912.0f;  // to nearest: 1.5 * 2^23
  const float r = (x - n * kLn2High) - n * kLn2Low;
  float p = kCoefficients[0];
  for (int i = 1; i < 6; ++i) p = p * r + kCoefficients[i];
  p = p * (r * r) + (r + 1.0f);
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

MOELINE_CLONES double sum_exp_blocks(const float* x, int64_t n, float shift) {
  constexpr int64_t kLanes = 16, kBlock = 1024;
  double total = 0.0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float lanes[kLanes] = {};
    for (int64_t j = 0; j < kBlock; j += kLanes)
      for (int64_t k = 0; k < kLanes; ++k) lanes[k] += exp_nonpositive(x[i + j + k] - shift);
    for (float lane : lanes) total += lane;
  }
  for (; i < n; ++i) total += exp_nonpositive(x[i] - shift);
  return total;
}
}  // namespace

double sum_exp_shifted(const float* x, int64_t n, float shift) {
  return sum_exp_blocks(x, n, shift);
}

void rms_norm(const float* x, int64_t n, int64_t dim, int64_t x_stride, VectorView weight,
              float eps, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * x_stride;
    float* dst = out + r * out_stride;
    const double sum_squares = sum_of_squares(row, dim);
    const float inv_rms =
        static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(dim) + eps));
    // The weight's type taken out of the loop (VectorView's per-element switch kept it scalar).
    if (weight.dtype == DType::kF32) {
      const auto* w = static_cast<const float*>(weight.data);
      for (int64_t i = 0; i < dim; ++i) dst[i] = row[i] * inv_rms * w[i];
    } else if (weight.dtype == DType::kBF16) {
      const auto* w = static_cast<const uint16_t*>(weight.data);
      for (int64_t i = 0; i < dim; ++i) dst[i] = row[i] * inv_rms * bf16_to_float(w[i]);
    } else {
      for (int64_t i = 0; i < dim; ++i) dst[i] = row[i] * inv_rms * weight[i];
    }
  }
}

// The largest value (16 lanes at a time on AVX-512; 16 independent chains elsewhere, std::max
// keeping the chain's value where the candidate is NaN), then the first value equal to it: one
// search for every path, so the tie rule is one line. std::max_element's compare-and-branch
// chain took ~18 µs over a 32000-token vocabulary, on the thread the others wait for.
int64_t first_max_index(const float* x, int64_t n) {
  if (n <= 0 || std::isnan(x[0])) return 0;
  const Isa isa = active_isa();
  float best = x[0];
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni) {
    best = detail::largest_avx512(x, n);
  } else {
    constexpr int64_t kChains = 16;
    float chains[kChains];
    std::fill(chains, chains + kChains, x[0]);
    int64_t i = 0;
    for (; i + kChains <= n; i += kChains)
      for (int64_t c = 0; c < kChains; ++c) chains[c] = std::max(chains[c], x[i + c]);
    best = *std::max_element(chains, chains + kChains);
    for (; i < n; ++i) best = std::max(best, x[i]);
  }
  return std::find(x, x + n, best) - x;
}

void softmax(float* x, int64_t n) {
  const float max = *std::max_element(x, x + n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

namespace {
MOELINE_CLONES void silu_mul_portable(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}
}  // namespace

void silu_mul(float* gate, const float* up, int64_t n) {
  const Isa isa = active_isa();
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni) return detail::silu_mul_avx512(gate, up, n);
  if (isa == Isa::kAvx2) return detail::silu_mul_avx2(gate, up, n);
  silu_mul_portable(gate, up, n);
}

MOELINE_CLONES void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Sixteen independent partial sums: vectorisable without reassociation, and the same order on
// every call, so a dot product gives the same bits in prefill and in decode.
MOELINE_CLONES float dot(const float* a, const float* b, int64_t n) {
  float partial[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int lane = 0; lane < 16; ++lane) partial[lane] += a[i + lane] * b[i + lane];
  for (int lane = 0; i < n; ++i, ++lane) partial[lane] += a[i] * b[i];
  float sum = 0.0f;
  for (float p : partial) sum += p;
  return sum;
}

MOELINE_CLONES void dot_rows(const float* a, int64_t a_stride, int64_t count, const float* b,
                             int64_t n, float* out) {
  int64_t j = 0;
  // Four rows per pass: the same sixteen lanes per row as dot(), in the same order.
  for (; j + 4 <= count; j += 4) {
    const float* r0 = a + j * a_stride;
    const float* r1 = r0 + a_stride;
    const float* r2 = r1 + a_stride;
    const float* r3 = r2 + a_stride;
    float p0[16] = {}, p1[16] = {}, p2[16] = {}, p3[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int lane = 0; lane < 16; ++lane) {
        const float x = b[i + lane];
        p0[lane] += r0[i + lane] * x;
        p1[lane] += r1[i + lane] * x;
        p2[lane] += r2[i + lane] * x;
        p3[lane] += r3[i + lane] * x;
      }
    for (int lane = 0; i < n; ++i, ++lane) {
      p0[lane] += r0[i] * b[i];
      p1[lane] += r1[i] * b[i];
      p2[lane] += r2[i] * b[i];
      p3[lane] += r3[i] * b[i];
    }
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int lane = 0; lane < 16; ++lane) {
      s0 += p0[lane];
      s1 += p1[lane];
      s2 += p2[lane];
      s3 += p3[lane];
    }
    out[j] = s0;
    out[j + 1] = s1;
    out[j + 2] = s2;
    out[j + 3] = s3;
  }
  for (; j < count; ++j) out[j] = dot(a + j * a_stride, b, n);
}

}  // namespace moeline::kernels
