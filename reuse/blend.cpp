#include "reuse/blend.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

#include "model/kv_cache.h"

namespace moeline::reuse {

KvGeometry KvGeometry::of(const model::ModelConfig& config) {
  const model::KvShape shape = model::kv_shape(config);
  return KvGeometry{.layers = config.num_layers,
                    .kv_heads = shape.kv_heads,
                    .key_dim = shape.key_dim,
                    .value_dim = shape.value_dim,
                    .block_tokens = model::kBlockTokens,
                    .rope = model::make_rope(config),
                    .rope_offset = config.mla ? config.kv_lora_rank : 0};
}

std::vector<uint8_t> transplant_kv(std::span<const uint8_t> donor_kv,
                                   std::span<const int32_t> alignment, const KvGeometry& g) {
  const int64_t bt = g.block_tokens;
  const size_t blocks = (alignment.size() + static_cast<size_t>(bt) - 1) / static_cast<size_t>(bt);
  std::vector<uint8_t> out(blocks * g.block_bytes(), 0);
  const int64_t key_floats = g.kv_heads * bt * g.key_dim;  // keys of one layer in one block
  const int64_t value_floats = g.kv_heads * bt * g.value_dim;
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
      it->second.resize(static_cast<size_t>(g.rope.dim()));
      // A pure rotation: the key already carries any attention factor from its first rotation.
      g.rope.angles(delta, it->second.data(), /*unscaled=*/true);
    }
    const int64_t out_block = static_cast<int64_t>(i) / bt, out_slot = static_cast<int64_t>(i) % bt;
    const int64_t in_block = j / bt, in_slot = j % bt;
    const int64_t block_floats = g.layers * (key_floats + value_floats);
    for (int64_t layer = 0; layer < g.layers; ++layer) {
      for (int64_t part = 0; part < 2; ++part) {
        const int64_t width = part == 0 ? g.key_dim : g.value_dim;
        const int64_t base = layer * (key_floats + value_floats) + part * key_floats;
        for (int64_t head = 0; head < g.kv_heads && width > 0; ++head) {
          float* to = dst + out_block * block_floats + base + (head * bt + out_slot) * width;
          const float* from = src + in_block * block_floats + base + (head * bt + in_slot) * width;
          std::memcpy(to, from, static_cast<size_t>(width) * sizeof(float));
          if (part == 0 && delta != 0) g.rope.rotate(to + g.rope_offset, 1, 0, it->second.data());
        }
      }
    }
  }
  return out;
}

}  // namespace moeline::reuse
