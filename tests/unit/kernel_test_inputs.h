#pragma once
// What the kernel tests share: the instruction-set paths this CPU can run, seeded Gaussian
// activations, and random block-quantized weights.
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dtype.h"

namespace moeline::kernels::test {

inline std::vector<Isa> supported_isas() {
  std::vector<Isa> isas = {Isa::kPortable};
  if (best_supported_isa() != Isa::kPortable) isas.push_back(Isa::kAvx2);
  if (best_supported_isa() >= Isa::kAvx512) isas.push_back(Isa::kAvx512);
  if (best_supported_isa() >= Isa::kAvx512Vnni) isas.push_back(Isa::kAvx512Vnni);
  return isas;
}

// n rows of `cols` values from N(0, 1).
inline std::vector<float> gaussian_input(int64_t n, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * cols));
  for (float& value : x) value = normal(rng);
  return x;
}

// fp16 bits of a small positive value in [2^-10, 2^-7): a plausible block scale.
inline uint16_t small_half(std::mt19937& rng) {
  return static_cast<uint16_t>((5u << 10) | (rng() & 0x3ffu)) +
         static_cast<uint16_t>((rng() % 3) << 10);
}

// Random blocks of a quantized type: any bits are valid quants; the fp16 scales are set to
// plausible values.
inline std::vector<uint8_t> random_quantized_rows(DType dtype, int64_t rows, int64_t cols,
                                                  uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(stored_bytes(dtype, rows * cols));
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  const DTypeBlock block = dtype_block(dtype);
  std::vector<int64_t> scale_offsets;
  if (dtype == DType::kQ8_0 || dtype == DType::kQ4_0 || dtype == DType::kQ5_0) scale_offsets = {0};
  if (dtype == DType::kQ4_K || dtype == DType::kQ5_K || dtype == DType::kQ4_1 ||
      dtype == DType::kQ5_1)
    scale_offsets = {0, 2};
  if (dtype == DType::kQ6_K) scale_offsets = {208};
  for (size_t at = 0; at < bytes.size(); at += static_cast<size_t>(block.bytes))
    for (int64_t offset : scale_offsets) {
      const uint16_t half = small_half(rng);
      std::memcpy(&bytes[at + static_cast<size_t>(offset)], &half, 2);
    }
  return bytes;
}

}  // namespace moeline::kernels::test
