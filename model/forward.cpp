#include "model/forward.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <string>

#include "kernels/check.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"

namespace moeline::model {
namespace {

using kernels::MatmulTask;

void add_bias(float* rows, int64_t n, const kernels::VectorView& bias) {
  if (!bias) return;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < bias.size; ++i) rows[t * bias.size + i] += bias[i];
}

void clamp(float* values, int64_t count, float limit) {
  for (int64_t i = 0; i < count; ++i) values[i] = std::clamp(values[i], -limit, limit);
}

void add_rows(float* dst, const float* src, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] += src[i];
}

// silu(gate) * up over many rows, spread over the pool: exp() over every expert activation of a
// long prompt is worth parallelising.
void silu_mul_parallel(kernels::ThreadPool& pool, float* gate, const float* up, int64_t count) {
  if (count < (int64_t{1} << 16)) {  // a decode step's worth: cheaper than waking the pool
    kernels::silu_mul(gate, up, count);
    return;
  }
  pool.run([&](int thread, int threads) {
    auto [begin, end] = kernels::ThreadPool::split(count, thread, threads, 64);
    if (begin < end) kernels::silu_mul(gate + begin, up + begin, end - begin);
  });
}

// Indices of the k largest scores, highest first; ties go to the lower expert id.
void top_k(const float* scores, int64_t experts, int64_t k, int32_t* chosen) {
  for (int64_t j = 0; j < k; ++j) {
    int32_t best = -1;
    for (int32_t e = 0; e < experts; ++e) {
      if (std::find(chosen, chosen + j, e) != chosen + j) continue;
      if (best < 0 || scores[e] > scores[best]) best = e;
    }
    chosen[j] = best;
  }
}

template <class T>
T* grow(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(static_cast<size_t>(size));
  return buffer.data();
}

}  // namespace

Engine::Engine(const Model& model, offload::ExpertProvider& experts, kernels::ThreadPool& pool,
               KvCache& cache)
    : model_(model),
      experts_(experts),
      pool_(pool),
      cache_(cache),
      rope_table_(make_rope(model.config())),
      softmax_scale_(static_cast<float>(model.config().softmax_scale)) {}

Status validate_batch(const ModelConfig& c, std::span<const SequenceInput> batch,
                      int64_t free_blocks) {
  int64_t blocks_needed = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceInput& input = batch[i];
    for (size_t j = 0; j < i; ++j)
      if (batch[j].sequence == input.sequence)
        return Error{"a sequence appears twice in one forward batch", StatusCode::kInternal};
    for (int32_t token : input.tokens)
      if (token < 0 || token >= c.vocab_size)
        return Error{"token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                     std::to_string(c.vocab_size) + ")"};
    const int64_t end = input.sequence->length() + static_cast<int64_t>(input.tokens.size());
    if (c.max_position_embeddings > 0 && end > c.max_position_embeddings)
      return Error{"sequence of " + std::to_string(end) +
                   " tokens exceeds the model's context of " +
                   std::to_string(c.max_position_embeddings) + " (max_position_embeddings)"};
    const int64_t blocks = (end + kBlockTokens - 1) / kBlockTokens -
                           static_cast<int64_t>(input.sequence->block_table().size());
    blocks_needed += std::max<int64_t>(0, blocks);
  }
  if (blocks_needed > free_blocks)
    return Error{"KV cache full: the batch needs " + std::to_string(blocks_needed) +
                     " more blocks, " + std::to_string(free_blocks) + " are free",
                 StatusCode::kResourceExhausted};
  return Status::ok_status();
}

Status Engine::validate(std::span<const SequenceInput> batch) {
  return validate_batch(model_.config(), batch, cache_.pool().free_blocks());
}

int64_t Engine::embed(std::span<const SequenceInput> batch) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size;
  const int64_t rope_dim = rope_table_.dim();

  int64_t n = 0;
  bool prompt = false;
  for (const SequenceInput& input : batch) {
    n += static_cast<int64_t>(input.tokens.size());
    prompt = prompt || input.tokens.size() > 1;
  }
  // A batch holding a prompt chunk sweeps the experts of every layer once (ExpertProvider).
  experts_.set_streaming(prompt);
  token_refs_.clear();
  token_block_tables_.clear();
  float* hidden = grow(hidden_, n * H);
  float* rope = grow(rope_, n * rope_dim);
  for (const SequenceInput& input : batch) {
    const bool reserved =
        input.sequence->reserve(cache_.pool(), static_cast<int64_t>(input.tokens.size()));
    MOELINE_CHECK(reserved, "validate() found room for the whole batch");
    for (size_t i = 0; i < input.tokens.size(); ++i) {
      const int64_t t = static_cast<int64_t>(token_refs_.size());
      const int64_t position = input.sequence->length() + static_cast<int64_t>(i);
      token_refs_.push_back({input.sequence->id(), position});
      token_block_tables_.push_back(input.sequence->block_table().data());
      kernels::widen_row(model_.embed_tokens(), input.tokens[i], hidden + t * H);
      rope_table_.angles(position, rope + t * rope_dim);
    }
  }
  return n;
}

void Engine::run_layer(int64_t layer, int64_t n) {
  if (model_.config().mla) {
    latent_attention_block(layer, n);
  } else {
    attention_block(layer, n);
  }
  if (model_.layer(layer).is_moe) {
    moe_block(layer, n);
  } else {
    dense_mlp_block(layer, n);
  }
  // The layer's output is the next layer's input but for its attention: a second, closer guess
  // at its experts (the first, issued mid-layer, buys lead time). Queued experts are not asked
  // for twice. On the demo model: recall 61% -> 72% at the same 1.3x over-fetch.
  prefetch_next_layers(layer, n);
}

int64_t Engine::run_layers(std::span<const SequenceInput> batch, int64_t layers) {
  const int64_t n = embed(batch);
  for (int64_t layer = 0; layer < layers; ++layer) run_layer(layer, n);
  return n;
}

void Engine::lm_head(std::span<const int64_t> rows, std::vector<float>& logits) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size;
  const auto wanted = static_cast<int64_t>(rows.size());
  float* normed = grow(normed_, std::max<int64_t>(wanted, 1) * H);
  for (int64_t i = 0; i < wanted; ++i)
    kernels::rms_norm(hidden_.data() + rows[static_cast<size_t>(i)] * H, 1, H, H,
                      model_.final_norm(), c.rms_norm_eps, normed + i * H, H);
  logits.resize(static_cast<size_t>(wanted * c.vocab_size));
  if (wanted > 0) {
    kernels::matmul(
        pool_, MatmulTask{.x = normed, .n = wanted, .w = model_.lm_head(), .y = logits.data()});
  }
}

Status Engine::forward_blend(const BlendInput& input, std::vector<float>& logits,
                             int64_t& recomputed) {
  const ModelConfig& c = model_.config();
  const auto n = static_cast<int64_t>(input.tokens.size());
  if (input.sequence == nullptr || input.sequence->length() % kBlockTokens != 0)
    return Error{"a blended prefill continues a sequence of whole blocks (an exact prefix)"};
  if (n == 0 || input.donor_mask.size() != input.tokens.size() || input.donor_kv == nullptr)
    return Error{"a blended prefill needs one donor-mask entry per token and the donor's KV"};
  if (!(input.recompute_fraction >= 0 && input.recompute_fraction <= 1))
    return Error{"recompute fraction must be in [0, 1]"};
  const SequenceInput batch[] = {{input.sequence, input.tokens, true}};
  if (Status status = validate(batch); !status.ok()) return status;
  try {
    const auto first_new_block = static_cast<size_t>(input.sequence->length() / kBlockTokens);
    embed(batch);
    const std::vector<int32_t>& table = input.sequence->block_table();
    for (size_t b = first_new_block; b < table.size(); ++b)
      cache_.import_block(table[b], input.donor_kv + (b - first_new_block) * cache_.block_bytes());

    const int64_t select = std::clamp<int64_t>(input.select_layer, 0, c.num_layers - 1);
    std::vector<float> deviation(static_cast<size_t>(n), 0.0f);
    for (int64_t layer = 0; layer <= select; ++layer) {
      if (layer == select) kv_deviation_ = deviation.data();
      run_layer(layer, n);
      kv_deviation_ = nullptr;
    }

    // Which rows run the remaining layers: every row without donor KV, the last row, and the most
    // deviating recompute_fraction of the donor's rows.
    std::vector<uint8_t> keep(static_cast<size_t>(n), 0);
    std::vector<int64_t> donor_rows;
    for (int64_t t = 0; t < n; ++t) {
      if (!input.donor_mask[static_cast<size_t>(t)] || t == n - 1) {
        keep[static_cast<size_t>(t)] = 1;
      } else {
        donor_rows.push_back(t);
      }
    }
    const auto extra = static_cast<size_t>(
        std::ceil(input.recompute_fraction * static_cast<double>(donor_rows.size())));
    std::partial_sort(
        donor_rows.begin(),
        donor_rows.begin() + static_cast<std::ptrdiff_t>(std::min(extra, donor_rows.size())),
        donor_rows.end(), [&](int64_t a, int64_t b) {
          return deviation[static_cast<size_t>(a)] > deviation[static_cast<size_t>(b)];
        });
    for (size_t i = 0; i < std::min(extra, donor_rows.size()); ++i)
      keep[static_cast<size_t>(donor_rows[i])] = 1;

    // Compact the kept rows (in order) to the front; the later layers run only them.
    const int64_t H = c.hidden_size;
    const int64_t rope_dim = rope_table_.dim();
    int64_t kept = 0;
    for (int64_t t = 0; t < n; ++t) {
      if (!keep[static_cast<size_t>(t)]) continue;
      if (kept != t) {
        std::copy_n(hidden_.data() + t * H, H, hidden_.data() + kept * H);
        std::copy_n(rope_.data() + t * rope_dim, rope_dim, rope_.data() + kept * rope_dim);
        token_refs_[static_cast<size_t>(kept)] = token_refs_[static_cast<size_t>(t)];
        token_block_tables_[static_cast<size_t>(kept)] =
            token_block_tables_[static_cast<size_t>(t)];
      }
      ++kept;
    }
    for (int64_t layer = select + 1; layer < c.num_layers; ++layer) run_layer(layer, kept);
    const int64_t last[] = {kept - 1};
    lm_head(last, logits);
    input.sequence->commit(input.tokens);
    recomputed = kept;
    return Status::ok_status();
  } catch (const StatusError& e) {
    kv_deviation_ = nullptr;  // it pointed into this call's `deviation`
    return e.error();         // the expert provider's failure; the sequence is not committed
  }
}

Status Engine::forward_layers(std::span<const SequenceInput> batch, int64_t layers) {
  if (Status status = validate(batch); !status.ok()) return status;
  const int64_t run = std::clamp<int64_t>(layers, 0, model_.config().num_layers);
  // The last layer's experts feed nothing a router observer sees: stop at its router.
  routers_only_layer_ = run - 1;
  try {
    run_layers(batch, run);
  } catch (const StatusError& e) {
    routers_only_layer_ = -1;
    return e.error();  // the expert provider's failure; no sequence of the batch is committed
  }
  routers_only_layer_ = -1;
  for (const SequenceInput& input : batch) input.sequence->commit(input.tokens);
  return Status::ok_status();
}

Status Engine::forward(std::span<const SequenceInput> batch, std::vector<float>& logits) {
  if (Status status = validate(batch); !status.ok()) return status;
  try {
    run_layers(batch, model_.config().num_layers);
  } catch (const StatusError& e) {
    return e.error();  // the expert provider's failure; no sequence of the batch is committed
  }

  // Final norm and LM head only for the rows whose logits are wanted.
  std::vector<int64_t>& rows = logit_rows_;
  rows.clear();
  int64_t row = 0;
  for (const SequenceInput& input : batch) {
    if (input.every_logit)
      for (size_t i = 0; i < input.tokens.size(); ++i)
        rows.push_back(row + static_cast<int64_t>(i));
    row += static_cast<int64_t>(input.tokens.size());
    if (input.want_logits && !input.every_logit && !input.tokens.empty()) rows.push_back(row - 1);
    input.sequence->commit(input.tokens);
  }
  lm_head(rows, logits);
  return Status::ok_status();
}

void Engine::attention_block(int64_t layer, int64_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layer(layer);
  const int64_t H = c.hidden_size;
  const int64_t head_dim = c.head_dim;
  const int64_t q_width = c.num_heads * head_dim;
  const int64_t kv_width = c.num_kv_heads * head_dim;
  float* hidden = hidden_.data();
  float* normed = grow(normed_, n * H);
  float* q = grow(q_, n * q_width);
  float* k = grow(k_, n * kv_width);
  float* v = grow(v_, n * kv_width);
  float* attended = grow(attended_, n * q_width);
  float* projected = grow(projected_, n * H);

  kernels::rms_norm(hidden, n, H, H, w.input_norm, c.rms_norm_eps, normed, H);
  const MatmulTask qkv[] = {{.x = normed, .n = n, .w = w.q_proj, .y = q},
                            {.x = normed, .n = n, .w = w.k_proj, .y = k},
                            {.x = normed, .n = n, .w = w.v_proj, .y = v}};
  kernels::matmul(pool_, qkv);
  add_bias(q, n, w.q_bias);
  add_bias(k, n, w.k_bias);
  add_bias(v, n, w.v_bias);
  if (c.qk_norm_whole) {
    kernels::rms_norm(q, n, q_width, q_width, w.q_norm, c.rms_norm_eps, q, q_width);
    kernels::rms_norm(k, n, kv_width, kv_width, w.k_norm, c.rms_norm_eps, k, kv_width);
  } else if (c.qk_norm) {
    kernels::rms_norm(q, n * c.num_heads, head_dim, head_dim, w.q_norm, c.rms_norm_eps, q,
                      head_dim);
    kernels::rms_norm(k, n * c.num_kv_heads, head_dim, head_dim, w.k_norm, c.rms_norm_eps, k,
                      head_dim);
  }
  if (c.clip_qkv > 0) {
    clamp(q, n * q_width, c.clip_qkv);
    clamp(k, n * kv_width, c.clip_qkv);
    clamp(v, n * kv_width, c.clip_qkv);
  }

  const kernels::PagedKvLayer kv = cache_.layer(layer);
  queries_.clear();
  for (int64_t t = 0; t < n; ++t) {
    const float* angles = rope_.data() + t * rope_table_.dim();
    rope_table_.rotate(q + t * q_width, c.num_heads, head_dim, angles);
    rope_table_.rotate(k + t * kv_width, c.num_kv_heads, head_dim, angles);
    const int64_t position = token_refs_[static_cast<size_t>(t)].position;
    const int32_t block = token_block_tables_[static_cast<size_t>(t)][position / kBlockTokens];
    record_kv_deviation(kv, t, block, position % kBlockTokens, k + t * kv_width, v + t * kv_width);
    for (int64_t head = 0; head < c.num_kv_heads; ++head) {
      std::copy_n(k + t * kv_width + head * head_dim, head_dim,
                  kv.key(block, head, position % kBlockTokens));
      std::copy_n(v + t * kv_width + head * head_dim, head_dim,
                  kv.value(block, head, position % kBlockTokens));
    }
    queries_.push_back({q + t * q_width, attended + t * q_width,
                        token_block_tables_[static_cast<size_t>(t)], position});
  }
  kernels::paged_attention(pool_, kv, queries_, c.num_heads, softmax_scale_, c.sliding_window);

  kernels::matmul(pool_, MatmulTask{.x = attended, .n = n, .w = w.o_proj, .y = projected});
  add_bias(projected, n, w.o_bias);
  add_rows(hidden, projected, n * H);
}

void Engine::record_kv_deviation(const kernels::PagedKvLayer& kv, int64_t t, int32_t block,
                                 int64_t slot, const float* new_k, const float* new_v) {
  if (kv_deviation_ == nullptr) return;
  double squared = 0;
  for (int64_t head = 0; head < kv.kv_heads; ++head) {
    const float* old_k = kv.key(block, head, slot);
    const float* fresh_k = new_k + head * kv.key_dim;
    for (int64_t d = 0; d < kv.key_dim; ++d)
      squared += double(fresh_k[d] - old_k[d]) * (fresh_k[d] - old_k[d]);
    if (kv.values == kv.keys) continue;  // MLA: the values are part of the key row
    const float* old_v = kv.value(block, head, slot);
    const float* fresh_v = new_v + head * kv.value_dim;
    for (int64_t d = 0; d < kv.value_dim; ++d)
      squared += double(fresh_v[d] - old_v[d]) * (fresh_v[d] - old_v[d]);
  }
  kv_deviation_[t] = static_cast<float>(squared);
}

void Engine::latent_attention_block(int64_t layer, int64_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layer(layer);
  const int64_t H = c.hidden_size, heads = c.num_heads;
  const int64_t nope = c.qk_nope_head_dim, rope_dim = c.qk_rope_head_dim;
  const int64_t qk = nope + rope_dim, kv_lora = c.kv_lora_rank, vd = c.v_head_dim;
  const int64_t row = kv_lora + rope_dim;  // one cached token: [latent | rope key]
  // DeepSeek's latent norms are built with their default epsilon, not config.rms_norm_eps.
  constexpr float kLatentNormEps = 1e-6f;
  float* hidden = hidden_.data();
  float* normed = grow(normed_, n * H);
  float* q = grow(q_, n * heads * qk);
  float* latent = grow(k_, n * row);
  float* q_latent = grow(q_latent_, n * heads * row);
  float* out_latent = grow(out_latent_, n * heads * kv_lora);
  float* attended = grow(attended_, n * heads * vd);
  float* projected = grow(projected_, n * H);

  kernels::rms_norm(hidden, n, H, H, w.input_norm, c.rms_norm_eps, normed, H);
  if (c.q_lora_rank > 0) {
    float* q_a = grow(v_, n * c.q_lora_rank);
    const MatmulTask down[] = {{.x = normed, .n = n, .w = w.q_a_proj, .y = q_a},
                               {.x = normed, .n = n, .w = w.kv_a_proj, .y = latent}};
    kernels::matmul(pool_, down);
    kernels::rms_norm(q_a, n, c.q_lora_rank, c.q_lora_rank, w.q_a_norm, kLatentNormEps, q_a,
                      c.q_lora_rank);
    kernels::matmul(pool_, MatmulTask{.x = q_a, .n = n, .w = w.q_b_proj, .y = q});
  } else {
    const MatmulTask project[] = {{.x = normed, .n = n, .w = w.q_proj, .y = q},
                                  {.x = normed, .n = n, .w = w.kv_a_proj, .y = latent}};
    kernels::matmul(pool_, project);
  }
  kernels::rms_norm(latent, n, kv_lora, row, w.kv_a_norm, kLatentNormEps, latent, row);

  const kernels::PagedKvLayer kv = cache_.layer(layer);
  queries_.clear();
  for (int64_t t = 0; t < n; ++t) {
    const float* angles = rope_.data() + t * rope_dim;
    rope_table_.rotate(q + t * heads * qk + nope, heads, qk, angles);
    rope_table_.rotate(latent + t * row + kv_lora, 1, row, angles);
    const int64_t position = token_refs_[static_cast<size_t>(t)].position;
    const int32_t block = token_block_tables_[static_cast<size_t>(t)][position / kBlockTokens];
    const int64_t slot = position % kBlockTokens;
    record_kv_deviation(kv, t, block, slot, latent + t * row, nullptr);
    std::copy_n(latent + t * row, row, kv.key(block, 0, slot));
    // The rope part of the query attends to the rope key as it is.
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(q + (t * heads + h) * qk + nope, rope_dim,
                  q_latent + (t * heads + h) * row + kv_lora);
    queries_.push_back({q_latent + t * heads * row, out_latent + t * heads * kv_lora,
                        token_block_tables_[static_cast<size_t>(t)], position});
  }
  // q_nope · (W_UK_h c) = (W_UK_hᵀ q_nope) · c: each head's query in latent space.
  std::vector<MatmulTask>& tasks = expert_tasks_;
  tasks.clear();
  for (int64_t h = 0; h < heads; ++h)
    tasks.push_back({.x = q + h * qk,
                     .n = n,
                     .w = w.kv_b_key_t.row_range(h * kv_lora, kv_lora),
                     .y = q_latent + h * row,
                     .x_stride = heads * qk,
                     .y_stride = heads * row});
  kernels::matmul(pool_, tasks);
  kernels::paged_attention(pool_, kv, queries_, heads, softmax_scale_, 0);
  // Σ p · (W_UV_h c) = W_UV_h (Σ p · c): each head's value rows applied to its attended latent.
  tasks.clear();
  for (int64_t h = 0; h < heads; ++h)
    tasks.push_back({.x = out_latent + h * kv_lora,
                     .n = n,
                     .w = w.value_up(h),
                     .y = attended + h * vd,
                     .x_stride = heads * kv_lora,
                     .y_stride = heads * vd});
  kernels::matmul(pool_, tasks);
  kernels::matmul(pool_, MatmulTask{.x = attended, .n = n, .w = w.o_proj, .y = projected});
  add_rows(hidden, projected, n * H);
}

void Engine::swiglu(const float* x, int64_t n, const kernels::MatrixView& gate_w,
                    const kernels::MatrixView& up_w, const kernels::MatrixView& down_w, float* y) {
  const int64_t inter = gate_w.rows;
  float* gate = grow(expert_gate_, n * inter);
  float* up = grow(expert_up_, n * inter);
  const MatmulTask gate_up[] = {{.x = x, .n = n, .w = gate_w, .y = gate},
                                {.x = x, .n = n, .w = up_w, .y = up}};
  kernels::matmul(pool_, gate_up);
  silu_mul_parallel(pool_, gate, up, n * inter);
  kernels::matmul(pool_, MatmulTask{.x = gate, .n = n, .w = down_w, .y = y});
}

void Engine::add_gated_rows(const float* x, const float* rows, int64_t n,
                            const kernels::MatrixView& gate_w, float* y) {
  const int64_t H = gate_w.cols;
  float* gate = grow(shared_gate_, n);
  kernels::matmul(pool_, MatmulTask{.x = x, .n = n, .w = gate_w, .y = gate});
  for (int64_t t = 0; t < n; ++t) {
    const float weight = 1.0f / (1.0f + std::exp(-gate[t]));
    kernels::axpy(weight, rows + t * H, y + t * H, H);
  }
}

void Engine::dense_mlp_block(int64_t layer, int64_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layer(layer);
  const int64_t H = c.hidden_size;
  float* normed = grow(normed_, n * H);
  float* out = grow(expert_out_, n * H);
  kernels::rms_norm(hidden_.data(), n, H, H, w.post_attention_norm, c.rms_norm_eps, normed, H);
  swiglu(normed, n, w.dense_gate, w.dense_up, w.dense_down, out);
  add_rows(hidden_.data(), out, n * H);
}

void Engine::route(const LayerWeights& w, float* scores, int64_t n, int32_t* chosen,
                   float* weights) {
  const ModelConfig& c = model_.config();
  const int64_t E = c.num_experts, K = c.experts_per_token;
  const int64_t group_size = E / c.n_group;
  float* choice = grow(route_choice_, E);
  float* group_scores = grow(group_scores_, c.n_group);
  int32_t* kept_groups = grow(group_order_, c.n_group);
  for (int64_t t = 0; t < n; ++t) {
    float* row = scores + t * E;
    if (c.router_scoring == RouterScoring::kSoftmax) {
      kernels::softmax(row, E);
    } else {
      for (int64_t e = 0; e < E; ++e) row[e] = 1.0f / (1.0f + std::exp(-row[e]));
    }
    const float* ranked = row;
    if (c.router_correction_bias || c.group_limit != GroupLimit::kNone) {
      // What experts are chosen on: the scores plus the correction bias, with the experts of all
      // but the topk_group best groups out of reach.
      for (int64_t e = 0; e < E; ++e)
        choice[e] = row[e] + (w.router_bias ? w.router_bias[e] : 0.0f);
      if (c.group_limit != GroupLimit::kNone) {
        for (int64_t g = 0; g < c.n_group; ++g) {
          const float* member = choice + g * group_size;
          if (c.group_limit == GroupLimit::kGroupMax) {
            group_scores[g] = *std::max_element(member, member + group_size);
          } else {
            int32_t best[2];
            top_k(member, group_size, 2, best);
            group_scores[g] = member[best[0]] + member[best[1]];
          }
        }
        top_k(group_scores, c.n_group, c.topk_group, kept_groups);
        for (int64_t g = 0; g < c.n_group; ++g) {
          if (std::find(kept_groups, kept_groups + c.topk_group, g) != kept_groups + c.topk_group)
            continue;
          std::fill(choice + g * group_size, choice + (g + 1) * group_size, -INFINITY);
        }
      }
      ranked = choice;
    }
    int32_t* picked = chosen + t * K;
    top_k(ranked, E, K, picked);
    double sum = 0.0;
    for (int64_t j = 0; j < K; ++j) sum += row[picked[j]];
    for (int64_t j = 0; j < K; ++j) {
      const double p = row[picked[j]];
      double weight = p * c.routed_scaling_factor;
      if (c.norm_topk_prob) {
        weight = p / (sum + 1e-20);
        if (c.scale_normalised_weights) weight *= c.routed_scaling_factor;
      }
      weights[t * K + j] = static_cast<float>(weight);
    }
  }
}

void Engine::prefetch_next_layers(int64_t layer, int64_t n) {
  const int depth = experts_.prefetch_depth();
  if (depth <= 0) return;
  const ModelConfig& c = model_.config();
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.experts_per_token;
  int predicted = 0;
  for (int64_t next = layer + 1; next < c.num_layers && predicted < depth; ++next) {
    const LayerWeights& w = model_.layer(next);
    if (!w.is_moe) continue;
    ++predicted;
    // The next layer's router applied to the current residual stream (normed as that layer
    // would norm its own input): its top-k per token, as a set.
    float* normed = grow(predict_in_, n * H);
    float* scores = grow(predict_scores_, n * E);
    kernels::rms_norm(hidden_.data(), n, H, H, w.post_attention_norm, c.rms_norm_eps, normed, H);
    kernels::matmul(pool_, MatmulTask{.x = normed, .n = n, .w = w.router, .y = scores});
    std::vector<uint8_t>& wanted = predict_wanted_;
    wanted.assign(static_cast<size_t>(E), 0);
    int32_t* chosen = grow(predict_chosen_, n * K);
    float* weights = grow(predict_weights_, n * K);
    route(w, scores, n, chosen, weights);
    for (int64_t i = 0; i < n * K; ++i) wanted[static_cast<size_t>(chosen[i])] = 1;
    std::vector<int32_t>& list = expert_group_prefetch_;
    list.clear();
    for (int64_t x = 0; x < E; ++x)
      if (wanted[static_cast<size_t>(x)]) list.push_back(static_cast<int32_t>(x));
    experts_.prefetch(static_cast<int>(next), list);
  }
}

void Engine::moe_block(int64_t layer, int64_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layer(layer);
  const int64_t H = c.hidden_size;
  const int64_t E = c.num_experts;
  const int64_t K = c.experts_per_token;
  const int64_t inter = c.expert_intermediate_size;
  float* normed = grow(normed_, n * H);
  float* scores = grow(router_scores_, n * E);
  float* weights = grow(chosen_weights_, n * K);
  int32_t* chosen = grow(chosen_experts_, n * K);

  kernels::rms_norm(hidden_.data(), n, H, H, w.post_attention_norm, c.rms_norm_eps, normed, H);
  const auto router_start = std::chrono::steady_clock::now();
  kernels::matmul(pool_, MatmulTask{.x = normed, .n = n, .w = w.router, .y = scores});
  route(w, scores, n, chosen, weights);
  if (observer_) {
    const double router_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - router_start).count();
    observer_->on_router(RouterEvent{layer, E, K,
                                     std::span(token_refs_.data(), static_cast<size_t>(n)), scores,
                                     chosen, weights, router_seconds});
  }
  if (layer == routers_only_layer_) return;

  // Group the (token, expert) pairs by expert (counting sort), so each expert runs once on all its
  // tokens, and gather its input rows.
  int32_t* offsets = grow(expert_offsets_, E + 1);
  std::fill(offsets, offsets + E + 1, 0);
  for (int64_t i = 0; i < n * K; ++i) ++offsets[chosen[i] + 1];
  std::partial_sum(offsets, offsets + E + 1, offsets);
  int32_t* rows = grow(expert_rows_, n * K);
  float* row_weights = grow(expert_row_weights_, n * K);
  float* expert_in = grow(expert_in_, n * K * H);
  expert_cursor_.assign(offsets, offsets + E);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t slot = expert_cursor_[static_cast<size_t>(chosen[t * K + j])]++;
      rows[slot] = static_cast<int32_t>(t);
      row_weights[slot] = weights[t * K + j];
      std::copy_n(normed + t * H, H, expert_in + slot * H);
    }
  }

  float* gate = grow(expert_gate_, n * K * inter);
  float* up = grow(expert_up_, n * K * inter);
  float* out = grow(expert_out_, n * K * H);
  std::vector<MatmulTask>& tasks = expert_tasks_;
  std::vector<offload::ExpertWeights>& acquired = acquired_experts_;
  acquired.assign(static_cast<size_t>(E), {});
  // Tell the provider the whole list first: a shared cache then keeps the ones it holds until
  // they are taken, rather than evict one of this layer's experts to load another.
  std::vector<int32_t>& wanted = expert_group_;
  wanted.clear();
  for (int64_t x = 0; x < E; ++x)
    if (offsets[x + 1] != offsets[x]) wanted.push_back(static_cast<int32_t>(x));
  experts_.expect(static_cast<int>(layer), wanted);
  // The experts run in groups of whatever the provider lets this call pin at once: all of them
  // when every expert is resident; fewer when a small pool is shared. The first of a group waits
  // for its expert (nothing is pinned then); the others are taken only if they need no wait on
  // another caller's pins. Each expert's rows are computed the same way in any grouping.
  std::vector<int32_t>& group = expert_group_;
  bool prefetched = false;
  int64_t e = 0;
  while (e < E) {
    group.clear();
    for (; e < E; ++e) {
      if (offsets[e + 1] == offsets[e]) continue;
      const int l = static_cast<int>(layer), x = static_cast<int>(e);
      std::optional<offload::ExpertWeights> taken;
      try {
        taken = group.empty() ? experts_.acquire(l, x) : experts_.try_acquire(l, x);
      } catch (const StatusError&) {
        // The pool failed (its owner gone, a read error): give back this group's pins before the
        // forward pass reports the error, so that no slot stays pinned by a failed batch.
        for (int32_t pinned : group) experts_.release(l, pinned);
        throw;
      }
      if (!taken) break;
      acquired[static_cast<size_t>(e)] = *taken;
      group.push_back(x);
    }
    if (group.empty()) break;
    // With this group pinned, ask for the next layers' experts, so their loads overlap compute.
    if (!prefetched) {
      prefetch_next_layers(layer, n);
      prefetched = true;
    }
    const int64_t first_row = offsets[group.front()], end_row = offsets[group.back() + 1];
    tasks.clear();
    for (int32_t x : group) {
      const int64_t count = offsets[x + 1] - offsets[x];
      tasks.push_back({.x = expert_in + offsets[x] * H,
                       .n = count,
                       .w = acquired[static_cast<size_t>(x)].gate,
                       .y = gate + offsets[x] * inter});
      tasks.push_back({.x = expert_in + offsets[x] * H,
                       .n = count,
                       .w = acquired[static_cast<size_t>(x)].up,
                       .y = up + offsets[x] * inter});
    }
    kernels::matmul(pool_, tasks);
    silu_mul_parallel(pool_, gate + first_row * inter, up + first_row * inter,
                      (end_row - first_row) * inter);
    tasks.clear();
    for (int32_t x : group) {
      tasks.push_back({.x = gate + offsets[x] * inter,
                       .n = offsets[x + 1] - offsets[x],
                       .w = acquired[static_cast<size_t>(x)].down,
                       .y = out + offsets[x] * H});
    }
    kernels::matmul(pool_, tasks);
    for (int32_t x : group) experts_.release(static_cast<int>(layer), x);
  }

  // Sum the weighted expert outputs per token in ascending expert order (as the reference
  // implementation does), then add to the residual stream.
  float* moe_out = grow(moe_out_, n * H);
  std::fill(moe_out, moe_out + n * H, 0.0f);
  for (int64_t slot = 0; slot < n * K; ++slot)
    kernels::axpy(row_weights[slot], out + slot * H, moe_out + rows[slot] * H, H);
  // Shared experts see every token, unweighted; they are layer weights, always resident.
  if (c.shared_intermediate_size > 0) {
    float* shared = grow(expert_out_, n * H);
    swiglu(normed, n, w.shared_gate, w.shared_up, w.shared_down, shared);
    if (c.shared_expert_gate) {
      add_gated_rows(normed, shared, n, w.shared_expert_gate, moe_out);
    } else {
      add_rows(moe_out, shared, n * H);
    }
  }
  add_rows(hidden_.data(), moe_out, n * H);
}

}  // namespace moeline::model
