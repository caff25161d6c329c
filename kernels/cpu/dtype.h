#pragma once
// Element types of weights and the views the kernels read them through. Views never own memory:
// weights stay where the loader mapped them (or where the offload pool put them).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace moeline::kernels {

enum class DType : uint8_t { kF32, kBF16, kF16 };

constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
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

// Widens `count` elements of any DType to F32 (exact).
void widen(const void* src, DType dtype, int64_t count, float* dst);

// A row-major matrix [rows, cols]; for a linear layer's weight this is [out_features, in_features].
struct MatrixView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;

  const std::byte* row(int64_t r) const {
    return static_cast<const std::byte*>(data) + r * cols * static_cast<int64_t>(dtype_size(dtype));
  }
  size_t bytes() const { return static_cast<size_t>(rows * cols) * dtype_size(dtype); }
  // Rows [first, first + count), as a matrix of their own.
  MatrixView row_range(int64_t first, int64_t count) const {
    return MatrixView{row(first), dtype, count, cols};
  }
};

// A vector of weights (norm scales, biases).
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
    }
    return 0.0f;
  }
  explicit operator bool() const { return data != nullptr; }
};

}  // namespace moeline::kernels
