#pragma once
// Blended reuse's KV transplant: a donor prompt's KV moved to the positions of a new prompt where
// the tokens align (reuse::align_tokens). Values move as they are; keys carry RoPE, a rotation by
// their position, so a key moved from position j to position i is rotated on by i - j (rotations
// of one frequency compose by adding angles). What the transplant cannot fix — each token's K/V
// also depends on the tokens before it — is what forward_blend's selective recomputation is for.

#include <cstdint>
#include <span>
#include <vector>

namespace moeline::reuse {

// The KV cache's block layout (model::KvCache): per block, per layer, keys then values, each
// [kv_heads][block_tokens][head_dim] of f32.
struct KvGeometry {
  int64_t layers = 0, kv_heads = 0, head_dim = 0, block_tokens = 16;
  double rope_theta = 10000.0;
  size_t block_bytes() const {
    return static_cast<size_t>(layers * 2 * kv_heads * block_tokens * head_dim) * sizeof(float);
  }
};

// `donor_kv`: the donor's blocks in order (at least ceil(donor tokens / block_tokens) of them).
// `alignment[i]`: the donor position for query position i, or -1. Returns ceil(alignment.size() /
// block_tokens) blocks: the donor's KV at every aligned position, zeros elsewhere.
std::vector<uint8_t> transplant_kv(std::span<const uint8_t> donor_kv,
                                   std::span<const int32_t> alignment, const KvGeometry& geometry);

}  // namespace moeline::reuse
