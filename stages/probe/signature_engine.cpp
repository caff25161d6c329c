#include "stages/probe/signature_engine.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "model/model_text.h"
#include "stages/common/common.h"

namespace moeline::stages {
namespace {

using Clock = std::chrono::steady_clock;
// Memory for the router sums of full blocks the probe remembers (the prefix-import shortcut).
constexpr size_t kRememberedBytes = size_t{32} << 20;

}  // namespace

SignatureEngine::SignatureEngine(const runtime::Config& config, const model::Model& model,
                                 ProbeMetrics& metrics)
    : model_(model), metrics_(metrics) {
  const model::ModelConfig& cfg = model_.config();
  signature_options_ = signature_options(config);
  signature_layers_ = model::layers_through_moe(cfg, signature_options_.layers);
  const std::vector<int64_t> moe = model::moe_layer_indices(cfg);
  const int64_t experts = std::max<int64_t>(1, cfg.num_experts);
  const int64_t concatenated =
      static_cast<int64_t>(std::min(moe.size(), static_cast<size_t>(signature_options_.layers))) *
      experts;
  signature_dimension_ =
      static_cast<int>(std::min<int64_t>(concatenated, signature_options_.dimension));
  block_sums_width_ = static_cast<size_t>(std::max<int64_t>(1, concatenated));
  max_signature_tokens_ = config.integer("signature-max-tokens");
  if (cfg.max_position_embeddings > 0)
    max_signature_tokens_ = std::min(max_signature_tokens_, cfg.max_position_embeddings);
  int threads = static_cast<int>(config.integer("threads"));
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  pool_ = std::make_unique<kernels::ThreadPool>(threads);
  experts_ = std::make_unique<offload::ResidentExpertProvider>(model_.experts());
  // KV only for the layers a signature runs (a partial forward never reads past them).
  model::ModelConfig signature_config = cfg;
  signature_config.num_layers = std::max<int64_t>(1, signature_layers_);
  cache_ = std::make_unique<model::KvCache>(
      signature_config, static_cast<int32_t>((max_signature_tokens_ + model::kBlockTokens - 1) /
                                             model::kBlockTokens));
  engine_ = std::make_unique<model::Engine>(model_, *experts_, *pool_, *cache_);
  accumulator_ = std::make_unique<reuse::SignatureAccumulator>(moe, experts, signature_options_);
  whole_accumulator_ =
      std::make_unique<reuse::SignatureAccumulator>(moe, experts, signature_options_);
  observers_.add(accumulator_.get());
  observers_.add(whole_accumulator_.get());
  engine_->set_router_observer(&observers_);
}

// A lookup's signatures. When the exact prefix's blocks are at hand (`prefix_blocks`, the prefix
// plan's) and an earlier lookup left their router sums, the prefix is not recomputed: its blocks'
// KV is imported (the signature layers of each record) and their sums added to the whole-prompt
// pool; only the rest of the prompt runs. Either way the full blocks computed here leave their sums
// for later.
LookupSignatures SignatureEngine::compute(const std::vector<int32_t>& tokens, int64_t from,
                                          const std::vector<uint64_t>& chain,
                                          const std::vector<reuse::Value>& prefix_blocks) {
  LookupSignatures out;
  if (static_cast<int64_t>(tokens.size()) > max_signature_tokens_ || signature_layers_ == 0)
    return out;
  const auto start = Clock::now();
  const auto covered = static_cast<size_t>(from / model::kBlockTokens);
  std::vector<const reuse::RouterSums*> cached_sums;
  bool import = from > 0 && prefix_blocks.size() >= covered;
  for (size_t b = 0; import && b < covered; ++b) {
    auto it = block_sums_.find(chain[b]);
    if (it == block_sums_.end())
      import = false;
    else
      cached_sums.push_back(&it->second);
  }
  const uint64_t id = next_sequence_id_++;
  model::Sequence sequence(id, model_.model_id(), 0);
  model::BlockPool& pool = cache_->pool();
  if (import) {
    // The cache serves one lookup at a time and holds the longest prompt: there is room.
    for (size_t b = 0; b < covered; ++b) {
      const int32_t block = *pool.allocate();
      cache_->import_block(block, prefix_blocks[b]->data());
      sequence.share_block(pool, block);
      pool.release(block);
    }
    sequence.commit(std::span(tokens.data(), static_cast<size_t>(from)));
    metrics_.prefix_imports->inc();
  }
  accumulator_->watch(id, from);
  whole_accumulator_->watch(id, import ? from : 0, /*per_block=*/true);
  for (const reuse::RouterSums* sums : cached_sums) whole_accumulator_->add(id, *sums);
  const std::span<const int32_t> run =
      import ? std::span(tokens).subspan(static_cast<size_t>(from)) : std::span(tokens);
  const model::SequenceInput input{&sequence, run, false};
  moeline::Status status = engine_->forward_layers(std::span(&input, 1), signature_layers_);
  if (status.ok()) {
    out.past_prefix = accumulator_->signature(id);
    out.past_prefix_sets = accumulator_->expert_sets(id);
    if (from > 0) {
      out.whole = whole_accumulator_->signature(id);
      out.whole_sets = whole_accumulator_->expert_sets(id);
    }
    for (const auto& [block, sums] : whole_accumulator_->block_sums(id))
      if (static_cast<size_t>(block) < chain.size() &&
          std::all_of(sums.tokens.begin(), sums.tokens.end(),
                      [](int64_t n) { return n == model::kBlockTokens; }))
        remember_block_sums(chain[static_cast<size_t>(block)], sums);
  }
  accumulator_->forget(id);
  whole_accumulator_->forget(id);
  sequence.release(pool);
  metrics_.signature_seconds->observe(std::chrono::duration<double>(Clock::now() - start).count());
  return out;
}

// Router sums of full blocks by block key (bounded, oldest first out: a lost entry only means
// recomputing that prefix once more).
void SignatureEngine::remember_block_sums(uint64_t block_key, const reuse::RouterSums& sums) {
  if (!block_sums_.emplace(block_key, sums).second) return;
  block_sums_order_.push_back(block_key);
  // A byte budget: each entry holds a sum per expert of each signature layer.
  const size_t limit =
      std::max<size_t>(1024, kRememberedBytes / (block_sums_width_ * sizeof(double) + 128));
  while (block_sums_order_.size() > limit) {
    block_sums_.erase(block_sums_order_.front());
    block_sums_order_.pop_front();
  }
}

}  // namespace moeline::stages
