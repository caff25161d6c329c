#pragma once
// Block-quantized weight types as GGUF stores them (ggml's type ids), and their dequantization
// to F32 exactly as the format defines it. A row of `n` weights is n / block_elements blocks of
// block_bytes each; a block holds its own scales.
//
//   Q8_0  32 weights: f16 d, int8 q[32]                           w = d * q
//   Q4_0  32 weights: f16 d, 16 bytes of nibbles                  w = d * (nibble - 8); byte j
//         holds weight j (low nibble) and weight j + 16 (high nibble)
//   Q4_K  256 weights: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
//         32, 128 bytes of nibbles                                w = d*scale*nibble - dmin*min
//   Q5_K  as Q4_K, plus 32 bytes of fifth bits (qh)               w = d*scale*(nibble + 16*bit)
//                                                                     - dmin*min
//   Q6_K  256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, int8 scales for 16
//         sub-blocks of 16, f16 d                                 w = d * scale * (q6 - 32)
//   Q4_1  32 weights: f16 d, f16 m, 16 bytes of nibbles (as Q4_0)  w = d * nibble + m
//   Q5_0  32 weights: f16 d, 32 fifth bits (bit j: weight j), 16 bytes of nibbles
//                                                                 w = d * (q5 - 16)
//   Q5_1  as Q5_0 with f16 m after d                              w = d * q5 + m
// The K-quants' byte l of a 64-weight group supplies weights l (low nibble) and l + 32 (high).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "kernels/cpu/dtype.h"

namespace moeline::kernels {

enum class QuantType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

struct QuantTraits {
  QuantType type;
  std::string_view name;
  int64_t block_elements;  // weights per block (1 for F32, F16, BF16)
  int64_t block_bytes;
};

// The traits of a ggml type id this build reads; nullopt for any other.
std::optional<QuantTraits> quant_traits(uint32_t ggml_type);
// ggml's name for any type id, known to this build or not ("Q4_1", "IQ2_XXS", "type 99").
std::string_view ggml_type_name(uint32_t ggml_type);

// The GGUF type of a weight DType, and the DType of a GGUF type (nullopt for a type the kernels do
// not compute with).
QuantType quant_type(DType dtype);
std::optional<DType> dtype_of(QuantType type);

// `n` weights (a multiple of the type's block_elements) from `src` into `dst` as F32.
void dequantize_row(QuantType type, const void* src, int64_t n, float* dst);

}  // namespace moeline::kernels
