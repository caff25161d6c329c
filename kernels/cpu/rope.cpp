#include "kernels/cpu/rope.h"

#include <cmath>
#include <utility>

namespace moeline::kernels {

Rope::Rope(int64_t dim, double theta) {
  inv_freq_.resize(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i)
    inv_freq_[static_cast<size_t>(i)] = std::pow(theta, -2.0 * static_cast<double>(i) / dim);
}

Rope::Rope(std::vector<double> inv_freq, double attention_factor, bool interleaved)
    : inv_freq_(std::move(inv_freq)),
      attention_factor_(attention_factor),
      interleaved_(interleaved) {}

void Rope::angles(int64_t position, float* cos_sin, bool unscaled) const {
  const auto half = static_cast<int64_t>(inv_freq_.size());
  const double factor = unscaled ? 1.0 : attention_factor_;
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(position) * inv_freq_[static_cast<size_t>(i)];
    cos_sin[i] = static_cast<float>(std::cos(angle) * factor);
    cos_sin[half + i] = static_cast<float>(std::sin(angle) * factor);
  }
}

void Rope::rotate(float* vectors, int64_t count, int64_t stride, const float* cos_sin) const {
  const auto half = static_cast<int64_t>(inv_freq_.size());
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  // Pair i is (i, i + half) or (2i, 2i + 1).
  const int64_t second_offset = interleaved_ ? 1 : half;
  const int64_t pair_step = interleaved_ ? 2 : 1;
  for (int64_t h = 0; h < count; ++h) {
    float* v = vectors + h * stride;
    for (int64_t i = 0; i < half; ++i) {
      float& first = v[i * pair_step];
      float& second = v[i * pair_step + second_offset];
      const float a = first, b = second;
      first = a * cos[i] - b * sin[i];
      second = b * cos[i] + a * sin[i];
    }
  }
}

}  // namespace moeline::kernels
