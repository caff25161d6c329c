// moeline_blend_bench: blended KV reuse against a full prefill — quality (perplexity of held-out
// continuations) and speed (time to the first token) — printed as one JSON object.
//
//   moeline_blend_bench --model DIR --text FILE [--context 96] [--continuation 32] [--stride 48]
//                       [--fractions 0,0.15,0.3,1] [--select-layer 1] [--threads 1] [--repeat 3]
//
// The text is cut into windows of context + continuation tokens. For each window the donor is a
// near-duplicate of the context, in two ways: "edit" (about 1 token in 16 replaced by another,
// spread through the context) and "swap" (a span of 16 tokens in the middle replaced by 16 other
// tokens of the text: a retrieved chunk swapped). The context's KV is built three ways: a full
// prefill; the donor's KV transplanted to the aligned positions (reuse::align_tokens +
// reuse::transplant_kv, as the probe does) and blended with Engine::forward_blend at each
// recompute fraction. Then the continuation is scored token by token on top of each (teacher
// forcing): perplexity ratio = exp(mean NLL blended) / exp(mean NLL full). Time to the first
// token: the forward (and for a blend, the transplant) of the context, best of --repeat.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
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
#include "reuse/approximate.h"
#include "reuse/blend.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace moeline;
using Clock = std::chrono::steady_clock;

double log_prob(const float* logits, int64_t vocab, int32_t token) {
  const float top = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - top));
  return logits[token] - top - std::log(sum);
}

struct Setup {
  const model::Model& m;
  model::KvCache& cache;
  model::Engine& engine;
};

// Mean NLL of `continuation` after a sequence that holds the context (its last logits given).
double score(Setup& s, model::Sequence& sequence, std::vector<float> logits,
             const std::vector<int32_t>& continuation) {
  const int64_t vocab = s.m.config().vocab_size;
  double nll = 0;
  for (size_t i = 0; i < continuation.size(); ++i) {
    nll -= log_prob(logits.data(), vocab, continuation[i]);
    if (i + 1 == continuation.size()) break;
    const model::SequenceInput input{&sequence, std::span(&continuation[i], 1), true};
    if (!s.engine.forward(std::span(&input, 1), logits).ok()) throw std::runtime_error("forward");
  }
  return nll / static_cast<double>(continuation.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {
      {"--model", ""},          {"--text", ""},     {"--context", "96"},
      {"--continuation", "32"}, {"--stride", "48"}, {"--fractions", "0,0.15,0.3,1"},
      {"--select-layer", "1"},  {"--threads", "1"}, {"--repeat", "3"},
      {"--seed", "1"}};
  flags = bench::parse_flags(argc, argv, flags);
  const bench::Checkpoint checkpoint = bench::load_checkpoint(flags["--model"]);
  const model::Model& m = *checkpoint.model;
  const model::ModelConfig& cfg = m.config();
  const tokenizer::Tokenizer* tokenizer = &checkpoint.tokenizer;
  std::ifstream in(flags["--text"]);
  std::stringstream text;
  text << in.rdbuf();
  auto ids = tokenizer->encode(text.str(), {.add_special_tokens = false});
  if (!ids) {
    std::cerr << ids.error().message << '\n';
    return 1;
  }
  const std::vector<int32_t>& all = *ids;
  const int64_t context = std::stoll(flags["--context"]);
  const int64_t continuation = std::stoll(flags["--continuation"]);
  const int64_t stride = std::stoll(flags["--stride"]);
  const int repeat = std::stoi(flags["--repeat"]);
  const std::vector<double> fractions = bench::parse_list<double>(flags["--fractions"]);
  kernels::ThreadPool pool(std::stoi(flags["--threads"]));
  offload::ResidentExpertProvider experts(m.experts());
  model::KvCache cache(cfg, static_cast<int32_t>(4 * (context + continuation) / 16 + 8));
  model::Engine engine(m, experts, pool, cache);
  Setup s{m, cache, engine};
  const reuse::KvGeometry geometry = reuse::KvGeometry::of(cfg);
  std::mt19937_64 rng(std::stoull(flags["--seed"]));
  const int64_t select = std::stoll(flags["--select-layer"]);

  struct Totals {
    double nll = 0, seconds = 0;
    int64_t recomputed = 0, tokens = 0;
    int windows = 0;
  };
  std::map<std::string, Totals> full_by_kind;
  std::map<std::string, std::map<double, Totals>> blend_by_kind;
  uint64_t next_id = 1;
  for (int64_t start = 0; start + context + continuation <= static_cast<int64_t>(all.size());
       start += stride) {
    const std::vector<int32_t> ctx(all.begin() + start, all.begin() + start + context);
    const std::vector<int32_t> cont(all.begin() + start + context,
                                    all.begin() + start + context + continuation);
    for (const std::string kind : {"edit", "swap"}) {
      std::vector<int32_t> donor = ctx;
      if (kind == "edit") {
        for (int64_t i = 8; i < context - 1; i += 16)
          donor[static_cast<size_t>(i)] = all[rng() % all.size()];
      } else {
        const int64_t from = static_cast<int64_t>(rng() % (all.size() - 16));
        std::copy_n(all.begin() + from, 16, donor.begin() + context / 2 - 8);
      }
      // The donor's KV, as the store would hold it.
      model::Sequence donor_sequence(next_id++, m.model_id(), 0);
      std::vector<float> logits;
      model::SequenceInput donor_input{&donor_sequence, donor, true};
      if (!engine.forward(std::span(&donor_input, 1), logits).ok()) return 1;
      const std::vector<uint8_t> donor_kv = cache.export_blocks(donor_sequence.block_table());
      donor_sequence.release(cache.pool());

      // Full prefill of the context: the reference.
      double best = 1e9;
      double full_nll = 0;
      for (int r = 0; r < repeat; ++r) {
        model::Sequence sequence(next_id++, m.model_id(), 0);
        const model::SequenceInput input{&sequence, ctx, true};
        const auto t0 = Clock::now();
        if (!engine.forward(std::span(&input, 1), logits).ok()) return 1;
        best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
        if (r == 0) full_nll = score(s, sequence, logits, cont);
        sequence.release(cache.pool());
      }
      Totals& full = full_by_kind[kind];
      full.nll += full_nll;
      full.seconds += best;
      full.windows += 1;

      for (double fraction : fractions) {
        double blend_best = 1e9, blend_nll = 0;
        int64_t recomputed = 0;
        for (int r = 0; r < repeat; ++r) {
          model::Sequence sequence(next_id++, m.model_id(), 0);
          const auto t0 = Clock::now();
          const std::vector<int32_t> alignment = reuse::align_tokens(ctx, donor);
          const std::vector<uint8_t> kv = reuse::transplant_kv(donor_kv, alignment, geometry);
          std::vector<uint8_t> mask(ctx.size());
          for (size_t i = 0; i < ctx.size(); ++i) mask[i] = alignment[i] >= 0 ? 1 : 0;
          model::Engine::BlendInput input{&sequence, ctx, kv.data(), mask, fraction, select};
          if (!engine.forward_blend(input, logits, recomputed).ok()) return 1;
          blend_best =
              std::min(blend_best, std::chrono::duration<double>(Clock::now() - t0).count());
          if (r == 0) blend_nll = score(s, sequence, logits, cont);
          sequence.release(cache.pool());
        }
        Totals& t = blend_by_kind[kind][fraction];
        t.nll += blend_nll;
        t.seconds += blend_best;
        t.recomputed += recomputed;
        t.tokens += context;
        t.windows += 1;
      }
    }
  }
  nlohmann::json out = {{"context_tokens", context},
                        {"continuation_tokens", continuation},
                        {"select_layer", select},
                        {"layers", cfg.num_layers},
                        {"threads", std::stoi(flags["--threads"])},
                        {"results", nlohmann::json::array()}};
  for (const auto& [kind, full] : full_by_kind) {
    const double full_ppl = std::exp(full.nll / full.windows);
    for (const auto& [fraction, t] : blend_by_kind[kind]) {
      const double ppl = std::exp(t.nll / t.windows);
      out["results"].push_back({{"donor", kind},
                                {"windows", t.windows},
                                {"recompute_fraction", fraction},
                                {"recomputed_share", static_cast<double>(t.recomputed) / t.tokens},
                                {"perplexity_full", full_ppl},
                                {"perplexity_blend", ppl},
                                {"perplexity_ratio", ppl / full_ppl},
                                {"ttft_full_ms", 1e3 * full.seconds / full.windows},
                                {"ttft_blend_ms", 1e3 * t.seconds / t.windows},
                                {"ttft_speedup", full.seconds / t.seconds}});
    }
  }
  std::cout << out.dump(2) << '\n';
  return 0;
}
