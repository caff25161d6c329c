#pragma once
// What the kernel tests share: the instruction-set paths this CPU can run, and seeded Gaussian
// activations.
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_features.h"

namespace moeline::kernels::test {

inline std::vector<Isa> supported_isas() {
  std::vector<Isa> isas = {Isa::kPortable};
  if (best_supported_isa() != Isa::kPortable) isas.push_back(Isa::kAvx2);
  if (best_supported_isa() == Isa::kAvx512) isas.push_back(Isa::kAvx512);
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

}  // namespace moeline::kernels::test
