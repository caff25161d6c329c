// moeline_index_bench: the approximate-reuse index (reuse::SimilarityIndex, FAISS HNSW over inner
// product) at the sizes a namespace reaches, printed as one JSON object.
//
//   moeline_index_bench [--entries 10000,100000] [--dimension 256] [--queries 2000] [--seed 7]
//                       [--m 32] [--ef-construction 200] [--ef-search 64] [--compare-faiss 1]
//
// Entries are unit vectors drawn around 64 random centres (signatures of one model cluster by
// topic; uniform random vectors would make every neighbour equally far). Queries are entries with
// a small perturbation (a near-duplicate prompt: the case approximate reuse exists for), half of
// them, and fresh vectors from the same clusters, the other half. Per size: build time, search
// latency p50/p99 of one query at a time (the probe searches one prompt at a time), and recall@1
// against exact search (faiss IndexFlatIP over the same vectors), with the misses that are
// near-ties (the index keeps vectors in half precision: within 2^-12 of the best cosine). With
// --compare-faiss 1, the same queries also go, in the same run, to a stock faiss::IndexHNSWFlat
// built with the same parameters (what the index was before it kept half-precision vectors on huge
// pages and searched FAISS's graph itself).
#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "reuse/similarity_index.h"

namespace {

using Clock = std::chrono::steady_clock;

void normalize(float* v, int d) {
  double norm = 0;
  for (int i = 0; i < d; ++i) norm += static_cast<double>(v[i]) * v[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(std::max(norm, 1e-30)));
  for (int i = 0; i < d; ++i) v[i] *= scale;
}

double percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  const size_t at = static_cast<size_t>(p * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(at, values.size() - 1)];
}

nlohmann::json run(int64_t entries, int d, int queries, uint64_t seed,
                   const moeline::reuse::IndexOptions& shape, bool compare_faiss) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int centres = 64;
  std::vector<float> centre(static_cast<size_t>(centres) * d);
  for (float& x : centre) x = normal(rng);
  for (int c = 0; c < centres; ++c) normalize(centre.data() + static_cast<size_t>(c) * d, d);
  auto draw = [&](float* out, float spread) {
    const int c = static_cast<int>(rng() % centres);
    for (int i = 0; i < d; ++i)
      out[i] = centre[static_cast<size_t>(c) * d + i] + spread * normal(rng);
    normalize(out, d);
  };
  std::vector<float> data(static_cast<size_t>(entries) * d);
  for (int64_t i = 0; i < entries; ++i) draw(data.data() + i * d, 0.08f);

  moeline::reuse::IndexOptions options = shape;
  options.dimension = d;
  moeline::reuse::SimilarityIndex index(options);
  const auto build_start = Clock::now();
  for (int64_t i = 0; i < entries; ++i)
    index.add("bench", static_cast<uint64_t>(i), {data.data() + i * d, static_cast<size_t>(d)});
  const double build_s = std::chrono::duration<double>(Clock::now() - build_start).count();

  faiss::IndexFlatIP exact(d);
  exact.add(entries, data.data());
  faiss::IndexHNSWFlat stock(d, options.m, faiss::METRIC_INNER_PRODUCT);
  stock.hnsw.efConstruction = options.ef_construction;
  stock.hnsw.efSearch = options.ef_search;
  double stock_build_s = 0;
  if (compare_faiss) {
    const auto stock_start = Clock::now();
    stock.add(entries, data.data());
    stock_build_s = std::chrono::duration<double>(Clock::now() - stock_start).count();
  }
  std::vector<double> stock_latency_us;
  int stock_found = 0;

  std::vector<float> query(static_cast<size_t>(d));
  std::vector<double> latency_us;
  int found = 0, near_ties = 0;
  for (int q = 0; q < queries; ++q) {
    if (q % 2 == 0) {
      const int64_t base = static_cast<int64_t>(rng() % static_cast<uint64_t>(entries));
      for (int i = 0; i < d; ++i)
        query[i] = data[static_cast<size_t>(base * d + i)] + 0.01f * normal(rng);
      normalize(query.data(), d);
    } else {
      draw(query.data(), 0.08f);
    }
    const auto start = Clock::now();
    const auto hits = index.search("bench", query, 1);
    latency_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    float best = 0;
    faiss::Index::idx_t label = -1;
    exact.search(1, query.data(), 1, &best, &label);
    if (!hits.empty() && static_cast<faiss::Index::idx_t>(hits[0].id) == label) {
      ++found;
    } else if (!hits.empty()) {
      // A miss by less than half precision's rounding of the stored vectors (2^-12 in cosine):
      // a near-tie, not a wrong region of the graph.
      float exact_score = 0;
      const float* got = data.data() + static_cast<size_t>(hits[0].id) * d;
      for (int i = 0; i < d; ++i) exact_score += query[static_cast<size_t>(i)] * got[i];
      if (best - exact_score <= 1.0f / 4096) ++near_ties;
    }
    if (compare_faiss) {
      float stock_best = 0;
      faiss::Index::idx_t stock_label = -1;
      const auto stock_start = Clock::now();
      stock.search(1, query.data(), 1, &stock_best, &stock_label);
      stock_latency_us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - stock_start).count());
      if (stock_label == label) ++stock_found;
    }
  }
  nlohmann::json out = {{"entries", entries},
                        {"dimension", d},
                        {"m", options.m},
                        {"ef_construction", options.ef_construction},
                        {"ef_search", options.ef_search},
                        {"build_s", build_s},
                        {"search_p50_us", percentile(latency_us, 0.5)},
                        {"search_p99_us", percentile(latency_us, 0.99)},
                        {"recall_at_1", static_cast<double>(found) / queries},
                        {"misses_within_rounding", near_ties},
                        {"queries", queries}};
  if (compare_faiss)
    out["stock_faiss"] = {{"build_s", stock_build_s},
                          {"search_p50_us", percentile(stock_latency_us, 0.5)},
                          {"search_p99_us", percentile(stock_latency_us, 0.99)},
                          {"recall_at_1", static_cast<double>(stock_found) / queries}};
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {10000, 100000};
  int d = 256, queries = 2000;
  uint64_t seed = 7;
  bool compare_faiss = false;
  moeline::reuse::IndexOptions shape;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--entries") {
      sizes.clear();
      std::stringstream in(value);
      for (std::string item; std::getline(in, item, ',');) sizes.push_back(std::stoll(item));
    } else if (flag == "--dimension") {
      d = std::stoi(value);
    } else if (flag == "--queries") {
      queries = std::stoi(value);
    } else if (flag == "--seed") {
      seed = std::stoull(value);
    } else if (flag == "--m") {
      shape.m = std::stoi(value);
    } else if (flag == "--ef-construction") {
      shape.ef_construction = std::stoi(value);
    } else if (flag == "--ef-search") {
      shape.ef_search = std::stoi(value);
    } else if (flag == "--compare-faiss") {
      compare_faiss = value == "1";
    } else {
      std::cerr << "usage: moeline_index_bench [--entries N,M] [--dimension D] [--queries Q] [--m "
                   "M] [--ef-construction E] [--ef-search E] [--compare-faiss 1]\n";
      return 2;
    }
  }
  moeline::reuse::SimilarityIndex::search_on_one_thread();  // as the probe runs it
  nlohmann::json out = {{"bench", "approximate-reuse index"}, {"runs", nlohmann::json::array()}};
  for (int64_t n : sizes) out["runs"].push_back(run(n, d, queries, seed, shape, compare_faiss));
  std::cout << out.dump(2) << '\n';
  return 0;
}
