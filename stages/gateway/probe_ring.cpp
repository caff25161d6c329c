#include "stages/gateway/probe_ring.h"

#include <xxhash.h>

#include <algorithm>

namespace moeline::stages {
namespace {

uint64_t hash(const std::string& text, uint64_t seed) {
  return XXH3_64bits_withSeed(text.data(), text.size(), seed);
}

}  // namespace

void ProbeRing::update(std::vector<std::string> replicas) {
  std::sort(replicas.begin(), replicas.end());
  replicas.erase(std::unique(replicas.begin(), replicas.end()), replicas.end());
  if (replicas == replicas_) return;
  replicas_ = std::move(replicas);
  points_.clear();
  points_.reserve(replicas_.size() * kPoints);
  for (uint32_t r = 0; r < replicas_.size(); ++r)
    for (int point = 0; point < kPoints; ++point)
      points_.emplace_back(hash(replicas_[r], static_cast<uint64_t>(point)), r);
  std::sort(points_.begin(), points_.end());
}

const std::string& ProbeRing::owner(const std::string& cache_namespace) const {
  static const std::string none;
  if (points_.empty()) return none;
  const uint64_t at = hash(cache_namespace, 0x6d6f656c696e65ULL);  // "moeline"
  auto it = std::lower_bound(points_.begin(), points_.end(), std::make_pair(at, uint32_t{0}));
  if (it == points_.end()) it = points_.begin();  // the ring wraps
  return replicas_[it->second];
}

}  // namespace moeline::stages
