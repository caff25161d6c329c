#pragma once
// The batched forward pass. One call runs the new tokens of several sequences — a long prompt
// chunk for one, a single decode token for another — through every layer together: projections
// and experts are batched across sequences, attention reads each sequence's own paged KV. The
// result of a sequence does not depend on what else is in the batch.
//
// Expert weights come only from the ExpertProvider, acquired per layer and released before the
// next. Buffers grow to the largest batch seen and are reused; steady-state calls allocate nothing.
// Not thread-safe: one Engine per scheduler thread (it uses the thread pool internally).

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/thread_pool.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/router_observer.h"
#include "offload/expert_provider.h"

namespace moeline::model {

struct SequenceInput {
  Sequence* sequence = nullptr;
  std::span<const int32_t> tokens;  // appended at positions sequence->length() onwards
  bool want_logits = true;          // logits of the last of these tokens
  bool every_logit = false;         // logits of every one of these tokens, in order (perplexity)
};

// What the generator drives: a forward pass over a paged KV cache whose blocks come from
// `blocks()` — the CPU Engine below, or the CUDA engine (model/cuda_engine.h).
class ForwardPass {
 public:
  virtual ~ForwardPass() = default;
  virtual Status forward(std::span<const SequenceInput> batch, std::vector<float>& logits) = 0;
  virtual BlockPool& blocks() = 0;
  virtual const Model& model() const = 0;
  // Called on every MoE layer's routing decision of every forward (null: none).
  virtual void set_router_observer(RouterObserver* observer) = 0;

  // KV leaves and enters the cache in KvCache's block format (model/kv_cache.h), the unit it
  // moves in between processes: kv_block_bytes() per block, blocks one after another. An error
  // (a device's) leaves the blocks undefined: the caller fails what needed them.
  virtual size_t kv_block_bytes() const = 0;
  virtual Status export_kv(std::span<const int32_t> blocks, uint8_t* out) = 0;
  virtual Status import_kv(std::span<const int32_t> blocks, const uint8_t* in) = 0;
};

// The checks every forward pass makes before touching anything: no sequence twice, token ids in
// the vocabulary, the model's context, and room for the batch's new blocks.
Status validate_batch(const ModelConfig& config, std::span<const SequenceInput> batch,
                      int64_t free_blocks);

class Engine : public ForwardPass {
 public:
  Engine(const Model& model, offload::ExpertProvider& experts, kernels::ThreadPool& pool,
         KvCache& cache);

  void set_router_observer(RouterObserver* observer) override { observer_ = observer; }
  const Model& model() const override { return model_; }
  KvCache& cache() { return cache_; }
  BlockPool& blocks() override { return cache_.pool(); }
  size_t kv_block_bytes() const override { return cache_.block_bytes(); }
  Status export_kv(std::span<const int32_t> blocks, uint8_t* out) override {
    cache_.export_blocks(blocks, out);
    return Status::ok_status();
  }
  Status import_kv(std::span<const int32_t> blocks, const uint8_t* in) override {
    cache_.import_blocks(blocks, in);
    return Status::ok_status();
  }

  // On success `logits` holds [sequences wanting logits, vocab] in batch order and each sequence
  // has grown by its tokens. On error (bad token id, context or KV pool exhausted) nothing changed.
  Status forward(std::span<const SequenceInput> batch, std::vector<float>& logits) override;
  // Runs only the first `layers` layers (no final norm, no logits): what a router observer needs
  // from them — the probe's activation signatures — at a fraction of a prefill. The last layer
  // stops at its router (its experts feed nothing the observer sees). The sequences hold KV for
  // those layers only; release them afterwards, never decode from them.
  Status forward_layers(std::span<const SequenceInput> batch, int64_t layers);

  // Blended reuse (after CacheBlend): `sequence` is empty or holds an exact prefix of whole blocks
  // (never recomputed); `donor_kv` holds one KV block per block of `tokens` (KvCache block
  // layout) with a donor's KV, already re-positioned, wherever donor_mask is 1. Layers
  // 0..select_layer run every token; at select_layer each donor token's fresh K/V is compared with
  // the donor's (how much its changed context moved it). Past it only the tokens without donor KV,
  // the most deviating `recompute_fraction` of the others, and the last token run; the rest keep
  // the donor's KV. `logits` gets the last token's logits; `recomputed` the number of tokens that
  // ran every layer.
  struct BlendInput {
    Sequence* sequence = nullptr;
    std::span<const int32_t> tokens;
    const uint8_t* donor_kv = nullptr;
    std::span<const uint8_t> donor_mask;
    double recompute_fraction = 0.15;
    int64_t select_layer = 1;
  };
  Status forward_blend(const BlendInput& input, std::vector<float>& logits, int64_t& recomputed);

 private:
  Status validate(std::span<const SequenceInput> batch);
  // The shared body: embeds, runs `layers` layers; returns the number of new tokens.
  int64_t run_layers(std::span<const SequenceInput> batch, int64_t layers);
  // Reserves the batch's blocks and embeds its tokens; returns the number of new tokens.
  int64_t embed(std::span<const SequenceInput> batch);
  void run_layer(int64_t layer, int64_t tokens);
  // Final norm and LM head for `rows` (row indices of hidden_), into logits.
  void lm_head(std::span<const int64_t> rows, std::vector<float>& logits);
  void attention_block(int64_t layer, int64_t tokens);
  // Multi-head latent attention over the compressed cache, with both up-projections absorbed:
  // each head's query is mapped into the latent space (kv_b_key_t), attends over the cached
  // [latent | rope key] rows, and its attended latent is mapped out by the head's value rows.
  void latent_attention_block(int64_t layer, int64_t tokens);
  // Adds the squared distance between each row's fresh K/V and what the cache held (blended
  // reuse's deviation), when kv_deviation_ is set.
  void record_kv_deviation(const kernels::PagedKvLayer& kv, int64_t t, int32_t block, int64_t slot,
                           const float* new_k, const float* new_v);
  // The router's choice for each of `tokens` rows of logits: scores in place (softmax or sigmoid),
  // `chosen` the top-k experts (within the kept groups, on the biased scores where configured)
  // and `weights` their weights.
  void route(const LayerWeights& w, float* scores, int64_t tokens, int32_t* chosen, float* weights);
  // y = down(silu(gate(x)) * up(x)) for `tokens` rows: dense MLP layers and shared experts.
  void swiglu(const float* x, int64_t tokens, const kernels::MatrixView& gate,
              const kernels::MatrixView& up, const kernels::MatrixView& down, float* y);
  // y += sigmoid(x · gate) * rows, per token: Qwen2-MoE's gated shared expert.
  void add_gated_rows(const float* x, const float* rows, int64_t tokens,
                      const kernels::MatrixView& gate, float* y);
  void moe_block(int64_t layer, int64_t tokens);
  // Tells the expert provider which experts the next MoE layers' routers would pick for the
  // current residual stream (as many layers as the provider's prefetch depth; none for depth 0).
  // Called mid-layer (once the layer's first experts are pinned: lead time) and again when the
  // layer is done (its output is closer to the next layer's input: accuracy).
  void prefetch_next_layers(int64_t layer, int64_t tokens);
  void dense_mlp_block(int64_t layer, int64_t tokens);

  const Model& model_;
  offload::ExpertProvider& experts_;
  kernels::ThreadPool& pool_;
  KvCache& cache_;
  RouterObserver* observer_ = nullptr;
  // While set, attention_block adds each row's squared distance between its fresh K/V and what the
  // cache held before (blended reuse's deviation).
  float* kv_deviation_ = nullptr;
  // forward_layers: this layer's MoE block stops after its router (-1: none).
  int64_t routers_only_layer_ = -1;

  // Per-token bookkeeping for the current batch.
  std::vector<RoutedToken> token_refs_;
  std::vector<kernels::AttentionQuery> queries_;
  std::vector<const int32_t*> token_block_tables_;
  kernels::Rope rope_table_;
  float softmax_scale_;
  // Activations, [tokens, width] row-major; rope_ holds each token's cos/sin.
  std::vector<float> hidden_, normed_, q_, k_, v_, attended_, projected_, rope_;
  std::vector<float> q_latent_, out_latent_;  // MLA: [tokens, heads, latent (+ rope) width]
  std::vector<float> route_choice_, group_scores_;
  std::vector<int32_t> group_order_;
  // MoE scratch.
  std::vector<float> router_scores_, chosen_weights_, expert_in_, expert_gate_, expert_up_,
      expert_out_, moe_out_, shared_gate_;
  std::vector<float> expert_row_weights_;
  std::vector<int64_t> logit_rows_;
  std::vector<int32_t> chosen_experts_, expert_offsets_, expert_rows_, expert_cursor_;
  std::vector<kernels::MatmulTask> expert_tasks_;
  std::vector<offload::ExpertWeights> acquired_experts_;
  std::vector<int32_t> expert_group_, expert_group_prefetch_;
  std::vector<float> predict_in_, predict_scores_, predict_weights_;
  std::vector<int32_t> predict_chosen_;
  std::vector<uint8_t> predict_wanted_;
};

}  // namespace moeline::model
