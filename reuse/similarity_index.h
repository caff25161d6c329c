#pragma once
// The approximate-reuse index: FAISS HNSW over inner product (signatures are unit vectors, so inner
// product is cosine), one partition per cache namespace so that a tenant's lookups never see
// another tenant's entries. HNSW cannot delete: removed entries become tombstones, filtered out at
// search time, and a partition is rebuilt from its live vectors once tombstones pass a fraction of
// it. Entries carry the caller's 64-bit id (the snapshot's prompt key).
//
// Not thread-safe: the probe's loop owns it.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace faiss {
struct IndexHNSW;
}

namespace moeline::reuse {

struct IndexOptions {
  int dimension = 256;
  int m = 32;
  int ef_construction = 200;
  int ef_search = 64;
  double rebuild_tombstone_fraction = 0.25;
};

// The score the index gives `query` against a stored vector: their inner product, with the stored
// vector rounded to half precision as the index keeps it (exposed for its test).
float stored_inner_product(std::span<const float> query, std::span<const float> stored);

class SimilarityIndex {
 public:
  explicit SimilarityIndex(IndexOptions options);
  ~SimilarityIndex();
  SimilarityIndex(const SimilarityIndex&) = delete;
  SimilarityIndex& operator=(const SimilarityIndex&) = delete;

  // Adds (or replaces) the entry `id` of the namespace; `vector` has `dimension` entries.
  void add(const std::string& cache_namespace, uint64_t id, std::span<const float> vector);
  void remove(const std::string& cache_namespace, uint64_t id);
  // Drops every partition (the caller re-adds what is still live).
  void clear();

  struct Hit {
    uint64_t id;
    float score;  // inner product (cosine for unit vectors)
  };
  // The k best live entries, best first.
  std::vector<Hit> search(const std::string& cache_namespace, std::span<const float> vector,
                          int k) const;

  // FAISS runs on OpenMP, process-wide. A probe searches one prompt at a time, where a thread
  // team only adds wake-up latency: it calls this once (it has no other OpenMP work).
  static void search_on_one_thread();

  size_t size(const std::string& cache_namespace) const;
  size_t tombstones(const std::string& cache_namespace) const;
  uint64_t rebuilds() const { return rebuilds_; }
  const IndexOptions& options() const { return options_; }

 private:
  struct Partition;
  Partition& partition(const std::string& cache_namespace);
  void rebuild(Partition& partition);

  IndexOptions options_;
  std::map<std::string, std::unique_ptr<Partition>> partitions_;
  uint64_t rebuilds_ = 0;
};

}  // namespace moeline::reuse
