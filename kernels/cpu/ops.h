#pragma once
// Element-wise and row-wise ops of the forward pass. All act on F32 activations; weights (norm
// scales) may be any DType and are read in place.

#include <cstdint>

#include "kernels/cpu/dtype.h"

namespace moeline::kernels {

// out = x / sqrt(mean(x²) + eps) * weight, row by row (n rows of `dim`); out may alias x. The mean
// is accumulated in double so that long rows lose nothing to summation order.
void rms_norm(const float* x, int64_t n, int64_t dim, int64_t x_stride, VectorView weight,
              float eps, float* out, int64_t out_stride);

// In-place softmax over n values, computed stably (max subtracted).
void softmax(float* x, int64_t n);

// std::max_element's index (the first maximum; a NaN never wins unless it comes first; 0 for
// n <= 0), vectorized: greedy decoding takes it over the whole vocabulary every step.
int64_t first_max_index(const float* x, int64_t n);

// Σ exp(x[i] - shift) for a `shift` no smaller than any x[i] (the softmax's normalizer: what a
// token's log-probability needs over the whole vocabulary), vectorized: each exp in single
// precision (relative error under 2e-7), summed in float lanes over blocks of 1024 and the blocks
// in double. A whole vocabulary of double exps took ~0.6 ms at 152k tokens, per token asked for
// with logprobs and per prompt token scored.
double sum_exp_shifted(const float* x, int64_t n, float shift);

// gate[i] = silu(gate[i]) * up[i]
void silu_mul(float* gate, const float* up, int64_t n);

// y += a * x
void axpy(float a, const float* x, float* y, int64_t n);

float dot(const float* a, const float* b, int64_t n);

// out[j] = dot(a + j * a_stride, b, n) for j < count, each bit-identical to dot(): several rows
// against one b at once, so their accumulations overlap instead of waiting on one another.
void dot_rows(const float* a, int64_t a_stride, int64_t count, const float* b, int64_t n,
              float* out);

namespace detail {
void silu_mul_avx512(float* gate, const float* up, int64_t n);  // ops_avx512.cpp
float largest_avx512(const float* x, int64_t n);                // ops_avx512.cpp, x[0] not NaN
void silu_mul_avx2(float* gate, const float* up, int64_t n);    // ops_avx2.cpp
}  // namespace detail

}  // namespace moeline::kernels
