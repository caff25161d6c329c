#pragma once
// Blended reuse's KV transplant: a donor prompt's KV moved to the positions of a new prompt where
// the tokens align (reuse::align_tokens). Values move as they are; keys carry RoPE, a rotation by
// their position, so a key moved from position j to position i is rotated on by i - j (rotations
// of one frequency compose by adding angles). What the transplant cannot fix — each token's K/V
// also depends on the tokens before it — is what forward_blend's selective recomputation is for.

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/rope.h"
#include "model/config.h"

namespace moeline::reuse {

// The KV cache's block layout (model::KvCache): per block, per layer, keys [kv_heads]
// [block_tokens][key_dim] then values [kv_heads][block_tokens][value_dim] (none for MLA), f32; and
// where in each key row the rotated dimensions lie.
struct KvGeometry {
  int64_t layers = 0, kv_heads = 0, key_dim = 0, value_dim = 0, block_tokens = 16;
  kernels::Rope rope;
  int64_t rope_offset = 0;  // MLA: the rope key follows the latent

  static KvGeometry of(const model::ModelConfig& config);
  size_t block_bytes() const {
    return static_cast<size_t>(layers * kv_heads * block_tokens * (key_dim + value_dim)) *
           sizeof(float);
  }
};

// `donor_kv`: the donor's blocks in order (at least ceil(donor tokens / block_tokens) of them).
// `alignment[i]`: the donor position for query position i, or -1. Returns ceil(alignment.size() /
// block_tokens) blocks: the donor's KV at every aligned position, zeros elsewhere.
std::vector<uint8_t> transplant_kv(std::span<const uint8_t> donor_kv,
                                   std::span<const int32_t> alignment, const KvGeometry& geometry);

}  // namespace moeline::reuse
