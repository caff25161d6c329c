#pragma once
// Element types of weights and the views the kernels read them through. Views never own memory:
// weights stay where the loader mapped them (or where the offload pool put them).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace moeline::kernels {

// F32, BF16 and F16 hold one weight per element. F8_E4M3 too (one byte: sign, 4 exponent bits
// with bias 7, 3 mantissa bits, no infinities, NaN at S.1111.111), but its matrices carry a
// separate F32 scale per block of rows and columns (MatrixView::block_scales; the layout of
// DeepSeek-V3's and Qwen3's FP8 releases, whose scales are named `weight_scale_inv`). The others
// are GGUF's block-quantized types (kernels/cpu/quant.h defines their layout): a row of n weights
// is n / block elements blocks, each with its own scales, so a quantized matrix is addressed by
// rows, never by element.
enum class DType : uint8_t {
  kF32,
  kBF16,
  kF16,
  kQ8_0,
  kQ4_0,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  kQ4_1,  // the three below: llama.cpp's fallbacks inside K-quant mixes (rows not whole
  kQ5_0,  // super-blocks, e.g. DeepSeek's attn_k_b), read and multiplied, never written
  kQ5_1,
  kF8E4M3,
};

struct DTypeBlock {
  int64_t elements;  // weights per block (1 for the plain types)
  int64_t bytes;     // bytes per block
};

constexpr DTypeBlock dtype_block(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {1, 4};
    case DType::kBF16:
    case DType::kF16:
      return {1, 2};
    case DType::kF8E4M3:
      return {1, 1};
    case DType::kQ8_0:
      return {32, 34};
    case DType::kQ4_0:
      return {32, 18};
    case DType::kQ4_K:
      return {256, 144};
    case DType::kQ5_K:
      return {256, 176};
    case DType::kQ6_K:
      return {256, 210};
    case DType::kQ4_1:
      return {32, 20};
    case DType::kQ5_0:
      return {32, 22};
    case DType::kQ5_1:
      return {32, 24};
  }
  return {1, 0};
}

constexpr bool is_quantized(DType dtype) {
  return dtype_block(dtype).elements > 1;
}

// Types whose matrices need MatrixView::block_scales.
constexpr bool has_block_scales(DType dtype) {
  return dtype == DType::kF8E4M3;
}

// Types a kernel cannot read lane by lane as they are stored: rows are widened to F32 first.
constexpr bool widened_before_use(DType dtype) {
  return is_quantized(dtype) || has_block_scales(dtype);
}

// Every block-quantized type, for loops over them.
constexpr DType kQuantizedTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K,
                                     DType::kQ6_K, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1};

// Bytes of one element of a plain type (0 for a quantized one, which has no element of its own).
constexpr size_t dtype_size(DType dtype) {
  return is_quantized(dtype) ? 0 : static_cast<size_t>(dtype_block(dtype).bytes);
}

// Bytes of `count` weights stored as `dtype`; count is a whole number of blocks.
constexpr size_t stored_bytes(DType dtype, int64_t count) {
  const DTypeBlock block = dtype_block(dtype);
  return static_cast<size_t>(count / block.elements * block.bytes);
}

constexpr std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kQ8_0:
      return "Q8_0";
    case DType::kQ4_0:
      return "Q4_0";
    case DType::kQ4_K:
      return "Q4_K";
    case DType::kQ5_K:
      return "Q5_K";
    case DType::kQ6_K:
      return "Q6_K";
    case DType::kQ4_1:
      return "Q4_1";
    case DType::kQ5_0:
      return "Q5_0";
    case DType::kQ5_1:
      return "Q5_1";
    case DType::kF8E4M3:
      return "F8_E4M3";  // safetensors' name
  }
  return "?";
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

// Round to nearest even, as PyTorch does when it casts float32 to bfloat16.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_float(uint16_t bits);

// An F8_E4M3 byte as F16 bits worth 2^-8 of its value: the exponent field lands in the low four
// bits of F16's five (bias 15 = 7 + 8) and the mantissa on top of F16's, subnormals included, so
// SIMD code widens FP8 with the F16 conversion and folds the 2^8 into the block scale. The NaN
// codes (S.1111.111) are not mapped: callers test for them.
constexpr uint16_t e4m3_as_f16_bits(uint8_t byte) {
  return static_cast<uint16_t>(((byte & 0x80u) << 8) | ((byte & 0x7fu) << 7));
}
constexpr bool e4m3_is_nan(uint8_t byte) {
  return (byte & 0x7fu) == 0x7fu;
}
float e4m3_to_float(uint8_t byte);

// The F16 value stored (unaligned) at `p`: the scales inside quantized blocks.
inline float f16_at(const void* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return f16_to_float(bits);
}

// Widens `count` elements of any DType to F32 (exact; a quantized type is dequantized as GGUF
// defines it, from the start of a block, count a whole number of blocks).
void widen(const void* src, DType dtype, int64_t count, float* dst);

// A row-major matrix [rows, cols]; for a linear layer's weight this is [out_features, in_features].
struct MatrixView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  // Block-scaled types (has_block_scales): weight (r, c) is stored(r, c) times
  // block_scales[(first_row + r) / scale_block_rows][c / scale_block_cols], a row-major
  // [ceil(all rows / block rows), ceil(cols / block cols)] table. first_row is this view's first
  // row in the tensor the table belongs to (row_range moves it), so sub-views share the table.
  const float* block_scales = nullptr;
  int32_t scale_block_rows = 0, scale_block_cols = 0;
  int64_t first_row = 0;

  const std::byte* row(int64_t r) const {
    return static_cast<const std::byte*>(data) + static_cast<size_t>(r) * row_bytes();
  }
  size_t row_bytes() const { return stored_bytes(dtype, cols); }
  size_t bytes() const { return static_cast<size_t>(rows) * row_bytes(); }
  // Rows [first, first + count), as a matrix of their own.
  MatrixView row_range(int64_t first, int64_t count) const {
    MatrixView part = *this;
    part.data = row(first);
    part.rows = count;
    part.first_row = first_row + first;
    return part;
  }
  // The scales of row r's column blocks (block-scaled types only).
  const float* row_scales(int64_t r) const {
    const int64_t column_blocks = (cols + scale_block_cols - 1) / scale_block_cols;
    return block_scales + (first_row + r) / scale_block_rows * column_blocks;
  }
};

// Row r of `w` as F32 (exact: dequantized as its type defines it, block scales applied).
void widen_row(const MatrixView& w, int64_t r, float* dst);

// A vector of weights (norm scales, biases): always a plain type (loaders refuse quantized ones).
struct VectorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t size = 0;

  float operator[](int64_t i) const {
    switch (dtype) {
      case DType::kF32:
        return static_cast<const float*>(data)[i];
      case DType::kBF16:
        return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
      case DType::kF16:
        return f16_to_float(static_cast<const uint16_t*>(data)[i]);
      default:
        return 0.0f;
    }
  }
  explicit operator bool() const { return data != nullptr; }
};

}  // namespace moeline::kernels
