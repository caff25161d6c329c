// moeline_probe_cost_bench: what a lookup's activation signature costs the probe next to the
// prefill it may save — the probe's partial forward (the first k MoE layers, the last one stopping
// at its router) against a full prefill of the same prompt — printed as one JSON object.
//
//   moeline_probe_cost_bench --model DIR [--tokens 256,1024] [--layers 1,2] [--threads 1]
//                            [--repeat 3]
#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_args.h"
#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/model.h"
#include "offload/resident_provider.h"

namespace {

using namespace moeline;
using Clock = std::chrono::steady_clock;

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {{"--model", ""},
                                              {"--tokens", "256,1024"},
                                              {"--layers", "1,2"},
                                              {"--threads", "1"},
                                              {"--repeat", "3"}};
  flags = bench::parse_flags(argc, argv, flags);
  const std::unique_ptr<model::Model> loaded = bench::load_model(flags["--model"]);
  const model::Model& m = *loaded;
  const model::ModelConfig& cfg = m.config();
  kernels::ThreadPool pool(std::stoi(flags["--threads"]));
  offload::ResidentExpertProvider experts(m.experts());
  const std::vector<int64_t> sizes = bench::parse_list<int64_t>(flags["--tokens"]);
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  model::KvCache cache(cfg, static_cast<int32_t>(longest / model::kBlockTokens + 2));
  model::Engine engine(m, experts, pool, cache);
  const int repeat = std::stoi(flags["--repeat"]);
  std::mt19937 rng(5);
  nlohmann::json out = {{"model_layers", cfg.num_layers},
                        {"threads", std::stoi(flags["--threads"])},
                        {"runs", nlohmann::json::array()}};
  auto best_of = [&](auto&& body) {
    double best = 1e30;
    for (int r = 0; r < repeat; ++r) {
      const auto start = Clock::now();
      body();
      best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    }
    return best;
  };
  for (int64_t n : sizes) {
    if (cfg.max_position_embeddings > 0 && n > cfg.max_position_embeddings) continue;
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % cfg.vocab_size);
    std::vector<float> logits;
    const double prefill = best_of([&] {
      model::Sequence sequence(1, m.model_id(), 0);
      const model::SequenceInput input{&sequence, tokens, true};
      if (!engine.forward(std::span(&input, 1), logits).ok()) std::abort();
      sequence.release(cache.pool());
    });
    for (int64_t k : bench::parse_list<int64_t>(flags["--layers"])) {
      const int64_t run = model::layers_through_moe(cfg, static_cast<int>(k));
      const double probe = best_of([&] {
        model::Sequence sequence(2, m.model_id(), 0);
        const model::SequenceInput input{&sequence, tokens, false};
        if (!engine.forward_layers(std::span(&input, 1), run).ok()) std::abort();
        sequence.release(cache.pool());
      });
      out["runs"].push_back({{"prompt_tokens", n},
                             {"signature_layers", k},
                             {"prefill_ms", prefill * 1e3},
                             {"probe_ms", probe * 1e3},
                             {"probe_fraction", probe / prefill}});
    }
  }
  std::cout << out.dump(2) << '\n';
  return 0;
}
