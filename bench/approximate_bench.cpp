// moeline_approximate_bench: the decision rule of approximate reuse on an evaluation set of prompt
// pairs (tests/eval/approximate_pairs.jsonl), against the fixed threshold alone. One JSON object.
//
//   moeline_approximate_bench --model DIR --pairs FILE [--threshold 0.93] [--deltas 0.01,0.1]
//       [--shadow-fraction 0.05] [--shadow-tokens 8] [--layers 1] [--calibration 0.5] [--seed 1]
//       [--passes 1] [--mode response|blend] [--recompute-fraction 0.15] [--blend-max-kl 0.05]
//       [--select-layer 1] [--blend-eligible probe|all]
//
// For each pair (a cached donor a, a new request b) it computes what the stack computes — b's and
// a's activation signatures (the probe's partial forward), the kind of difference, and both
// prompts' greedy answers of --shadow-tokens tokens (what a shadow check compares). A served
// response reuse is *false* when b's own answer differs from a's (what reuse would have returned);
// the set's labels ("match": should / must not be interchangeable) are reported too.
//
// --mode blend judges blended KV reuse instead: b is prefilled from a's KV moved to b's aligned
// positions (reuse::transplant_kv) and blended (Engine::forward_blend at --recompute-fraction), as
// prefill does for a blend plan. A served blend is *false* when its first-token distribution fails
// the gateway's blend shadow check against b's full prefill: top-1 differs, or KL(full || blend) >
// --blend-max-kl. Only the pairs the probe would blend are judged (--blend-eligible probe, the
// default): those whose donor covers at least a KV block of aligned tokens past the exact prefix
// hit. Shorter prompts are never blended in the stack (prefix reuse plus a prefill of the rest is
// cheaper), so counting them would judge blends nobody serves; `all` judges every pair.
//
// The rule learns online, as in the stack: a calibration share of the pairs (shuffled, seeded) is
// seen first — each candidate computed in full and checked, as every unproven candidate is — and
// the rest is the held-out evaluation, where the rule serves, shadows a sample of what it serves,
// and keeps learning from every candidate it does not serve. --passes repeats the calibration share
// (a long-running stack sees many more checks than one pass of this set).
#include <algorithm>
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
#include "model/generator.h"
#include "model/model.h"
#include "offload/resident_provider.h"
#include "reuse/approximate.h"
#include "reuse/blend.h"
#include "reuse/signature.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace moeline;

struct Prompt {
  std::vector<int32_t> tokens;
  std::vector<float> signature;
  std::vector<int32_t> answer;  // (response mode) the greedy answer a shadow check compares
  std::vector<float> logits;    // at the last prompt position
  std::vector<uint8_t> kv;      // (blend mode) the prompt's KV, as the store would hold it
};

struct Pair {
  std::string kind;
  bool match = false;
  const Prompt* a = nullptr;
  const Prompt* b = nullptr;
  float similarity = 0;
  reuse::DifferenceKind difference = reuse::DifferenceKind::kNone;
  bool same_answer = false;  // response: same greedy answer; blend: the blend passes the check
  double blend_kl = 0;
  uint64_t donor = 0;
  double changed = 0;
};

struct Tally {
  int match = 0, match_served = 0, mismatch = 0, mismatch_served = 0;
  int agree = 0, agree_served = 0, served = 0, served_wrong = 0;
  void add(const Pair& p, bool served_it) {
    (p.match ? match : mismatch) += 1;
    if (served_it) (p.match ? match_served : mismatch_served) += 1;
    if (p.same_answer) agree += 1;
    if (p.same_answer && served_it) agree_served += 1;
    if (served_it) {
      served += 1;
      if (!p.same_answer) served_wrong += 1;
    }
  }
  static double rate(int a, int b) { return b == 0 ? 0.0 : static_cast<double>(a) / b; }
  nlohmann::json json() const {
    return {{"hit_rate_label", rate(match_served, match)},
            {"false_reuse_label", rate(mismatch_served, mismatch)},
            {"hit_rate_output", rate(agree_served, agree)},
            {"false_reuse_output", rate(served_wrong, served)},
            {"served", served},
            {"served_wrong", served_wrong},
            {"pairs_match", match},
            {"pairs_must_not", mismatch},
            {"pairs_same_answer", agree}};
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {{"--model", ""},
                                              {"--pairs", ""},
                                              {"--threshold", "0.93"},
                                              {"--deltas", "0.01"},
                                              {"--shadow-fraction", "0.05"},
                                              {"--shadow-tokens", "8"},
                                              {"--layers", "1"},
                                              {"--calibration", "0.5"},
                                              {"--seed", "1"},
                                              {"--passes", "1"},
                                              {"--threads", "2"},
                                              {"--mode", "response"},
                                              {"--recompute-fraction", "0.15"},
                                              {"--blend-max-kl", "0.05"},
                                              {"--select-layer", "1"},
                                              {"--blend-eligible", "probe"}};
  flags = bench::parse_flags(argc, argv, flags);
  const bench::Checkpoint checkpoint = bench::load_checkpoint(flags["--model"]);
  const model::Model& m = *checkpoint.model;
  const model::ModelConfig& cfg = m.config();
  const tokenizer::Tokenizer* tokenizer = &checkpoint.tokenizer;
  kernels::ThreadPool pool(std::stoi(flags["--threads"]));
  offload::ResidentExpertProvider experts(m.experts());
  const std::string mode_name = flags["--mode"];
  if (mode_name != "response" && mode_name != "blend") {
    std::cerr << "--mode: response or blend\n";
    return 2;
  }
  const reuse::ReuseMode mode =
      mode_name == "blend" ? reuse::ReuseMode::kBlend : reuse::ReuseMode::kResponse;
  model::KvCache cache(cfg, 256);
  model::Engine engine(m, experts, pool, cache);
  reuse::SignatureOptions options;
  options.layers = std::stoi(flags["--layers"]);
  reuse::SignatureAccumulator accumulator(model::moe_layer_indices(cfg),
                                          std::max<int64_t>(1, cfg.num_experts), options);
  const int64_t run_layers = model::layers_through_moe(cfg, options.layers);
  model::Generator generator(engine);
  const int shadow_tokens = std::stoi(flags["--shadow-tokens"]);

  std::map<std::string, Prompt> prompts;
  uint64_t next_id = 1;
  auto prompt_of = [&](const std::string& text) -> const Prompt* {
    auto [it, fresh] = prompts.try_emplace(text);
    if (!fresh) return &it->second;
    Prompt& p = it->second;
    auto ids = tokenizer->encode(text);
    if (!ids) throw std::runtime_error(ids.error().message);
    p.tokens = *ids;
    const uint64_t id = next_id++;
    model::Sequence sequence(id, m.model_id(), 0);
    accumulator.watch(id, 0);
    engine.set_router_observer(&accumulator);
    const model::SequenceInput input{&sequence, p.tokens, false};
    if (!engine.forward_layers(std::span(&input, 1), run_layers).ok())
      throw std::runtime_error("forward failed");
    p.signature = accumulator.signature(id);
    accumulator.forget(id);
    sequence.release(cache.pool());
    engine.set_router_observer(nullptr);
    if (mode == reuse::ReuseMode::kBlend) {
      // A blend is judged on the first-token distribution: one prefill gives it and the KV.
      model::Sequence full(next_id++, m.model_id(), 0);
      const model::SequenceInput whole{&full, p.tokens, true};
      if (!engine.forward(std::span(&whole, 1), p.logits).ok())
        throw std::runtime_error("forward failed");
      p.kv = cache.export_blocks(full.block_table());
      full.release(cache.pool());
    } else {
      model::SamplingParams greedy;
      greedy.max_tokens = shadow_tokens;
      auto out = generator.generate({{p.tokens, greedy, ""}});
      if (!out) throw std::runtime_error(out.error().message);
      p.answer = out->front().tokens;
      p.logits = out->front().prompt_logits;
    }
    return &p;
  };
  const reuse::KvGeometry geometry = reuse::KvGeometry::of(cfg);
  const double recompute_fraction = std::stod(flags["--recompute-fraction"]);
  const double blend_max_kl = std::stod(flags["--blend-max-kl"]);
  const int64_t select_layer = std::stoll(flags["--select-layer"]);
  int64_t blend_tokens = 0, blend_recomputed = 0;
  // b prefilled from a's KV, as prefill runs a blend plan; judged as the gateway judges a blend
  // shadow. Returns KL(full || blend), or -1 when the top-1 token differs.
  auto blend_check = [&](const Prompt& donor, const Prompt& request) {
    const std::vector<int32_t> alignment = reuse::align_tokens(request.tokens, donor.tokens);
    const std::vector<uint8_t> kv = reuse::transplant_kv(donor.kv, alignment, geometry);
    std::vector<uint8_t> mask(request.tokens.size());
    for (size_t i = 0; i < mask.size(); ++i) mask[i] = alignment[i] >= 0 ? 1 : 0;
    model::Sequence sequence(next_id++, m.model_id(), 0);
    model::Engine::BlendInput input{&sequence, request.tokens,     kv.data(),
                                    mask,      recompute_fraction, select_layer};
    std::vector<float> logits;
    int64_t recomputed = 0;
    if (!engine.forward_blend(input, logits, recomputed).ok())
      throw std::runtime_error("blend failed");
    sequence.release(cache.pool());
    blend_tokens += static_cast<int64_t>(request.tokens.size());
    blend_recomputed += recomputed;
    const auto top = [](std::span<const float> v) {
      return std::max_element(v.begin(), v.end()) - v.begin();
    };
    const std::span<const float> full(request.logits);
    const std::span<const float> blended(logits.data(), full.size());
    if (top(full) != top(blended)) return -1.0;
    return reuse::softmax_kl(full, blended);
  };
  auto text_of = [&](int32_t t) {
    auto text = tokenizer->decode({t}, tokenizer::DecodeOptions{});
    return text ? *text : std::string();
  };

  std::vector<Pair> pairs;
  std::ifstream in(flags["--pairs"]);
  if (!in) {
    std::cerr << "cannot read " << flags["--pairs"] << '\n';
    return 1;
  }
  if (flags["--blend-eligible"] != "probe" && flags["--blend-eligible"] != "all") {
    std::cerr << "--blend-eligible: probe or all\n";
    return 2;
  }
  const bool probe_eligibility = flags["--blend-eligible"] == "probe";
  // What the probe blends: at least a block of the donor's aligned tokens past the exact prefix
  // hit (whole cached blocks of the common prefix, never the request's last token).
  auto probe_would_blend = [](const Prompt& donor, const Prompt& request) {
    const std::vector<int32_t> alignment = reuse::align_tokens(request.tokens, donor.tokens);
    size_t common = 0;
    while (common < request.tokens.size() && common < donor.tokens.size() &&
           request.tokens[common] == donor.tokens[common])
      ++common;
    const size_t block = model::kBlockTokens;
    const size_t last_block = request.tokens.empty() ? 0 : (request.tokens.size() - 1) / block;
    const size_t from = std::min(common / block, last_block) * block;
    return std::count_if(alignment.begin() + static_cast<std::ptrdiff_t>(from), alignment.end(),
                         [](int32_t a) { return a >= 0; }) >= static_cast<std::ptrdiff_t>(block);
  };
  double kl_same = 0, kl_other = 0;
  int n_same = 0, n_other = 0, not_blended = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json row = nlohmann::json::parse(line);
    Pair p;
    p.kind = row.at("kind");
    p.match = row.at("match");
    p.a = prompt_of(row.at("a"));
    p.b = prompt_of(row.at("b"));
    p.similarity = reuse::cosine(p.a->signature, p.b->signature);
    p.difference = reuse::classify_difference(p.b->tokens, p.a->tokens, text_of);
    p.changed = reuse::changed_fraction(p.b->tokens, p.a->tokens);
    if (mode == reuse::ReuseMode::kBlend && probe_eligibility && !probe_would_blend(*p.a, *p.b)) {
      ++not_blended;
      continue;
    }
    if (mode == reuse::ReuseMode::kBlend) {
      p.blend_kl = blend_check(*p.a, *p.b);
      p.same_answer = p.blend_kl >= 0 && p.blend_kl <= blend_max_kl;
    } else {
      p.same_answer = p.a->answer == p.b->answer;
    }
    p.donor = std::hash<std::string>{}(row.at("a").get<std::string>());
    const double d = reuse::softmax_kl(p.b->logits, p.a->logits);
    (p.same_answer ? kl_same : kl_other) += d;
    (p.same_answer ? n_same : n_other) += 1;
    pairs.push_back(p);
  }
  std::mt19937_64 rng(std::stoull(flags["--seed"]));
  std::shuffle(pairs.begin(), pairs.end(), rng);
  const size_t calibration =
      static_cast<size_t>(std::stod(flags["--calibration"]) * static_cast<double>(pairs.size()));

  const std::vector<double> deltas = bench::parse_list<double>(flags["--deltas"]);
  nlohmann::json out = {{"pairs", pairs.size()},
                        {"mode", mode_name},
                        {"recompute_fraction", recompute_fraction},
                        {"blend_max_kl", blend_max_kl},
                        {"blend_eligible", flags["--blend-eligible"]},
                        {"pairs_not_blended_by_the_probe", not_blended},
                        {"blend_recomputed_share",
                         blend_tokens ? static_cast<double>(blend_recomputed) / blend_tokens : 0.0},
                        {"calibration_pairs", calibration},
                        {"passes", std::stoi(flags["--passes"])},
                        {"threshold", std::stod(flags["--threshold"])},
                        {"shadow_tokens", shadow_tokens},
                        {"signature_layers", options.layers},
                        {"mean_kl_first_token",
                         {{"same_answer", n_same ? kl_same / n_same : 0.0},
                          {"different_answer", n_other ? kl_other / n_other : 0.0}}},
                        {"runs", nlohmann::json::array()}};
  for (double delta : deltas) {
    reuse::DecisionOptions decision;
    decision.threshold = std::stof(flags["--threshold"]);
    decision.max_error = delta;
    decision.shadow_fraction = std::stod(flags["--shadow-fraction"]);
    decision.seed = std::stoull(flags["--seed"]);
    reuse::DecisionRule rule(decision);
    const int passes = std::stoi(flags["--passes"]);
    for (int pass = 0; pass < passes; ++pass)
      for (size_t i = 0; i < calibration; ++i) {
        const Pair& p = pairs[i];
        if (p.similarity < decision.threshold) continue;
        // Calibration: every candidate computed in full and compared. Repeated passes use fresh
        // donor identities (another tenant's copy of the same pair).
        rule.record(rule.cell_of(p.similarity, p.difference, p.changed, mode),
                    p.donor + static_cast<uint64_t>(pass), p.same_answer);
      }
    Tally threshold_only, with_rule;
    std::map<std::string, Tally> threshold_by_kind, rule_by_kind;
    int shadowed = 0;
    for (size_t i = calibration; i < pairs.size(); ++i) {
      const Pair& p = pairs[i];
      const bool candidate = p.similarity >= decision.threshold;
      threshold_only.add(p, candidate);
      threshold_by_kind[p.kind].add(p, candidate);
      bool served = false;
      if (candidate) {
        const reuse::Decision d =
            rule.decide(p.similarity, p.difference, p.changed, p.donor + 1000003, mode);
        served = d.action == reuse::Decision::kServe;
        if (d.action == reuse::Decision::kShadow) {
          ++shadowed;
          rule.record(d.cell, p.donor + 1000003, p.same_answer);
        }
      }
      with_rule.add(p, served);
      rule_by_kind[p.kind].add(p, served);
    }
    nlohmann::json cells = nlohmann::json::object();
    for (const auto& [cell, counts] : rule.cells())
      cells[rule.cell_name(cell)] = {{"checks", counts.checks},
                                     {"failures", counts.failures},
                                     {"error_bound", rule.error_bound(cell)}};
    nlohmann::json by_kind = nlohmann::json::object();
    for (const auto& [kind, tally] : threshold_by_kind)
      by_kind[kind] = {{"threshold", tally.json()}, {"rule", rule_by_kind[kind].json()}};
    out["runs"].push_back({{"delta", delta},
                           {"threshold_only", threshold_only.json()},
                           {"rule", with_rule.json()},
                           {"rule_shadow_checks_in_evaluation", shadowed},
                           {"by_kind", by_kind},
                           {"cells", cells}});
  }
  std::cout << out.dump(2) << '\n';
  return 0;
}
