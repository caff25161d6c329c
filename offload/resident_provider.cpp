#include "offload/resident_provider.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moeline::offload {

ResidentExpertProvider::ResidentExpertProvider(std::vector<std::vector<ExpertWeights>> experts)
    : experts_(std::move(experts)) {
  for (const auto& layer : experts_)
    experts_per_layer_ = std::max(experts_per_layer_, static_cast<int>(layer.size()));
}

ExpertWeights ResidentExpertProvider::acquire(int layer, int expert) {
  if (layer < 0 || layer >= layers() || expert < 0 ||
      expert >= static_cast<int>(experts_[static_cast<size_t>(layer)].size())) {
    throw StatusError("no expert " + std::to_string(expert) + " in layer " + std::to_string(layer),
                      StatusCode::kInternal);
  }
  return experts_[static_cast<size_t>(layer)][static_cast<size_t>(expert)];
}

void ResidentExpertProvider::release(int, int) {}

}  // namespace moeline::offload
