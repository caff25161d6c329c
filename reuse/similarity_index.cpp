#include "reuse/similarity_index.h"

#include <faiss/IndexFlatCodes.h>
#include <faiss/IndexHNSW.h>
#include <faiss/impl/DistanceComputer.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <queue>
#include <stdexcept>
#include <type_traits>

namespace moeline::reuse {

using Label = faiss::Index::idx_t;

namespace {

// Debian's FAISS (1.7.3) is built for the x86-64 baseline: its inner product runs 4 floats at a
// time, and its graph search reads one neighbour's vector after another, so a search at 100k
// entries spends its time waiting on memory (~100 ns per distance whatever the dimension). FAISS
// builds and owns the HNSW graph; the vectors' storage, the distance and the search for one query
// are ours: the search walks FAISS's graph the same way (greedy through the upper levels, then a
// best-first search with efSearch candidates at level 0) but asks for a node's unvisited
// neighbours' vectors all at once before scoring them, and the inner product uses the widest vector
// unit the CPU has (picked once at start).
//
// Stored vectors are half precision: half the memory read per distance. A signature's entries are
// in [-1, 1], where rounding to half precision moves a cosine by at most 2^-12 (the decision rule
// bins similarity by 0.01).
using Element = _Float16;

template <typename X>
using DotFunction = float (*)(const X*, const Element*, size_t);

template <typename X>
float dot_baseline(const X* x, const Element* y, size_t d) {
  float sum = 0;
  for (size_t i = 0; i < d; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(y[i]);
  return sum;
}

// GCC 12's own intrinsic headers trip -Wuninitialized (their _mm*_undefined_* helpers).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define MOELINE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MOELINE_AVX512 __attribute__((target("avx512f,f16c")))

template <typename T>
MOELINE_AVX2 inline __m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, float>)
    return _mm256_loadu_ps(x);
  else
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

template <typename T>
MOELINE_AVX512 inline __m512 load16(const T* x) {
  if constexpr (std::is_same_v<T, float>)
    return _mm512_loadu_ps(x);
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

template <typename X>
MOELINE_AVX2 float dot_avx2(const X* x, const Element* y, size_t d) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a = _mm256_fmadd_ps(load8(x + i), load8(y + i), a);
    b = _mm256_fmadd_ps(load8(x + i + 8), load8(y + i + 8), b);
  }
  for (; i + 8 <= d; i += 8) a = _mm256_fmadd_ps(load8(x + i), load8(y + i), a);
  a = _mm256_add_ps(a, b);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_shuffle_ps(half, half, 1));
  float sum = _mm_cvtss_f32(half);
  for (; i < d; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(y[i]);
  return sum;
}

template <typename X>
MOELINE_AVX512 float dot_avx512(const X* x, const Element* y, size_t d) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  size_t i = 0;
  for (; i + 32 <= d; i += 32) {
    a = _mm512_fmadd_ps(load16(x + i), load16(y + i), a);
    b = _mm512_fmadd_ps(load16(x + i + 16), load16(y + i + 16), b);
  }
  for (; i + 16 <= d; i += 16) a = _mm512_fmadd_ps(load16(x + i), load16(y + i), a);
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  for (; i < d; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(y[i]);
  return sum;
}

#pragma GCC diagnostic pop

template <typename X>
DotFunction<X> pick_dot() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return dot_avx512<X>;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return dot_avx2<X>;
  return dot_baseline<X>;
}

const DotFunction<float> dot = pick_dot<float>();             // query . stored
const DotFunction<Element> stored_dot = pick_dot<Element>();  // stored . stored

struct InnerProductDistance final : faiss::FlatCodesDistanceComputer {
  InnerProductDistance(const uint8_t* stored, size_t dimension)
      : faiss::FlatCodesDistanceComputer(stored, dimension * sizeof(Element)),
        vectors(reinterpret_cast<const Element*>(stored)),
        d(dimension) {}
  void set_query(const float* x) override { query = x; }
  float distance_to_code(const uint8_t* code) override {
    return dot(query, reinterpret_cast<const Element*>(code), d);
  }
  float symmetric_dis(idx_t i, idx_t j) override {
    return stored_dot(vectors + static_cast<size_t>(i) * d, vectors + static_cast<size_t>(j) * d,
                      d);
  }
  const Element* vectors;
  size_t d;
  const float* query = nullptr;
};

// Flat storage of the vectors under inner product: what FAISS's graph is built over.
struct InnerProductStorage final : faiss::IndexFlatCodes {
  explicit InnerProductStorage(int dimension)
      : faiss::IndexFlatCodes(static_cast<size_t>(dimension) * sizeof(Element), dimension,
                              faiss::METRIC_INNER_PRODUCT) {}

  const Element* vector(faiss::Index::idx_t i) const {
    return reinterpret_cast<const Element*>(codes.data()) + static_cast<size_t>(i) * d;
  }
  void sa_encode(idx_t n, const float* x, uint8_t* bytes) const override {
    auto* out = reinterpret_cast<Element*>(bytes);
    for (size_t i = 0; i < static_cast<size_t>(n) * static_cast<size_t>(d); ++i)
      out[i] = static_cast<Element>(x[i]);
  }
  void sa_decode(idx_t n, const uint8_t* bytes, float* x) const override {
    const auto* in = reinterpret_cast<const Element*>(bytes);
    for (size_t i = 0; i < static_cast<size_t>(n) * static_cast<size_t>(d); ++i)
      x[i] = static_cast<float>(in[i]);
  }
  faiss::FlatCodesDistanceComputer* get_FlatCodesDistanceComputer() const override {
    return new InnerProductDistance(codes.data(), static_cast<size_t>(d));
  }
  // Exhaustive search (FAISS requires one of every index; the graph search below is what serves).
  void search(idx_t n, const float* x, idx_t k, float* distances, idx_t* labels,
              const faiss::SearchParameters* = nullptr) const override {
    std::vector<std::pair<float, idx_t>> scored(static_cast<size_t>(ntotal));
    for (idx_t q = 0; q < n; ++q) {
      for (idx_t i = 0; i < ntotal; ++i)
        scored[static_cast<size_t>(i)] = {dot(x + q * d, vector(i), static_cast<size_t>(d)), i};
      const idx_t keep = std::min(k, ntotal);
      std::partial_sort(scored.begin(), scored.begin() + keep, scored.end(),
                        [](const auto& a, const auto& b) { return a.first > b.first; });
      for (idx_t j = 0; j < k; ++j) {
        distances[q * k + j] = j < keep ? scored[static_cast<size_t>(j)].first : -1e30f;
        labels[q * k + j] = j < keep ? scored[static_cast<size_t>(j)].second : -1;
      }
    }
  }
};

std::unique_ptr<faiss::IndexHNSW> make_graph(const IndexOptions& options) {
  auto graph =
      std::make_unique<faiss::IndexHNSW>(new InnerProductStorage(options.dimension), options.m);
  graph->own_fields = true;
  graph->is_trained = true;
  graph->hnsw.efConstruction = options.ef_construction;
  graph->hnsw.efSearch = options.ef_search;
  return graph;
}

// A search at 100k entries touches a few thousand vectors and neighbour lists spread over tens of
// megabytes: with 4 KiB pages nearly every one is a TLB miss as well as a cache miss (measured: p50
// 0.78 ms with 4 KiB pages, 0.31 ms with 2 MiB pages, 256 dimensions). Debian enables transparent
// huge pages only where madvise asks, so the graph's two big arrays are grown here, ahead of FAISS,
// into fresh memory advised for huge pages before anything is written to it.
template <typename T>
void reserve_on_huge_pages(std::vector<T>& v, size_t needed) {
  if (v.capacity() >= needed) return;
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t capacity = std::max({needed, v.capacity() * 2, kHugePage / sizeof(T)});
  std::vector<T> fresh;
  fresh.reserve(capacity);
  const auto start = reinterpret_cast<uintptr_t>(fresh.data());
  const uintptr_t first = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (start + capacity * sizeof(T)) & ~(kHugePage - 1);
  if (last > first)  // advice only: without it the index is slower, not wrong
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  fresh.insert(fresh.end(), v.begin(), v.end());
  v.swap(fresh);
}

// Room for `entries` more vectors in the graph's storage and neighbour lists.
void make_room(faiss::IndexHNSW& index, size_t entries) {
  auto& storage = static_cast<InnerProductStorage&>(*index.storage);
  reserve_on_huge_pages(storage.codes, storage.codes.size() + entries * storage.code_size);
  // Level 0 holds 2M neighbours and each level above M; one node in M reaches level 1.
  const auto m = static_cast<size_t>(index.hnsw.nb_neighbors(1));
  reserve_on_huge_pages(index.hnsw.neighbors,
                        index.hnsw.neighbors.size() + entries * 3 * m + 64 * m);
}

// Marks visited nodes by search number, so a search does not clear a table the size of the index.
struct VisitedMarks {
  std::vector<uint32_t> marks;
  uint32_t search = 0;
  void next_search(size_t entries) {
    if (marks.size() < entries) marks.resize(entries, 0);
    if (++search == 0) {  // wrapped: clear once every 4 billion searches
      std::fill(marks.begin(), marks.end(), 0);
      search = 1;
    }
  }
  // True the first time `node` is seen in this search.
  bool visit(faiss::HNSW::storage_idx_t node) {
    uint32_t& mark = marks[static_cast<size_t>(node)];
    if (mark == search) return false;
    mark = search;
    return true;
  }
};

using Scored = std::pair<float, Label>;  // (inner product, label)

std::vector<Scored> graph_search(const faiss::IndexHNSW& index, const float* query, size_t k,
                                 size_t ef, VisitedMarks& visited) {
  const faiss::HNSW& hnsw = index.hnsw;
  const auto& storage = static_cast<const InnerProductStorage&>(*index.storage);
  const auto d = static_cast<size_t>(storage.d);
  if (storage.ntotal == 0 || hnsw.entry_point < 0) return {};
  auto score = [&](faiss::HNSW::storage_idx_t node) { return dot(query, storage.vector(node), d); };
  auto fetch_ahead = [&](faiss::HNSW::storage_idx_t node) {
    const auto* bytes = reinterpret_cast<const char*>(storage.vector(node));
    for (size_t at = 0; at < d * sizeof(Element); at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
  };
  std::vector<faiss::HNSW::storage_idx_t> unvisited;
  auto neighbours = [&](faiss::HNSW::storage_idx_t node, int level, bool only_unvisited) {
    size_t begin = 0, end = 0;
    hnsw.neighbor_range(node, level, &begin, &end);
    unvisited.clear();
    for (size_t j = begin; j < end; ++j) {
      const auto next = hnsw.neighbors[j];
      if (next < 0) break;
      if (only_unvisited && !visited.visit(next)) continue;
      unvisited.push_back(next);
      fetch_ahead(next);
    }
  };

  // Upper levels: greedy, to the level-0 entry.
  auto current = hnsw.entry_point;
  float best = score(current);
  for (int level = hnsw.max_level; level > 0; --level) {
    for (bool moved = true; moved;) {
      moved = false;
      neighbours(current, level, false);
      for (const auto next : unvisited) {
        const float s = score(next);
        if (s > best) best = s, current = next, moved = true;
      }
    }
  }

  // Level 0: best-first, keeping the ef best seen.
  visited.next_search(static_cast<size_t>(storage.ntotal));
  std::priority_queue<Scored> candidates;                                 // best on top
  std::priority_queue<Scored, std::vector<Scored>, std::greater<>> kept;  // worst on top
  visited.visit(current);
  candidates.push({best, current});
  kept.push({best, current});
  while (!candidates.empty()) {
    const auto [similarity, node] = candidates.top();
    if (kept.size() >= ef && similarity < kept.top().first) break;
    candidates.pop();
    neighbours(static_cast<faiss::HNSW::storage_idx_t>(node), 0, true);
    for (const auto next : unvisited) {
      const float s = score(next);
      if (kept.size() < ef || s > kept.top().first) {
        candidates.push({s, next});
        kept.push({s, next});
        if (kept.size() > ef) kept.pop();
      }
    }
  }
  std::vector<Scored> best_first;
  while (!kept.empty()) {
    best_first.push_back(kept.top());
    kept.pop();
  }
  std::reverse(best_first.begin(), best_first.end());
  if (best_first.size() > k) best_first.resize(k);
  return best_first;
}

}  // namespace

float stored_inner_product(std::span<const float> query, std::span<const float> stored) {
  if (query.size() != stored.size()) throw std::invalid_argument("inner_product: sizes differ");
  const std::vector<Element> rounded(stored.begin(), stored.end());
  return dot(query.data(), rounded.data(), query.size());
}

struct SimilarityIndex::Partition {
  std::unique_ptr<faiss::IndexHNSW> index;
  std::vector<uint64_t> ids;                 // FAISS label -> id
  std::unordered_map<uint64_t, Label> live;  // id -> FAISS label
  std::unordered_set<Label> dead;            // tombstoned labels
  mutable VisitedMarks visited;              // the searches' scratch
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
    slot->index = make_graph(options_);
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
  make_room(*p.index, 1);
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
  auto fresh = make_graph(options_);
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
  make_room(*fresh, ids.size());
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
  const size_t want = std::min(p.ids.size(), static_cast<size_t>(k) + p.dead.size());
  const auto found =
      graph_search(*p.index, vector.data(), want,
                   std::max(static_cast<size_t>(options_.ef_search), want), p.visited);
  std::vector<Hit> hits;
  for (const auto& [score, label] : found) {
    if (static_cast<int>(hits.size()) >= k) break;
    if (p.dead.count(label)) continue;
    hits.push_back({p.ids[static_cast<size_t>(label)], score});
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
