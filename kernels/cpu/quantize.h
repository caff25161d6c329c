#pragma once
// Float weights to GGUF's block types (the inverse of quant.h's dequantization), for
// `moeline quantize`. Each block's scales are chosen by a small search that minimises the squared
// error of the block, as llama.cpp's reference quantizers do (its make_qkx2_quants for the
// K-quants' scale and min, make_qx_quants for Q6_K's symmetric scales); Q8_0 and Q4_0 take the
// plain absmax scale, as llama.cpp's do.

#include <cstdint>

#include "kernels/cpu/dtype.h"

namespace moeline::kernels {

// `n` weights (whole blocks of `dtype`) into stored_bytes(dtype, n) bytes at `out`. F32, F16 and
// BF16 are converted (round to nearest even).
void quantize_row(DType dtype, const float* x, int64_t n, void* out);

}  // namespace moeline::kernels
