#include "reuse/signature.h"

#include "model/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <tuple>

namespace moeline::reuse {

SignatureAccumulator::SignatureAccumulator(std::vector<int64_t> moe_layers, int64_t experts,
                                           SignatureOptions options)
    : experts_(experts), options_(options) {
  const size_t k = std::min(moe_layers.size(), static_cast<size_t>(std::max(options.layers, 0)));
  for (size_t i = 0; i < k; ++i) slot_of_layer_[moe_layers[i]] = static_cast<int>(i);
}

void RouterSums::add(const RouterSums& other) {
  if (sums.size() != other.sums.size() || tokens.size() != other.tokens.size()) return;
  for (size_t i = 0; i < sums.size(); ++i) sums[i] += other.sums[i];
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] += other.tokens[i];
  for (size_t i = 0; i < chosen.size() && i < other.chosen.size(); ++i)
    chosen[i].insert(other.chosen[i].begin(), other.chosen[i].end());
}

RouterSums SignatureAccumulator::empty_sums() const {
  RouterSums sums;
  sums.sums.assign(slot_of_layer_.size() * static_cast<size_t>(experts_), 0.0);
  sums.tokens.assign(slot_of_layer_.size(), 0);
  sums.chosen.assign(slot_of_layer_.size(), {});
  return sums;
}

void SignatureAccumulator::watch(uint64_t sequence_id, int64_t from_position, bool per_block) {
  Pool pool;
  pool.from_position = from_position;
  pool.per_block = per_block;
  pool.total = empty_sums();
  pools_[sequence_id] = std::move(pool);
}

void SignatureAccumulator::add(uint64_t sequence_id, const RouterSums& sums) {
  auto pool = pools_.find(sequence_id);
  if (pool != pools_.end()) pool->second.total.add(sums);
}

std::map<int64_t, RouterSums> SignatureAccumulator::block_sums(uint64_t sequence_id) const {
  auto pool = pools_.find(sequence_id);
  return pool == pools_.end() ? std::map<int64_t, RouterSums>{} : pool->second.blocks;
}

void SignatureAccumulator::forget(uint64_t sequence_id) {
  pools_.erase(sequence_id);
}

void SignatureAccumulator::on_router(const model::RouterEvent& event) {
  auto slot = slot_of_layer_.find(event.layer);
  if (slot == slot_of_layer_.end() || event.experts != experts_) return;
  const auto layer = static_cast<size_t>(slot->second);
  auto add_token = [&](RouterSums& into, size_t t) {
    double* sums = into.sums.data() + layer * static_cast<size_t>(experts_);
    const float* scores = event.scores + static_cast<int64_t>(t) * experts_;
    for (int64_t e = 0; e < experts_; ++e) sums[e] += scores[e];
    ++into.tokens[layer];
    for (int64_t k = 0; k < event.top_k; ++k)
      into.chosen[layer].insert(event.chosen[static_cast<int64_t>(t) * event.top_k + k]);
  };
  for (size_t t = 0; t < event.tokens.size(); ++t) {
    auto pool = pools_.find(event.tokens[t].sequence_id);
    if (pool == pools_.end() || event.tokens[t].position < pool->second.from_position) continue;
    Pool& p = pool->second;
    add_token(p.total, t);
    if (p.per_block) {
      auto [block, fresh] = p.blocks.try_emplace(event.tokens[t].position / model::kBlockTokens);
      if (fresh) block->second = empty_sums();
      add_token(block->second, t);
    }
  }
}

std::vector<float> SignatureAccumulator::signature(uint64_t sequence_id) const {
  auto pool = pools_.find(sequence_id);
  if (pool == pools_.end()) return {};
  const RouterSums& p = pool->second.total;
  std::vector<float> concatenated(p.sums.size());
  for (size_t layer = 0; layer < p.tokens.size(); ++layer) {
    if (p.tokens[layer] == 0) return {};
    for (int64_t e = 0; e < experts_; ++e) {
      const size_t i = layer * static_cast<size_t>(experts_) + static_cast<size_t>(e);
      concatenated[i] = static_cast<float>(p.sums[i] / static_cast<double>(p.tokens[layer]));
    }
  }
  if (concatenated.empty() || !normalize(concatenated)) return {};
  if (static_cast<int>(concatenated.size()) <= options_.dimension) return concatenated;
  return project(concatenated, options_.dimension, options_.projection_seed);
}

std::vector<std::set<int32_t>> SignatureAccumulator::expert_sets(uint64_t sequence_id) const {
  auto pool = pools_.find(sequence_id);
  return pool == pools_.end() ? std::vector<std::set<int32_t>>{} : pool->second.total.chosen;
}

bool normalize(std::vector<float>& vector) {
  double norm = 0;
  for (float v : vector) norm += static_cast<double>(v) * v;
  if (norm <= 0) return false;
  const double scale = 1.0 / std::sqrt(norm);
  for (float& v : vector) v = static_cast<float>(v * scale);
  return true;
}

namespace {

// The projection matrix for one (input size, dimension, seed): entries -1, 0, +1 (scaled at use),
// generated once per process from one seeded stream, so it is the same in every process.
const std::vector<int8_t>& projection_matrix(size_t inputs, int dimension, uint64_t seed) {
  static std::mutex mutex;
  static std::map<std::tuple<size_t, int, uint64_t>, std::vector<int8_t>> cache;
  std::lock_guard lock(mutex);
  auto [it, inserted] = cache.try_emplace({inputs, dimension, seed});
  if (inserted) {
    std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(inputs) << 32));
    it->second.resize(inputs * static_cast<size_t>(dimension));
    for (int8_t& entry : it->second) {
      const uint64_t draw = rng() % 6;
      entry = draw == 0 ? 1 : draw == 1 ? -1 : 0;
    }
  }
  return it->second;
}

}  // namespace

std::vector<float> project(std::span<const float> vector, int dimension, uint64_t seed) {
  const std::vector<int8_t>& matrix = projection_matrix(vector.size(), dimension, seed);
  std::vector<float> out(static_cast<size_t>(dimension), 0.0f);
  const size_t d = static_cast<size_t>(dimension);
  for (size_t i = 0; i < vector.size(); ++i) {
    const int8_t* row = matrix.data() + i * d;
    for (size_t j = 0; j < d; ++j) out[j] += static_cast<float>(row[j]) * vector[i];
  }
  // The sqrt(3) scale of the classic construction cancels in the normalisation.
  normalize(out);
  return out;
}

float cosine(std::span<const float> a, std::span<const float> b) {
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    dot += static_cast<double>(a[i]) * b[i];
    na += static_cast<double>(a[i]) * a[i];
    nb += static_cast<double>(b[i]) * b[i];
  }
  return na > 0 && nb > 0 ? static_cast<float>(dot / std::sqrt(na * nb)) : 0.0f;
}

float euclidean(std::span<const float> a, std::span<const float> b) {
  double sum = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    sum += d * d;
  }
  return static_cast<float>(std::sqrt(sum));
}

float jaccard(const std::vector<std::set<int32_t>>& a, const std::vector<std::set<int32_t>>& b) {
  const size_t layers = std::min(a.size(), b.size());
  if (layers == 0) return 1.0f;
  double total = 0;
  for (size_t l = 0; l < layers; ++l) {
    std::vector<int32_t> both, either;
    std::set_intersection(a[l].begin(), a[l].end(), b[l].begin(), b[l].end(),
                          std::back_inserter(both));
    std::set_union(a[l].begin(), a[l].end(), b[l].begin(), b[l].end(), std::back_inserter(either));
    total += either.empty() ? 1.0 : static_cast<double>(both.size()) / either.size();
  }
  return static_cast<float>(total / static_cast<double>(layers));
}

}  // namespace moeline::reuse
