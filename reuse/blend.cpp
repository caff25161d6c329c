#include "reuse/blend.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

#include "kernels/cpu/ops.h"

namespace moeline::reuse {

std::vector<uint8_t> transplant_kv(std::span<const uint8_t> donor_kv,
                                   std::span<const int32_t> alignment, const KvGeometry& g) {
  const int64_t bt = g.block_tokens;
  const size_t blocks = (alignment.size() + static_cast<size_t>(bt) - 1) / static_cast<size_t>(bt);
  std::vector<uint8_t> out(blocks * g.block_bytes(), 0);
  const int64_t part_floats = g.kv_heads * bt * g.head_dim;  // keys (or values) of one layer
  auto* dst = reinterpret_cast<float*>(out.data());
  const auto* src = reinterpret_cast<const float*>(donor_kv.data());
  const size_t donor_blocks = donor_kv.size() / g.block_bytes();
  // One angle table per distinct position change.
  std::unordered_map<int64_t, std::vector<float>> angles;
  for (size_t i = 0; i < alignment.size(); ++i) {
    const int64_t j = alignment[i];
    if (j < 0) continue;
    if (static_cast<size_t>(j / bt) >= donor_blocks)
      throw std::invalid_argument("alignment points past the donor's KV");
    const int64_t delta = static_cast<int64_t>(i) - j;
    auto [it, fresh] = angles.try_emplace(delta);
    if (fresh) {
      it->second.resize(static_cast<size_t>(g.head_dim));
      kernels::rope_angles(delta, g.head_dim, g.rope_theta, it->second.data());
    }
    const int64_t out_block = static_cast<int64_t>(i) / bt, out_slot = static_cast<int64_t>(i) % bt;
    const int64_t in_block = j / bt, in_slot = j % bt;
    const int64_t block_floats = 2 * g.layers * part_floats;
    for (int64_t layer = 0; layer < g.layers; ++layer) {
      for (int64_t part = 0; part < 2; ++part) {
        const int64_t base = (layer * 2 + part) * part_floats;
        for (int64_t head = 0; head < g.kv_heads; ++head) {
          float* to = dst + out_block * block_floats + base + (head * bt + out_slot) * g.head_dim;
          const float* from =
              src + in_block * block_floats + base + (head * bt + in_slot) * g.head_dim;
          std::memcpy(to, from, static_cast<size_t>(g.head_dim) * sizeof(float));
          if (part == 0 && delta != 0)
            kernels::rope_rotate_half(to, 1, g.head_dim, it->second.data());
        }
      }
    }
  }
  return out;
}

}  // namespace moeline::reuse
