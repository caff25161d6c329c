#include "cli/signature_command.h"

#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/model_text.h"
#include "offload/resident_provider.h"
#include "reuse/signature.h"
#include "stages/common/common.h"
#include "tokenizer/tokenizer.h"

namespace moeline::cli {
namespace {

std::vector<runtime::ConfigKey> command_keys() {
  std::vector<runtime::ConfigKey> keys = {
      {"model", stages::default_model_dir(), "checkpoint folder"},
      {"threads", "0", "compute threads (0: all cores)"},
  };
  for (const runtime::ConfigKey& key : stages::signature_keys()) keys.push_back(key);
  return keys;
}

// Reads JSON lines {"prompt": TEXT} (or {"tokens": [...]}) on stdin; prints each with its
// signature and its top-k expert sets as JSON lines.
int signature_body(const runtime::Config& config) {
  const std::string dir = config.text("model");
  auto loaded = model::Model::load(dir);
  if (!loaded) throw std::runtime_error(loaded.error().message);
  const model::Model& m = **loaded;
  auto tokenizer = model::load_model_tokenizer(dir);
  if (!tokenizer) throw std::runtime_error(tokenizer.error().message);
  const model::ModelConfig& cfg = m.config();
  const std::vector<int64_t> moe_layers = model::moe_layer_indices(cfg);
  const reuse::SignatureOptions options = stages::signature_options(config);
  // Run the layers up to the k-th MoE layer, no further.
  const int64_t run = model::layers_through_moe(cfg, options.layers);

  int threads = static_cast<int>(config.integer("threads"));
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  kernels::ThreadPool pool(threads);
  offload::ResidentExpertProvider experts(m.experts());
  const int64_t context = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
  model::KvCache cache(
      cfg, static_cast<int32_t>((context + model::kBlockTokens - 1) / model::kBlockTokens));
  model::Engine engine(m, experts, pool, cache);
  reuse::SignatureAccumulator accumulator(moe_layers, std::max<int64_t>(1, cfg.num_experts),
                                          options);
  engine.set_router_observer(&accumulator);

  std::string line;
  uint64_t id = 1;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    nlohmann::json in = nlohmann::json::parse(line, nullptr, false);
    if (!in.is_object()) throw std::runtime_error("stdin: each line must be a JSON object");
    std::vector<int32_t> tokens;
    if (in.contains("tokens")) {
      tokens = in["tokens"].get<std::vector<int32_t>>();
    } else {
      auto ids = tokenizer->encode(in.value("prompt", ""));
      if (!ids) throw std::runtime_error(ids.error().message);
      tokens = std::move(*ids);
    }
    if (tokens.empty()) throw std::runtime_error("stdin: a prompt without tokens");
    model::Sequence sequence(id, m.model_id(), 0);
    accumulator.watch(id, 0);
    model::SequenceInput input{&sequence, tokens, false};
    if (moeline::Status status = engine.forward_layers(std::span(&input, 1), run); !status.ok())
      throw std::runtime_error(status.error().message);
    sequence.release(cache.pool());
    nlohmann::json out = in;
    out["tokens"] = tokens;
    out["signature"] = accumulator.signature(id);
    nlohmann::json sets = nlohmann::json::array();
    for (const auto& set : accumulator.expert_sets(id)) sets.push_back(set);
    out["experts"] = sets;
    accumulator.forget(id);
    std::cout << out.dump() << '\n';
    ++id;
  }
  return 0;
}

}  // namespace

int signature_command(int argc, char** argv) {
  return stages::run_stage("signature", command_keys(), argc, argv, signature_body);
}

}  // namespace moeline::cli
