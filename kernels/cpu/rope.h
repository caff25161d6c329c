#pragma once
// Rotary position embedding over `dim` dimensions of a vector, with per-pair frequencies fixed at
// construction: the plain θ^(-2i/d) table, or any other (YaRN's blend of interpolated and original
// frequencies is computed by the model, which owns its config). Two layouts of the pairs:
// rotate-half (dimension i with i + d/2, Llama-style Hugging Face checkpoints) and interleaved
// (2i with 2i + 1, DeepSeek's checkpoints). `attention_factor` scales cos and sin (YaRN's mscale).

#include <cstdint>
#include <vector>

namespace moeline::kernels {

class Rope {
 public:
  Rope() = default;
  // The plain table: inv_freq[i] = theta^(-2i / dim).
  Rope(int64_t dim, double theta);
  Rope(std::vector<double> inv_freq, double attention_factor, bool interleaved);

  int64_t dim() const { return static_cast<int64_t>(inv_freq_.size()) * 2; }
  bool interleaved() const { return interleaved_; }
  // dim/2 cosines then dim/2 sines of position * inv_freq, times attention_factor unless
  // `unscaled` (a pure rotation: what moving an already rotated key to another position needs).
  void angles(int64_t position, float* cos_sin, bool unscaled = false) const;
  // Rotates `count` vectors spaced `stride` floats apart, each at its first dim() floats.
  void rotate(float* vectors, int64_t count, int64_t stride, const float* cos_sin) const;

 private:
  std::vector<double> inv_freq_;
  double attention_factor_ = 1.0;
  bool interleaved_ = false;
};

}  // namespace moeline::kernels
