#include "reuse/similarity_index.h"

#include <faiss/IndexHNSW.h>
#include <omp.h>

#include <algorithm>
#include <stdexcept>

namespace moeline::reuse {

using Label = faiss::Index::idx_t;

struct SimilarityIndex::Partition {
  std::unique_ptr<faiss::IndexHNSWFlat> index;
  std::vector<uint64_t> ids;                 // FAISS label -> id
  std::unordered_map<uint64_t, Label> live;  // id -> FAISS label
  std::unordered_set<Label> dead;            // tombstoned labels
};

SimilarityIndex::SimilarityIndex(IndexOptions options) : options_(options) {
  if (options_.dimension <= 0 || options_.m <= 0)
    throw std::invalid_argument("similarity index: dimension and M must be positive");
}

SimilarityIndex::~SimilarityIndex() = default;

SimilarityIndex::Partition& SimilarityIndex::partition(const std::string& cache_namespace) {
  auto& slot = partitions_[cache_namespace];
  if (!slot) {
    slot = std::make_unique<Partition>();
    slot->index = std::make_unique<faiss::IndexHNSWFlat>(options_.dimension, options_.m,
                                                         faiss::METRIC_INNER_PRODUCT);
    slot->index->hnsw.efConstruction = options_.ef_construction;
    slot->index->hnsw.efSearch = options_.ef_search;
  }
  return *slot;
}

void SimilarityIndex::add(const std::string& cache_namespace, uint64_t id,
                          std::span<const float> vector) {
  if (vector.size() != static_cast<size_t>(options_.dimension))
    throw std::invalid_argument("similarity index: vector of " + std::to_string(vector.size()) +
                                " entries, expected " + std::to_string(options_.dimension));
  Partition& p = partition(cache_namespace);
  if (auto old = p.live.find(id); old != p.live.end()) {
    p.dead.insert(old->second);
    p.live.erase(old);
  }
  const auto label = static_cast<Label>(p.ids.size());
  p.index->add(1, vector.data());
  p.ids.push_back(id);
  p.live[id] = label;
  if (static_cast<double>(p.dead.size()) >
      options_.rebuild_tombstone_fraction * static_cast<double>(p.ids.size()))
    rebuild(p);
}

void SimilarityIndex::remove(const std::string& cache_namespace, uint64_t id) {
  auto it = partitions_.find(cache_namespace);
  if (it == partitions_.end()) return;
  Partition& p = *it->second;
  auto live = p.live.find(id);
  if (live == p.live.end()) return;
  p.dead.insert(live->second);
  p.live.erase(live);
  if (static_cast<double>(p.dead.size()) >
      options_.rebuild_tombstone_fraction * static_cast<double>(p.ids.size()))
    rebuild(p);
}

void SimilarityIndex::clear() {
  partitions_.clear();
}

// A fresh graph over the live vectors (read back from the flat storage), labels renumbered.
void SimilarityIndex::rebuild(Partition& p) {
  auto fresh = std::make_unique<faiss::IndexHNSWFlat>(options_.dimension, options_.m,
                                                      faiss::METRIC_INNER_PRODUCT);
  fresh->hnsw.efConstruction = options_.ef_construction;
  fresh->hnsw.efSearch = options_.ef_search;
  std::vector<uint64_t> ids;
  std::vector<float> vectors;
  std::vector<float> one(static_cast<size_t>(options_.dimension));
  std::unordered_map<uint64_t, Label> live;
  for (Label label = 0; label < static_cast<Label>(p.ids.size()); ++label) {
    if (p.dead.count(label)) continue;
    p.index->reconstruct(label, one.data());
    vectors.insert(vectors.end(), one.begin(), one.end());
    live[p.ids[static_cast<size_t>(label)]] = static_cast<Label>(ids.size());
    ids.push_back(p.ids[static_cast<size_t>(label)]);
  }
  if (!ids.empty()) fresh->add(static_cast<Label>(ids.size()), vectors.data());
  p.index = std::move(fresh);
  p.ids = std::move(ids);
  p.live = std::move(live);
  p.dead.clear();
  ++rebuilds_;
}

std::vector<SimilarityIndex::Hit> SimilarityIndex::search(const std::string& cache_namespace,
                                                          std::span<const float> vector,
                                                          int k) const {
  auto it = partitions_.find(cache_namespace);
  if (it == partitions_.end() || k <= 0 || vector.size() != static_cast<size_t>(options_.dimension))
    return {};
  const Partition& p = *it->second;
  if (p.live.empty()) return {};
  // Ask for enough to survive the tombstones.
  const auto want =
      static_cast<Label>(std::min(p.ids.size(), static_cast<size_t>(k) + p.dead.size()));
  std::vector<float> scores(static_cast<size_t>(want));
  std::vector<Label> labels(static_cast<size_t>(want));
  faiss::SearchParametersHNSW params;
  params.efSearch = std::max<int>(options_.ef_search, static_cast<int>(want));
  p.index->search(1, vector.data(), want, scores.data(), labels.data(), &params);
  std::vector<Hit> hits;
  for (Label i = 0; i < want && static_cast<int>(hits.size()) < k; ++i) {
    const Label label = labels[static_cast<size_t>(i)];
    if (label < 0 || p.dead.count(label)) continue;
    hits.push_back({p.ids[static_cast<size_t>(label)], scores[static_cast<size_t>(i)]});
  }
  return hits;
}

void SimilarityIndex::search_on_one_thread() {
  omp_set_num_threads(1);
}

size_t SimilarityIndex::size(const std::string& cache_namespace) const {
  auto it = partitions_.find(cache_namespace);
  return it == partitions_.end() ? 0 : it->second->live.size();
}

size_t SimilarityIndex::tombstones(const std::string& cache_namespace) const {
  auto it = partitions_.find(cache_namespace);
  return it == partitions_.end() ? 0 : it->second->dead.size();
}

}  // namespace moeline::reuse
