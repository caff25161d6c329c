#include "model/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <numeric>
#include <optional>
#include <string>
#include <unordered_map>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/ops.h"
#include "offload/slot_policy.h"

namespace moeline::model {
namespace {

namespace cu = kernels::cuda;
using cu::DeviceMatrix;

// Up to this many (token, expert) pairs a MoE layer runs its experts as warp-per-row GEMVs on the
// device (decode); above, as one cuBLAS GEMM per expert driven from the host (prefill).
constexpr int64_t kDevicePairs = 64;

struct DeviceVector {
  const void* data = nullptr;
  kernels::DType dtype = kernels::DType::kF32;
  int64_t size = 0;
  explicit operator bool() const { return data != nullptr; }
};

// cudaMalloc'd buffers freed together.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* p : buffers_) cudaFree(p);
  }
  void* alloc(size_t bytes) {
    void* p = nullptr;
    cu::check(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc (weights)");
    buffers_.push_back(p);
    total_ += bytes;
    return p;
  }
  DeviceMatrix upload(const kernels::MatrixView& m) {
    if (!m.data) return {};
    void* p = alloc(m.bytes());
    cu::check(cudaMemcpy(p, m.data, m.bytes(), cudaMemcpyHostToDevice), "upload");
    return {p, m.dtype, m.rows, m.cols};
  }
  // Matrices of one dtype and width stacked row-wise into one (their outputs side by side).
  DeviceMatrix upload_stacked(std::initializer_list<const kernels::MatrixView*> parts) {
    const kernels::MatrixView& first = **parts.begin();
    int64_t rows = 0;
    for (const kernels::MatrixView* m : parts) rows += m->rows;
    auto* p = static_cast<std::byte*>(
        alloc(static_cast<size_t>(rows * first.cols) * kernels::dtype_size(first.dtype)));
    size_t offset = 0;
    for (const kernels::MatrixView* m : parts) {
      cu::check(cudaMemcpy(p + offset, m->data, m->bytes(), cudaMemcpyHostToDevice), "upload");
      offset += m->bytes();
    }
    return {p, first.dtype, rows, first.cols};
  }
  DeviceVector upload(const kernels::VectorView& v) {
    if (!v.data) return {};
    const size_t bytes = static_cast<size_t>(v.size) * kernels::dtype_size(v.dtype);
    void* p = alloc(bytes);
    cu::check(cudaMemcpy(p, v.data, bytes, cudaMemcpyHostToDevice), "upload");
    return {p, v.dtype, v.size};
  }
  size_t total() const { return total_; }

 private:
  std::vector<void*> buffers_;
  size_t total_ = 0;
};

// A device buffer that grows to the largest size asked for.
template <class T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (data_) cudaFree(data_);
  }
  T* grow(int64_t count) {
    const auto wanted = static_cast<size_t>(std::max<int64_t>(count, 1));
    if (wanted > size_) {
      if (data_) cu::check(cudaFree(data_), "cudaFree");
      cu::check(cudaMalloc(reinterpret_cast<void**>(&data_), wanted * 2 * sizeof(T)),
                "cudaMalloc (activations)");
      size_ = wanted * 2;
    }
    return data_;
  }
  T* get() const { return data_; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

template <class T>
void upload(Scratch<T>& buffer, const std::vector<T>& host, cudaStream_t stream) {
  T* device = buffer.grow(static_cast<int64_t>(host.size()));
  if (!host.empty())
    cu::check(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice,
                              stream),
              "upload");
}

struct DeviceLayer {
  bool is_moe = false;
  DeviceVector input_norm, post_norm, q_bias, k_bias, v_bias, o_bias, q_norm, k_norm, router_bias;
  DeviceMatrix q, k, v, o, router, dense_gate, dense_up, dense_down, shared_gate, shared_up,
      shared_down;
  // Q, K and V stacked into one matrix (no biases, no Q/K norms, one dtype): one projection per
  // layer writes [q | k | v] per token, and one RoPE call rotates q and k together.
  DeviceMatrix qkv;
  // Multi-head latent attention.
  DeviceMatrix q_a, q_b, kv_a, kv_b, kv_b_key_t;
  DeviceVector q_a_norm, kv_a_norm;
};

// The router of a MoE layer, as the route kernel takes it.
cu::RouterSpec router_spec(const ModelConfig& c, const DeviceLayer& w) {
  return cu::RouterSpec{.experts = c.num_experts,
                        .top_k = c.experts_per_token,
                        .sigmoid = c.router_scoring == RouterScoring::kSigmoid,
                        .group_limit = static_cast<int>(c.group_limit),
                        .n_group = c.n_group,
                        .topk_group = c.topk_group,
                        .normalise = c.norm_topk_prob,
                        .scale_normalised = c.scale_normalised_weights,
                        .scaling = c.routed_scaling_factor,
                        .bias = w.router_bias.data,
                        .bias_dtype = w.router_bias.dtype};
}

}  // namespace

struct CudaEngine::State {
  explicit State(const Model& m, int32_t blocks) : model(m), pool(blocks) {}
  ~State() {
    cudaSetDevice(device);
    for (auto& [n, graph] : graphs) {
      if (graph.exec) cudaGraphExecDestroy(graph.exec);
      for (void* p : {static_cast<void*>(graph.tokens), static_cast<void*>(graph.positions),
                      static_cast<void*>(graph.slot_index), static_cast<void*>(graph.table_offset),
                      static_cast<void*>(graph.tables), static_cast<void*>(graph.logit_rows),
                      static_cast<void*>(graph.cos_sin), static_cast<void*>(graph.logits)})
        if (p) cudaFreeHost(p);
    }
    for (cudaEvent_t e : ready) cudaEventDestroy(e);
    for (cudaEvent_t e : done) cudaEventDestroy(e);
    for (auto& [begin, end] : timing) {
      cudaEventDestroy(begin);
      cudaEventDestroy(end);
    }
    if (copy) cudaStreamSynchronize(copy);  // pins held by copies in flight come back
    if (registered) cudaHostUnregister(const_cast<void*>(registered));
    if (host_experts) cudaFreeHost(host_experts);
    free_observed();
    if (host_chosen) cudaFreeHost(host_chosen);
    if (host_weights) cudaFreeHost(host_weights);
    blas.reset();
    if (copy) cudaStreamDestroy(copy);
    if (compute) cudaStreamDestroy(compute);
  }

  const Model& model;
  int device = 0;  // made current by every entry point: the caller's thread may have another
  cudaStream_t compute = nullptr, copy = nullptr;
  std::unique_ptr<cu::Blas> blas;
  DeviceArena arena;
  std::vector<DeviceLayer> layers;
  DeviceMatrix embed, lm_head;
  DeviceVector final_norm;
  kernels::Rope rope;
  float softmax_scale = 1.0f;

  // KV: [layer][keys | values][block][kv_head][slot][dim], as model::KvCache.
  BlockPool pool;
  KvShape shape;
  float* kv = nullptr;
  size_t key_part = 0, value_part = 0;

  // The expert cache: `slots` slots of expert_bytes, each gate | up | down of one expert.
  int64_t experts_per_layer = 0;
  size_t expert_bytes = 0;
  int slots = 0;
  std::byte* slot_memory = nullptr;
  bool all_resident = false;
  std::byte* host_experts = nullptr;            // pinned: every expert, at key * expert_bytes
  offload::ExpertProvider* provider = nullptr;  // or the node's shared host pool
  const void* registered = nullptr;             // its mapping, registered with the device
  std::atomic<int> pins_in_flight{0};
  bool prefetch = true;
  kernels::ThreadPool* cpu_threads = nullptr;
  double upload_ms = -1, cpu_row_ms = -1, cpu_fixed_ms = 0.05;  // measured costs (moving averages)
  double cpu_preference = 1.0;
  // With every expert resident: each expert's slot address, [layer * experts + expert], for the
  // decode path that stays on the device.
  const void** expert_table = nullptr;
  kernels::DType expert_dtype = kernels::DType::kF32;
  std::vector<cudaEvent_t> ready, done;
  // Which expert each slot holds and which to give up: the host pool's policy (expected reuse
  // distance over the cycle of layers, least recently used on ties; prefetches never displace an
  // unused prefetch or an expert needed sooner). Keys: layer * experts + expert.
  std::unique_ptr<offload::SlotPolicy> policy;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> timing;
  size_t timing_used = 0;
  CudaExpertStats stats;

  // Decode graphs, by batch size. Their inputs are copied from pinned staging buffers, which each
  // step fills before the replay; each sequence's block table has max_table entries there.
  struct Graph {
    bool warmed = false;
    cudaGraphExec_t exec = nullptr;
    size_t nodes = 0;  // kernels and copies in the captured step
    size_t signature = 0;
    int32_t *tokens = nullptr, *positions = nullptr, *slot_index = nullptr, *table_offset = nullptr,
            *tables = nullptr, *logit_rows = nullptr;
    float *cos_sin = nullptr, *logits = nullptr;
  };
  bool use_graphs = true;
  bool capturing = false;
  int64_t max_table = 0;
  std::unordered_map<int64_t, Graph> graphs;
  uint64_t graph_replays = 0;

  // Every buffer a captured graph reads or writes: it is replayable while none has moved.
  size_t buffer_signature() const {
    size_t hash = 0;
    auto mix = [&hash](const void* p) { hash = hash * 1000003u ^ reinterpret_cast<uintptr_t>(p); };
    for (const float* p :
         {hidden.get(),     normed.get(),    q.get(),       k.get(),          v.get(),
          attended.get(),   projected.get(), cos_sin.get(), scores.get(),     weights.get(),
          expert_in.get(),  gate.get(),      up.get(),      expert_out.get(), moe_out.get(),
          shared_out.get(), lm_in.get(),     logits.get(),  q_latent.get(),   out_latent.get()})
      mix(p);
    for (const int32_t* p : {tokens.get(), slot_index.get(), tables.get(), table_offset.get(),
                             positions.get(), chosen.get(), logit_rows.get()})
      mix(p);
    mix(blas->scratch());
    for (const void* p :
         {static_cast<const void*>(observed_scores), static_cast<const void*>(observed_weights),
          static_cast<const void*>(observed_chosen)})
      mix(p);
    hash = hash * 31 + (observer != nullptr);  // a graph captures the observer's copies or not
    return hash;
  }

  // Which experts the next MoE layer after `layer` will probably want: its router applied to the
  // current hidden state (normed as that layer norms its input), as the CPU engine prefetches.
  std::vector<int64_t> predict_next(int64_t layer, int64_t n, const float* hidden_state);

  // Per-forward buffers.
  Scratch<float> hidden, normed, q, k, v, attended, projected, cos_sin, scores, weights, expert_in,
      gate, up, expert_out, moe_out, shared_out, lm_in, logits, q_latent, out_latent;
  Scratch<int32_t> tokens, slot_index, tables, table_offset, positions, chosen, rows, slot_of,
      logit_rows;
  Scratch<float> combine_weights, predict_in, predict_scores, predict_weights;
  Scratch<int32_t> predict_chosen;
  int32_t* host_chosen = nullptr;
  float* host_weights = nullptr;
  int64_t host_routing_capacity = 0;

  // The router observer's view of a forward: each MoE layer's scores, choices and weights, copied
  // into pinned memory as the layer routes (index: moe_index[layer]) and reported once it is done.
  RouterObserver* observer = nullptr;
  std::vector<int64_t> moe_index;  // by layer: its position among the MoE layers, or -1
  int64_t moe_layers = 0;
  float* observed_scores = nullptr;   // [MoE layer][token][expert]
  float* observed_weights = nullptr;  // [MoE layer][token][top_k]
  int32_t* observed_chosen = nullptr;
  int64_t observed_tokens = 0;  // the capacity, in tokens
  std::vector<RoutedToken> observed_refs;
  // Room for n tokens, grown before any copy into it is enqueued (or captured).
  void reserve_observed(int64_t n) {
    if (observer == nullptr || n <= observed_tokens) return;
    cu::check(cudaStreamSynchronize(compute), "observed");
    const int64_t capacity = std::max<int64_t>(n, 2 * observed_tokens);
    const ModelConfig& c = model.config();
    const auto observed_rows = static_cast<size_t>(std::max<int64_t>(moe_layers, 1) * capacity);
    const size_t sizes[3] = {
        observed_rows * static_cast<size_t>(c.num_experts) * sizeof(float),
        observed_rows * static_cast<size_t>(c.experts_per_token) * sizeof(float),
        observed_rows * static_cast<size_t>(c.experts_per_token) * sizeof(int32_t)};
    // All three or none: a failed allocation leaves the old buffers (and capacity) in place.
    void* fresh[3] = {nullptr, nullptr, nullptr};
    for (int i = 0; i < 3; ++i)
      if (cudaHostAlloc(&fresh[i], sizes[i], cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        for (void* p : fresh)
          if (p) cudaFreeHost(p);
        throw std::runtime_error("pinned observer buffers: cannot allocate " +
                                 std::to_string(sizes[0] + sizes[1] + sizes[2]) + " bytes");
      }
    free_observed();
    observed_scores = static_cast<float*>(fresh[0]);
    observed_weights = static_cast<float*>(fresh[1]);
    observed_chosen = static_cast<int32_t*>(fresh[2]);
    observed_tokens = capacity;
  }
  void free_observed() {
    for (void* p : {static_cast<void*>(observed_scores), static_cast<void*>(observed_weights),
                    static_cast<void*>(observed_chosen)})
      if (p) cudaFreeHost(p);
  }
  void observe(int64_t layer, int64_t n, const float* layer_scores, const int32_t* layer_chosen,
               const float* layer_weights) {
    if (observer == nullptr) return;
    const ModelConfig& c = model.config();
    const int64_t E = c.num_experts, K = c.experts_per_token;
    const auto at = static_cast<size_t>(moe_index[static_cast<size_t>(layer)] * n);
    cu::check(cudaMemcpyAsync(observed_scores + at * static_cast<size_t>(E), layer_scores,
                              static_cast<size_t>(n * E) * sizeof(float), cudaMemcpyDeviceToHost,
                              compute),
              "observed scores");
    cu::check(cudaMemcpyAsync(observed_chosen + at * static_cast<size_t>(K), layer_chosen,
                              static_cast<size_t>(n * K) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                              compute),
              "observed choices");
    cu::check(cudaMemcpyAsync(observed_weights + at * static_cast<size_t>(K), layer_weights,
                              static_cast<size_t>(n * K) * sizeof(float), cudaMemcpyDeviceToHost,
                              compute),
              "observed weights");
  }
  // After the forward's synchronisation: one event per MoE layer, as the CPU engine sends.
  void report_observed(std::span<const SequenceInput> batch, int64_t n) {
    if (observer == nullptr) return;
    observed_refs.clear();
    for (const SequenceInput& input : batch)
      for (size_t i = 0; i < input.tokens.size(); ++i)
        observed_refs.push_back(
            {input.sequence->id(), input.sequence->length() + static_cast<int64_t>(i)});
    const ModelConfig& c = model.config();
    const int64_t E = c.num_experts, K = c.experts_per_token;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const int64_t m = moe_index[static_cast<size_t>(l)];
      if (m < 0) continue;
      const auto at = static_cast<size_t>(m * n);
      observer->on_router(RouterEvent{l, E, K, observed_refs,
                                      observed_scores + at * static_cast<size_t>(E),
                                      observed_chosen + at * static_cast<size_t>(K),
                                      observed_weights + at * static_cast<size_t>(K), 0.0});
    }
  }

  // The host pool's mapping, registered with the device the first time the provider has one.
  void register_host_pool() {
    if (provider == nullptr || registered != nullptr || register_tried) return;
    const std::span<const std::byte> mapping = provider->served_from();
    if (mapping.empty()) return;
    register_tried = true;
    void* base = const_cast<std::byte*>(mapping.data());
    if (cudaHostRegister(base, mapping.size(),
                         cudaHostRegisterReadOnly | cudaHostRegisterPortable) == cudaSuccess) {
      registered = base;
    } else {
      cudaGetLastError();
      std::cerr << "stage=cuda event=host_pool_not_registered reason=\"copies from pageable "
                   "memory\"\n";
    }
  }
  bool register_tried = false;

  // KV in and out of the cache in KvCache's block format.
  Scratch<float> kv_packed;
  Scratch<int32_t> kv_ids;
  cu::KvBlocks kv_blocks() const {
    const int64_t block_tokens = kBlockTokens * shape.kv_heads;
    return cu::KvBlocks{.base = kv,
                        .layers = model.config().num_layers,
                        .layer_stride = static_cast<int64_t>(key_part + value_part),
                        .key_part = static_cast<int64_t>(key_part),
                        .key_floats = block_tokens * shape.key_dim,
                        .value_floats = block_tokens * shape.value_dim};
  }

  DeviceMatrix expert_part(int slot, int part) const {
    const ModelConfig& c = model.config();
    const int64_t inter = c.expert_intermediate_size, H = c.hidden_size;
    const kernels::DType dtype = expert_dtype;
    const size_t matrix = static_cast<size_t>(inter * H) * kernels::dtype_size(dtype);
    const std::byte* base = slot_memory + static_cast<size_t>(slot) * expert_bytes;
    if (part == 0) return {base, dtype, inter, H};
    if (part == 1) return {base + matrix, dtype, inter, H};
    return {base + 2 * matrix, dtype, H, inter};
  }
  size_t first_moe_layer() const {
    for (size_t l = 0; l < model.experts().size(); ++l)
      if (!model.experts()[l].empty()) return l;
    return 0;
  }

  // Copies expert `key` into `slot` (chosen by the policy) on the copy stream, once the compute
  // stream is done with what the slot held.
  void load(int64_t key, int slot, bool predicted) {
    const size_t s = static_cast<size_t>(slot);
    policy->assign(slot, key, predicted);
    cu::check(cudaStreamWaitEvent(copy, done[s], 0), "wait slot free");
    if (timing_used == timing.size()) {
      cudaEvent_t begin, end;
      cu::check(cudaEventCreate(&begin), "event");
      cu::check(cudaEventCreate(&end), "event");
      timing.emplace_back(begin, end);
    }
    auto [begin, end] = timing[timing_used++];
    if (provider != nullptr) {
      copy_from_provider(key, slot, begin, end);
    } else {
      cu::check(cudaEventRecord(begin, copy), "record");
      cu::check(cudaMemcpyAsync(slot_memory + s * expert_bytes,
                                host_experts + static_cast<size_t>(key) * expert_bytes,
                                expert_bytes, cudaMemcpyHostToDevice, copy),
                "expert copy");
      cu::check(cudaEventRecord(end, copy), "record");
    }
    cu::check(cudaEventRecord(ready[s], copy), "record");
    stats.bytes_loaded += expert_bytes;
  }

  // The shared host pool as the source: pin the expert there (waiting for its load from disk if
  // it is not resident), copy its three matrices into the slot, and release the pin from the copy
  // stream once they have arrived. While copies hold pins, only try_acquire is used (a caller
  // holding pins must not wait on other callers'); if that fails, the copies finish first.
  void copy_from_provider(int64_t key, int slot, cudaEvent_t begin, cudaEvent_t end) {
    const int layer = static_cast<int>(key / experts_per_layer);
    const int expert = static_cast<int>(key % experts_per_layer);
    std::optional<offload::ExpertWeights> pinned_expert;
    if (pins_in_flight.load() > 0) pinned_expert = provider->try_acquire(layer, expert);
    if (!pinned_expert) {
      cu::check(cudaStreamSynchronize(copy), "copies before a waiting acquire");
      pinned_expert = provider->acquire(layer, expert);
    }
    ++pins_in_flight;
    cu::check(cudaEventRecord(begin, copy), "record");
    std::byte* dst = slot_memory + static_cast<size_t>(slot) * expert_bytes;
    for (const kernels::MatrixView* m :
         {&pinned_expert->gate, &pinned_expert->up, &pinned_expert->down}) {
      cu::check(cudaMemcpyAsync(dst, m->data, m->bytes(), cudaMemcpyHostToDevice, copy),
                "expert copy");
      dst += m->bytes();
    }
    cu::check(cudaEventRecord(end, copy), "record");
    struct Release {
      offload::ExpertProvider* provider;
      int layer, expert;
      std::atomic<int>* pins;
    };
    cu::check(cudaLaunchHostFunc(
                  copy,
                  [](void* data) {
                    std::unique_ptr<Release> release(static_cast<Release*>(data));
                    release->provider->release(release->layer, release->expert);
                    --*release->pins;
                  },
                  new Release{provider, layer, expert, &pins_in_flight}),
              "release after copy");
  }

  void harvest_timings() {
    for (size_t i = 0; i < timing_used; ++i) {
      float ms = 0.0f;
      if (cudaEventElapsedTime(&ms, timing[i].first, timing[i].second) == cudaSuccess) {
        stats.load_ms.push_back(ms);
        upload_ms = upload_ms < 0 ? ms : 0.9 * upload_ms + 0.1 * ms;
      }
    }
    timing_used = 0;
  }

  // The per-miss choice: compute a missing expert's `rows` on the CPU rather than copy it, when
  // the measured costs (copy time of recent loads; CPU time per row plus the round trip of its
  // rows, from earlier CPU computations or the calibration at start) say so.
  bool cheaper_on_cpu(int64_t row_count) const {
    if (cpu_threads == nullptr || upload_ms < 0 || cpu_row_ms < 0) return false;
    return cpu_fixed_ms + cpu_row_ms * static_cast<double>(row_count) < upload_ms * cpu_preference;
  }

  // Host views of an expert: the shared pool's (pinned there until release_host_expert), or this
  // engine's pinned copy.
  offload::ExpertWeights host_expert(int64_t key) {
    const int layer = static_cast<int>(key / experts_per_layer);
    const int expert = static_cast<int>(key % experts_per_layer);
    if (provider != nullptr) return provider->acquire(layer, expert);
    const ModelConfig& c = model.config();
    const int64_t inter = c.expert_intermediate_size, H = c.hidden_size;
    const size_t matrix = static_cast<size_t>(inter * H) * kernels::dtype_size(expert_dtype);
    const std::byte* base = host_experts + static_cast<size_t>(key) * expert_bytes;
    return {{base, expert_dtype, inter, H},
            {base + matrix, expert_dtype, inter, H},
            {base + 2 * matrix, expert_dtype, H, inter}};
  }
  void release_host_expert(int64_t key) {
    if (provider != nullptr)
      provider->release(static_cast<int>(key / experts_per_layer),
                        static_cast<int>(key % experts_per_layer));
  }

  // out_rows = the expert applied on the CPU to expert_in_rows (`row_count` of them, on the
  // device).
  void compute_on_cpu(int64_t key, const float* expert_in_rows, int64_t row_count,
                      float* out_rows) {
    const ModelConfig& c = model.config();
    const int64_t H = c.hidden_size, inter = c.expert_intermediate_size;
    std::vector<float> x(static_cast<size_t>(row_count * H)),
        g(static_cast<size_t>(row_count * inter)), u(static_cast<size_t>(row_count * inter)),
        y(static_cast<size_t>(row_count * H));
    const auto start = std::chrono::steady_clock::now();
    cu::check(cudaMemcpyAsync(x.data(), expert_in_rows, x.size() * sizeof(float),
                              cudaMemcpyDeviceToHost, compute),
              "rows to the host");
    cu::check(cudaStreamSynchronize(compute), "rows to the host");
    const auto computing = std::chrono::steady_clock::now();
    if (pins_in_flight.load() > 0) cu::check(cudaStreamSynchronize(copy), "copies first");
    const offload::ExpertWeights expert = host_expert(key);
    const kernels::MatmulTask gate_up[] = {
        {.x = x.data(), .n = row_count, .w = expert.gate, .y = g.data()},
        {.x = x.data(), .n = row_count, .w = expert.up, .y = u.data()}};
    kernels::matmul(*cpu_threads, gate_up);
    kernels::silu_mul(g.data(), u.data(), row_count * inter);
    kernels::matmul(
        *cpu_threads,
        kernels::MatmulTask{.x = g.data(), .n = row_count, .w = expert.down, .y = y.data()});
    release_host_expert(key);
    const auto computed = std::chrono::steady_clock::now();
    cu::check(cudaMemcpyAsync(out_rows, y.data(), y.size() * sizeof(float), cudaMemcpyHostToDevice,
                              compute),
              "rows back");
    const double round_trip = std::chrono::duration<double, std::milli>(computing - start).count();
    const double per_row = std::chrono::duration<double, std::milli>(computed - computing).count() /
                           static_cast<double>(row_count);
    cpu_fixed_ms = 0.9 * cpu_fixed_ms + 0.1 * round_trip;
    cpu_row_ms = cpu_row_ms < 0 ? per_row : 0.9 * cpu_row_ms + 0.1 * per_row;
    ++stats.computed_on_cpu;
  }
};

std::vector<int64_t> CudaEngine::State::predict_next(int64_t layer, int64_t n,
                                                     const float* hidden_state) {
  const ModelConfig& c = model.config();
  int64_t next = layer + 1;
  while (next < c.num_layers && !layers[static_cast<size_t>(next)].is_moe) ++next;
  if (next >= c.num_layers) return {};
  const DeviceLayer& w = layers[static_cast<size_t>(next)];
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.experts_per_token;
  float* normed_next = predict_in.grow(n * H);
  float* scores_next = predict_scores.grow(n * E);
  int32_t* chosen_next = predict_chosen.grow(n * K);
  float* weights_next = predict_weights.grow(n * K);
  cu::rms_norm(hidden_state, n, H, H, w.post_norm.data, w.post_norm.dtype, c.rms_norm_eps,
               normed_next, H, compute);
  blas->matmul(normed_next, n, w.router, scores_next);
  cu::route(scores_next, n, router_spec(c, w), chosen_next, weights_next, compute);
  std::vector<int32_t> picked(static_cast<size_t>(n * K));
  cu::check(cudaMemcpyAsync(picked.data(), chosen_next, picked.size() * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, compute),
            "prediction back");
  cu::check(cudaStreamSynchronize(compute), "prediction");
  std::vector<int64_t> keys;
  for (int32_t e : picked) keys.push_back(next * E + e);
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  return keys;
}

CudaEngine::CudaEngine(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaEngine::~CudaEngine() = default;
BlockPool& CudaEngine::pool() {
  return state_->pool;
}
const Model& CudaEngine::model() const {
  return state_->model;
}
size_t CudaEngine::graph_nodes(int64_t batch) const {
  const auto it = state_->graphs.find(batch);
  return it == state_->graphs.end() ? 0 : it->second.nodes;
}
uint64_t CudaEngine::graph_replays() const {
  return state_->graph_replays;
}
void CudaEngine::set_router_observer(RouterObserver* observer) {
  state_->observer = observer;
}

size_t CudaEngine::kv_block_bytes() const {
  return static_cast<size_t>(state_->kv_blocks().block_floats()) * sizeof(float);
}

namespace {

// KV moves through a device staging buffer of at most this many blocks at a time, so a long
// prompt's hand-over does not keep a prompt-sized buffer on the device.
constexpr size_t kKvChunkBlocks = 64;

// Moves `blocks` out of the device cache into `out`, or (out null) into it from `in`, in KvCache's
// block format, a chunk at a time.
Status move_kv(CudaEngine::State& s, std::span<const int32_t> blocks, uint8_t* out,
               const uint8_t* in) {
  const bool to_host = out != nullptr;
  try {
    cu::check(cudaSetDevice(s.device), "cudaSetDevice");
    const cu::KvBlocks kv = s.kv_blocks();
    const size_t block_bytes = static_cast<size_t>(kv.block_floats()) * sizeof(float);
    for (size_t first = 0; first < blocks.size(); first += kKvChunkBlocks) {
      const std::span<const int32_t> chunk =
          blocks.subspan(first, std::min(kKvChunkBlocks, blocks.size() - first));
      const auto count = static_cast<int64_t>(chunk.size());
      int32_t* ids = s.kv_ids.grow(count);
      float* packed = s.kv_packed.grow(count * kv.block_floats());
      const size_t offset = first * block_bytes;
      const size_t bytes = chunk.size() * block_bytes;
      cu::check(
          cudaMemcpyAsync(ids, chunk.data(), chunk.size_bytes(), cudaMemcpyHostToDevice, s.compute),
          "kv ids");
      if (to_host) {
        cu::pack_kv_blocks(kv, ids, count, packed, s.compute);
        cu::check(cudaMemcpyAsync(out + offset, packed, bytes, cudaMemcpyDeviceToHost, s.compute),
                  "kv");
      } else {
        cu::check(cudaMemcpyAsync(packed, in + offset, bytes, cudaMemcpyHostToDevice, s.compute),
                  "kv");
        cu::unpack_kv_blocks(kv, ids, count, packed, s.compute);
      }
      cu::check(cudaStreamSynchronize(s.compute), "kv");
    }
    return Status::ok_status();
  } catch (const std::exception& e) {
    return Error{std::string(to_host ? "cuda kv export: " : "cuda kv import: ") + e.what(),
                 StatusCode::kInternal};
  }
}

}  // namespace

Status CudaEngine::export_kv(std::span<const int32_t> blocks, uint8_t* out) {
  return move_kv(*state_, blocks, out, nullptr);
}

Status CudaEngine::import_kv(std::span<const int32_t> blocks, const uint8_t* in) {
  return move_kv(*state_, blocks, nullptr, in);
}

CudaExpertStats CudaEngine::expert_stats() const {
  return state_->stats;
}
std::vector<float> CudaEngine::take_load_ms() {
  std::vector<float> taken;
  taken.swap(state_->stats.load_ms);
  return taken;
}
int CudaEngine::expert_slots() const {
  return state_->slots;
}
size_t CudaEngine::device_weight_bytes() const {
  return state_->arena.total();
}

Expected<std::unique_ptr<CudaEngine>> CudaEngine::create(const Model& model,
                                                         const CudaEngineOptions& options) {
  const ModelConfig& c = model.config();
  if (!(options.expert_budget_fraction > 0 && options.expert_budget_fraction <= 1))
    return Error{"the device expert budget must be a fraction in (0, 1]"};
  std::string why;
  if (model.gguf())
    return Error{
        "the CUDA engine does not run GGUF models yet (its quantized kernels are to come); "
        "run this model on the CPU"};
  if (c.qk_norm_whole || c.clip_qkv > 0)
    return Error{
        "the CUDA engine does not run OLMoE's whole-projection q/k norms yet; run this model on "
        "the CPU"};
  if (c.shared_expert_gate)
    return Error{
        "the CUDA engine does not run Qwen2-MoE's gated shared expert yet; run this model on "
        "the CPU"};
  if (c.fp8_block_rows > 0)
    return Error{
        "the CUDA engine does not run FP8 checkpoints yet (its block-scaled kernels are to "
        "come); run this model on the CPU"};
  if (!cu::device_available(&why)) return Error{why};
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || options.device < 0 ||
      options.device >= devices)
    return Error{"no CUDA device " + std::to_string(options.device) + " (" +
                 std::to_string(devices) + " present)"};
  if (cudaSetDevice(options.device) != cudaSuccess)
    return Error{"cannot use CUDA device " + std::to_string(options.device)};
  try {
    auto s = std::make_unique<State>(model, options.kv_blocks);
    s->device = options.device;
    for (int64_t l = 0; l < c.num_layers; ++l)
      s->moe_index.push_back(model.layer(l).is_moe ? s->moe_layers++ : -1);
    cu::check(cudaStreamCreateWithFlags(&s->compute, cudaStreamNonBlocking), "stream");
    cu::check(cudaStreamCreateWithFlags(&s->copy, cudaStreamNonBlocking), "stream");
    s->blas = std::make_unique<cu::Blas>(s->compute);
    s->rope = make_rope(c);
    s->use_graphs = options.decode_graphs;
    const int64_t context_blocks =
        c.max_position_embeddings > 0
            ? (c.max_position_embeddings + kBlockTokens - 1) / kBlockTokens
            : static_cast<int64_t>(options.kv_blocks);
    s->max_table = std::min<int64_t>(context_blocks, options.kv_blocks);
    s->softmax_scale = static_cast<float>(c.softmax_scale);
    s->embed = s->arena.upload(model.embed_tokens());
    s->lm_head = s->arena.upload(model.lm_head());
    s->final_norm = s->arena.upload(model.final_norm());
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const LayerWeights& w = model.layer(l);
      DeviceLayer d;
      d.is_moe = w.is_moe;
      d.input_norm = s->arena.upload(w.input_norm);
      d.post_norm = s->arena.upload(w.post_attention_norm);
      const bool stack_qkv = !c.mla && !c.qk_norm && w.q_proj.data && !w.q_bias.data &&
                             !w.k_bias.data && !w.v_bias.data && w.k_proj.dtype == w.q_proj.dtype &&
                             w.v_proj.dtype == w.q_proj.dtype && w.k_proj.cols == w.q_proj.cols &&
                             w.v_proj.cols == w.q_proj.cols;
      if (stack_qkv) {
        d.qkv = s->arena.upload_stacked({&w.q_proj, &w.k_proj, &w.v_proj});
      } else {
        d.q = s->arena.upload(w.q_proj);
        d.k = s->arena.upload(w.k_proj);
        d.v = s->arena.upload(w.v_proj);
      }
      d.o = s->arena.upload(w.o_proj);
      d.q_bias = s->arena.upload(w.q_bias);
      d.k_bias = s->arena.upload(w.k_bias);
      d.v_bias = s->arena.upload(w.v_bias);
      d.o_bias = s->arena.upload(w.o_bias);
      d.q_norm = s->arena.upload(w.q_norm);
      d.k_norm = s->arena.upload(w.k_norm);
      d.router = s->arena.upload(w.router);
      d.router_bias = s->arena.upload(w.router_bias);
      d.dense_gate = s->arena.upload(w.dense_gate);
      d.dense_up = s->arena.upload(w.dense_up);
      d.dense_down = s->arena.upload(w.dense_down);
      d.shared_gate = s->arena.upload(w.shared_gate);
      d.shared_up = s->arena.upload(w.shared_up);
      d.shared_down = s->arena.upload(w.shared_down);
      d.q_a = s->arena.upload(w.q_a_proj);
      d.q_b = s->arena.upload(w.q_b_proj);
      d.kv_a = s->arena.upload(w.kv_a_proj);
      d.kv_b = s->arena.upload(w.kv_b_proj);
      d.kv_b_key_t = s->arena.upload(w.kv_b_key_t);
      d.q_a_norm = s->arena.upload(w.q_a_norm);
      d.kv_a_norm = s->arena.upload(w.kv_a_norm);
      s->layers.push_back(d);
    }

    s->shape = kv_shape(c);
    s->key_part = static_cast<size_t>(options.kv_blocks) * kBlockTokens * s->shape.kv_heads *
                  s->shape.key_dim;
    s->value_part = static_cast<size_t>(options.kv_blocks) * kBlockTokens * s->shape.kv_heads *
                    s->shape.value_dim;
    s->kv = static_cast<float*>(s->arena.alloc(static_cast<size_t>(c.num_layers) *
                                               (s->key_part + s->value_part) * sizeof(float)));

    // Experts: every one the same shape and dtype.
    s->experts_per_layer = c.num_experts;
    int64_t total_experts = c.num_layers * c.num_experts;
    const auto& all = model.experts();
    const offload::ExpertWeights& sample = all[s->first_moe_layer()].at(0);
    s->expert_bytes = sample.bytes();
    int64_t present = 0;
    for (const auto& layer : all) present += static_cast<int64_t>(layer.size());
    s->all_resident = options.expert_budget_fraction >= 1.0;
    s->slots = s->all_resident
                   ? static_cast<int>(total_experts)
                   : std::max(2, static_cast<int>(std::floor(options.expert_budget_fraction *
                                                             static_cast<double>(present))));
    s->slot_memory =
        static_cast<std::byte*>(s->arena.alloc(static_cast<size_t>(s->slots) * s->expert_bytes));
    s->policy = std::make_unique<offload::SlotPolicy>(s->slots, static_cast<int>(c.num_layers),
                                                      static_cast<int>(c.num_experts));
    s->ready.resize(static_cast<size_t>(s->slots));
    s->done.resize(static_cast<size_t>(s->slots));
    for (int i = 0; i < s->slots; ++i) {
      cu::check(cudaEventCreateWithFlags(&s->ready[static_cast<size_t>(i)], cudaEventDisableTiming),
                "event");
      cu::check(cudaEventCreateWithFlags(&s->done[static_cast<size_t>(i)], cudaEventDisableTiming),
                "event");
      cu::check(cudaEventRecord(s->done[static_cast<size_t>(i)], s->compute), "record");
      cu::check(cudaEventRecord(s->ready[static_cast<size_t>(i)], s->copy), "record");
    }
    auto pack = [&](const offload::ExpertWeights& e, std::byte* dst, cudaMemcpyKind kind) {
      size_t offset = 0;
      for (const kernels::MatrixView* m : {&e.gate, &e.up, &e.down}) {
        cu::check(cudaMemcpy(dst + offset, m->data, m->bytes(), kind), "expert upload");
        offset += m->bytes();
      }
    };
    s->prefetch = options.prefetch;
    if (!s->all_resident && options.host_experts != nullptr) {
      s->provider = options.host_experts;
      s->register_host_pool();
    }
    if (!s->all_resident && s->provider == nullptr) {
      cu::check(
          cudaHostAlloc(reinterpret_cast<void**>(&s->host_experts),
                        static_cast<size_t>(total_experts) * s->expert_bytes, cudaHostAllocDefault),
          "pinned host experts");
    }
    for (int64_t l = 0; l < c.num_layers; ++l)
      for (size_t e = 0; e < all[static_cast<size_t>(l)].size(); ++e) {
        const int64_t key = l * c.num_experts + static_cast<int64_t>(e);
        const offload::ExpertWeights& weights = all[static_cast<size_t>(l)][e];
        if (weights.bytes() != s->expert_bytes) return Error{"experts differ in size"};
        if (s->all_resident) {
          pack(weights, s->slot_memory + static_cast<size_t>(key) * s->expert_bytes,
               cudaMemcpyHostToDevice);
          s->policy->assign(static_cast<int>(key), key);
        } else if (s->provider == nullptr) {
          pack(weights, s->host_experts + static_cast<size_t>(key) * s->expert_bytes,
               cudaMemcpyHostToHost);
        }
      }
    s->expert_dtype = sample.gate.dtype;
    if (!s->all_resident && options.cpu_threads != nullptr) {
      s->cpu_threads = options.cpu_threads;
      s->cpu_preference = options.cpu_preference;
      // Calibration: the CPU's time for one row of one expert, before any miss needs it.
      const int64_t H = c.hidden_size;
      const auto key = static_cast<int64_t>(s->first_moe_layer()) * c.num_experts;
      const offload::ExpertWeights expert = s->host_expert(key);
      std::vector<float> x(static_cast<size_t>(H), 0.01f),
          g(static_cast<size_t>(c.expert_intermediate_size)), u(g.size()), y(x.size());
      const auto start = std::chrono::steady_clock::now();
      const kernels::MatmulTask gate_up[] = {
          {.x = x.data(), .n = 1, .w = expert.gate, .y = g.data()},
          {.x = x.data(), .n = 1, .w = expert.up, .y = u.data()}};
      kernels::matmul(*s->cpu_threads, gate_up);
      kernels::matmul(*s->cpu_threads,
                      kernels::MatmulTask{.x = g.data(), .n = 1, .w = expert.down, .y = y.data()});
      s->cpu_row_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      s->release_host_expert(key);
    }
    if (s->all_resident) {
      std::vector<const void*> table(static_cast<size_t>(total_experts), nullptr);
      for (int64_t key = 0; key < total_experts; ++key)
        table[static_cast<size_t>(key)] =
            s->slot_memory + static_cast<size_t>(key) * s->expert_bytes;
      s->expert_table = static_cast<const void**>(s->arena.alloc(table.size() * sizeof(void*)));
      cu::check(cudaMemcpy(s->expert_table, table.data(), table.size() * sizeof(void*),
                           cudaMemcpyHostToDevice),
                "expert table");
    }
    cu::check(cudaDeviceSynchronize(), "upload");
    return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(s)));
  } catch (const std::exception& e) {
    return Error{e.what()};
  }
}

namespace {

// Multi-head latent attention as the CPU engine computes it (model/forward.cpp): the latent and
// the rope key are cached; each head's query is mapped into latent space by its K rows of kv_b
// (kv_b_key_t), attends over the cached rows, and its attended latent is mapped out by its V rows.
void latent_attention(CudaEngine::State& s, const DeviceLayer& w, int64_t layer, int64_t n) {
  const ModelConfig& c = s.model.config();
  cudaStream_t stream = s.compute;
  const int64_t H = c.hidden_size, heads = c.num_heads;
  const int64_t nope = c.qk_nope_head_dim, rope_dim = c.qk_rope_head_dim;
  const int64_t qk = nope + rope_dim, kv_lora = c.kv_lora_rank, vd = c.v_head_dim;
  const int64_t row = kv_lora + rope_dim;
  constexpr float kLatentNormEps = 1e-6f;  // DeepSeek's latent norms, whatever rms_norm_eps says
  float* hidden = s.hidden.get();
  float* normed = s.normed.get();
  float* q = s.q.grow(n * heads * qk);
  float* latent = s.k.grow(n * row);
  float* q_latent = s.q_latent.grow(n * heads * row);
  float* out_latent = s.out_latent.grow(n * heads * kv_lora);
  float* attended = s.attended.grow(n * heads * vd);
  cu::rms_norm(hidden, n, H, H, w.input_norm.data, w.input_norm.dtype, c.rms_norm_eps, normed, H,
               stream);
  if (c.q_lora_rank > 0) {
    float* q_a = s.v.grow(n * c.q_lora_rank);
    s.blas->matmul(normed, n, w.q_a, q_a);
    cu::rms_norm(q_a, n, c.q_lora_rank, c.q_lora_rank, w.q_a_norm.data, w.q_a_norm.dtype,
                 kLatentNormEps, q_a, c.q_lora_rank, stream);
    s.blas->matmul(q_a, n, w.q_b, q);
  } else {
    s.blas->matmul(normed, n, w.q, q);
  }
  s.blas->matmul(normed, n, w.kv_a, latent);
  cu::rms_norm(latent, n, kv_lora, row, w.kv_a_norm.data, w.kv_a_norm.dtype, kLatentNormEps, latent,
               row, stream);
  cu::rope(q + nope, n, heads, heads * qk, qk, rope_dim, s.cos_sin.get(), s.rope.interleaved(),
           stream);
  cu::rope(latent + kv_lora, n, 1, row, row, rope_dim, s.cos_sin.get(), s.rope.interleaved(),
           stream);
  float* cache_keys = s.kv + static_cast<size_t>(layer) * (s.key_part + s.value_part);
  cu::write_kv(latent, nullptr, n, 1, row, 0, s.slot_index.get(), cache_keys, nullptr, kBlockTokens,
               stream);
  for (int64_t h = 0; h < heads; ++h) {
    // q_nope · (W_UK_h c) = (W_UK_hᵀ q_nope) · c; the rope part attends to the rope key as it is.
    s.blas->matmul(q + h * qk, n, w.kv_b_key_t.row_range(h * kv_lora, kv_lora), q_latent + h * row,
                   heads * qk, heads * row);
    cu::copy_rows(q + h * qk + nope, heads * qk, q_latent + h * row + kv_lora, heads * row, n,
                  rope_dim, stream);
  }
  const cu::DeviceKv kv{cache_keys, cache_keys, kBlockTokens, 1, row, kv_lora, row};
  cu::attention(q_latent, heads * row, out_latent, heads * kv_lora, n, heads, kv, s.tables.get(),
                s.table_offset.get(), s.positions.get(), s.softmax_scale, 0, stream);
  for (int64_t h = 0; h < heads; ++h)
    s.blas->matmul(out_latent + h * kv_lora, n, w.kv_b.row_range(h * (nope + vd) + nope, vd),
                   attended + h * vd, heads * kv_lora, heads * vd);
  s.blas->matmul(attended, n, w.o, hidden, 0, 0, /*accumulate=*/true);
}

}  // namespace

namespace {

// Everything a forward does on the device, from the uploaded inputs (tokens, positions, slots,
// block tables, angles, logit rows) to the logits of `wanted` rows in s.logits: one stream, and no
// host round trip when every MoE layer runs its experts on the device (then it can be captured
// into a CUDA graph).
void enqueue_forward(CudaEngine::State& s, int64_t n, int64_t wanted) {
  const ModelConfig& c = s.model.config();
  const int64_t H = c.hidden_size;
  cudaStream_t stream = s.compute;
  float* hidden = s.hidden.grow(n * H);
  float* normed = s.normed.grow(n * H);
  cu::embed(s.embed.data, s.embed.dtype, H, s.tokens.get(), n, hidden, stream);

  const int64_t heads = c.num_heads, kv_heads = c.num_kv_heads, hd = c.head_dim;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const DeviceLayer& w = s.layers[static_cast<size_t>(l)];
    if (c.mla) {
      latent_attention(s, w, l, n);
    } else {
      // Attention. q, k, v: each token's heads at q + t * q_stride (k, v likewise).
      float *q, *k, *v;
      int64_t q_stride = heads * hd, kv_stride = kv_heads * hd;
      float* attended = s.attended.grow(n * heads * hd);
      float* projected = s.projected.grow(n * H);
      cu::rms_norm(hidden, n, H, H, w.input_norm.data, w.input_norm.dtype, c.rms_norm_eps, normed,
                   H, stream);
      if (w.qkv.data) {
        q_stride = kv_stride = (heads + 2 * kv_heads) * hd;
        q = s.q.grow(n * q_stride);
        k = q + heads * hd;
        v = k + kv_heads * hd;
        s.blas->matmul(normed, n, w.qkv, q);
        // k's heads follow q's in each token's row: one rotation for both.
        cu::rope(q, n, heads + kv_heads, q_stride, hd, s.rope.dim(), s.cos_sin.get(),
                 s.rope.interleaved(), stream);
      } else {
        q = s.q.grow(n * heads * hd);
        k = s.k.grow(n * kv_heads * hd);
        v = s.v.grow(n * kv_heads * hd);
        s.blas->matmul(normed, n, w.q, q);
        s.blas->matmul(normed, n, w.k, k);
        s.blas->matmul(normed, n, w.v, v);
        if (w.q_bias) cu::add_bias(q, n, heads * hd, w.q_bias.data, w.q_bias.dtype, stream);
        if (w.k_bias) cu::add_bias(k, n, kv_heads * hd, w.k_bias.data, w.k_bias.dtype, stream);
        if (w.v_bias) cu::add_bias(v, n, kv_heads * hd, w.v_bias.data, w.v_bias.dtype, stream);
        if (c.qk_norm) {
          cu::rms_norm(q, n * heads, hd, hd, w.q_norm.data, w.q_norm.dtype, c.rms_norm_eps, q, hd,
                       stream);
          cu::rms_norm(k, n * kv_heads, hd, hd, w.k_norm.data, w.k_norm.dtype, c.rms_norm_eps, k,
                       hd, stream);
        }
        cu::rope(q, n, heads, heads * hd, hd, s.rope.dim(), s.cos_sin.get(), s.rope.interleaved(),
                 stream);
        cu::rope(k, n, kv_heads, kv_heads * hd, hd, s.rope.dim(), s.cos_sin.get(),
                 s.rope.interleaved(), stream);
      }
      float* cache_keys = s.kv + static_cast<size_t>(l) * (s.key_part + s.value_part);
      float* cache_values = cache_keys + s.key_part;
      cu::write_kv(k, v, n, kv_heads, hd, hd, s.slot_index.get(), cache_keys, cache_values,
                   kBlockTokens, stream, kv_stride, kv_stride);
      const cu::DeviceKv kv{cache_keys, cache_values, kBlockTokens, kv_heads, hd, hd, hd};
      cu::attention(q, q_stride, attended, heads * hd, n, heads, kv, s.tables.get(),
                    s.table_offset.get(), s.positions.get(), s.softmax_scale, c.sliding_window,
                    stream);
      if (w.o_bias) {
        s.blas->matmul(attended, n, w.o, projected);
        cu::add_bias(projected, n, H, w.o_bias.data, w.o_bias.dtype, stream);
        cu::add(hidden, projected, n * H, stream);
      } else {
        // The residual added as the projection is written (one kernel fewer per layer).
        s.blas->matmul(attended, n, w.o, hidden, 0, 0, /*accumulate=*/true);
      }
    }
    cu::rms_norm(hidden, n, H, H, w.post_norm.data, w.post_norm.dtype, c.rms_norm_eps, normed, H,
                 stream);
    if (!w.is_moe) {
      const int64_t inter = c.dense_intermediate_size;
      float* gate = s.gate.grow(n * inter);
      float* up = s.up.grow(n * inter);
      s.blas->matmul(normed, n, w.dense_gate, gate);
      s.blas->matmul(normed, n, w.dense_up, up);
      cu::silu_mul(gate, up, n * inter, stream);
      s.blas->matmul(gate, n, w.dense_down, hidden, 0, 0, /*accumulate=*/true);
      continue;
    }

    // Routing on the device; the chosen experts come back to drive the expert GEMMs.
    const int64_t E = c.num_experts, K = c.experts_per_token, inter = c.expert_intermediate_size;
    float* scores = s.scores.grow(n * E);
    int32_t* chosen = s.chosen.grow(n * K);
    float* weights = s.weights.grow(n * K);
    s.blas->matmul(normed, n, w.router, scores);
    const cu::RouterSpec spec = router_spec(c, w);
    cu::route(scores, n, spec, chosen, weights, stream);
    s.observe(l, n, scores, chosen, weights);
    // A decode step without shared experts adds its experts' weighted sum straight into the
    // residual stream (the same sum, from zero, then the same addition: identical bits).
    const bool on_device = s.all_resident && n * K <= kDevicePairs;
    const bool direct = on_device && c.shared_intermediate_size == 0;
    float* moe_out = direct ? hidden : s.moe_out.grow(n * H);
    if (!direct)
      cu::check(cudaMemsetAsync(moe_out, 0, static_cast<size_t>(n * H) * sizeof(float), stream),
                "memset");
    if (on_device) {
      // A decode step: the experts run where the routing is, no round trip to the host.
      const void* const* table = s.expert_table + l * E;
      float* act = s.gate.grow(n * K * inter);
      float* pair_out = s.expert_out.grow(n * K * H);
      cu::expert_gate_up(normed, H, chosen, n * K, K, table, s.expert_dtype, inter, act, stream);
      cu::expert_down(act, inter, chosen, n * K, table, s.expert_dtype, H, pair_out, stream);
      cu::combine_pairs(pair_out, H, chosen, weights, n, K, moe_out, stream);
      if (!s.capturing) s.stats.hits += static_cast<uint64_t>(n * K);
    } else {
      if (n * K > s.host_routing_capacity) {
        if (s.host_chosen) cudaFreeHost(s.host_chosen);
        if (s.host_weights) cudaFreeHost(s.host_weights);
        s.host_routing_capacity = n * K * 2;
        cu::check(cudaHostAlloc(reinterpret_cast<void**>(&s.host_chosen),
                                static_cast<size_t>(s.host_routing_capacity) * sizeof(int32_t),
                                cudaHostAllocDefault),
                  "pinned routing");
        cu::check(cudaHostAlloc(reinterpret_cast<void**>(&s.host_weights),
                                static_cast<size_t>(s.host_routing_capacity) * sizeof(float),
                                cudaHostAllocDefault),
                  "pinned routing");
      }
      cu::check(cudaMemcpyAsync(s.host_chosen, chosen, static_cast<size_t>(n * K) * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, stream),
                "routing back");
      cu::check(cudaMemcpyAsync(s.host_weights, weights, static_cast<size_t>(n * K) * sizeof(float),
                                cudaMemcpyDeviceToHost, stream),
                "routing back");
      cu::check(cudaStreamSynchronize(stream), "routing");

      // Group the (token, expert) pairs by expert, as the CPU engine does; each token's
      // contributions are summed in ascending expert order.
      std::vector<int32_t> offsets(static_cast<size_t>(E + 1), 0), rows(static_cast<size_t>(n * K)),
          slot_of(static_cast<size_t>(n * K));
      std::vector<float> slot_weight(static_cast<size_t>(n * K));
      for (int64_t i = 0; i < n * K; ++i) ++offsets[static_cast<size_t>(s.host_chosen[i] + 1)];
      std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
      std::vector<int32_t> cursor(offsets.begin(), offsets.end() - 1);
      std::vector<std::pair<int32_t, float>> picks;
      for (int64_t t = 0; t < n; ++t) {
        picks.clear();
        for (int64_t j = 0; j < K; ++j)
          picks.emplace_back(s.host_chosen[t * K + j], s.host_weights[t * K + j]);
        std::sort(picks.begin(), picks.end(),
                  [](const auto& a, const auto& b) { return a.first < b.first; });
        for (int64_t j = 0; j < K; ++j) {
          const int32_t slot = cursor[static_cast<size_t>(picks[static_cast<size_t>(j)].first)]++;
          rows[static_cast<size_t>(slot)] = static_cast<int32_t>(t);
          slot_of[static_cast<size_t>(t * K + j)] = slot;
          slot_weight[static_cast<size_t>(t * K + j)] = picks[static_cast<size_t>(j)].second;
        }
      }
      upload(s.rows, rows, stream);
      upload(s.slot_of, slot_of, stream);
      upload(s.combine_weights, slot_weight, stream);
      float* expert_in = s.expert_in.grow(n * K * H);
      float* gate = s.gate.grow(n * K * inter);
      float* up = s.up.grow(n * K * inter);
      float* out = s.expert_out.grow(n * K * H);
      cu::gather_rows(normed, H, s.rows.get(), n * K, expert_in, stream);

      std::vector<int64_t> keys;
      std::vector<int32_t> active;
      for (int64_t e = 0; e < E; ++e)
        if (offsets[static_cast<size_t>(e + 1)] > offsets[static_cast<size_t>(e)]) {
          keys.push_back(l * E + e);
          active.push_back(static_cast<int32_t>(e));
        }
      // The next MoE layer's likely experts, to copy while this layer computes.
      std::vector<int64_t> predicted;
      if (s.prefetch && !s.all_resident) predicted = s.predict_next(l, n, hidden);
      auto rows_of = [&](size_t index) {
        const int32_t e = active[index];
        return static_cast<int64_t>(offsets[static_cast<size_t>(e + 1)] -
                                    offsets[static_cast<size_t>(e)]);
      };
      std::vector<uint8_t> on_cpu(keys.size(), 0);
      s.policy->visit(static_cast<int>(l));
      size_t issued = 0;
      for (size_t i = 0; i < keys.size(); ++i) {
        // Make the next experts resident ahead of use, as far as free slots allow; or leave a
        // miss to the CPU where that is measured to be cheaper.
        while (issued < keys.size()) {
          if (s.policy->slot_of(keys[issued]) >= 0) {
            ++s.stats.hits;
            ++issued;
            continue;
          }
          if (s.cheaper_on_cpu(rows_of(issued))) {
            on_cpu[issued] = 1;
            ++s.stats.misses;
            ++issued;
            continue;
          }
          // Not a slot holding an expert this layer has yet to compute with (those before i are
          // enqueued; the copy stream waits for their done events before overwriting), resident
          // ones included: the policy ranks the running layer's experts last to be needed again,
          // assuming they are in use. Only when nothing is queued ahead (the expert is needed
          // now) may one of the layer's later, resident experts go; it is copied back in turn.
          const std::span<const int64_t> pending = std::span(keys).subspan(i);
          int victim = s.policy->victim(keys[issued], pending, /*prefetch=*/false);
          if (victim < 0 && issued == i)
            victim = s.policy->victim(keys[issued], pending.first(1), /*prefetch=*/false);
          if (victim < 0) break;
          s.load(keys[issued], victim, /*prefetch=*/false);
          ++s.stats.misses;
          ++issued;
        }
        if (i == 0 && issued == keys.size() && !predicted.empty()) {
          // Every expert of this layer is on its way: predicted ones may take the slots of
          // experts this layer does not use and that are expected later than them.
          std::vector<int64_t> keep(keys);
          keep.insert(keep.end(), predicted.begin(), predicted.end());
          for (int64_t key : predicted) {
            if (s.policy->slot_of(key) >= 0) continue;
            const int victim = s.policy->victim(key, keep, /*prefetch=*/true);
            if (victim < 0) continue;
            s.load(key, victim, /*prefetch=*/true);
            ++s.stats.prefetched;
          }
        }
        if (s.policy->use(keys[i])) ++s.stats.prefetch_used;
        if (on_cpu[i]) {
          const int64_t first = offsets[static_cast<size_t>(active[i])];
          s.compute_on_cpu(keys[i], expert_in + first * H, rows_of(i), out + first * H);
          continue;
        }
        const int slot = s.policy->slot_of(keys[i]);
        const auto slot_index_u = static_cast<size_t>(slot);
        if (!s.all_resident)
          cu::check(cudaStreamWaitEvent(stream, s.ready[slot_index_u], 0), "wait expert");
        const int32_t e = active[i];
        const int64_t first = offsets[static_cast<size_t>(e)];
        const int64_t count = offsets[static_cast<size_t>(e + 1)] - first;
        s.blas->matmul(expert_in + first * H, count, s.expert_part(slot, 0), gate + first * inter);
        s.blas->matmul(expert_in + first * H, count, s.expert_part(slot, 1), up + first * inter);
        cu::silu_mul(gate + first * inter, up + first * inter, count * inter, stream);
        s.blas->matmul(gate + first * inter, count, s.expert_part(slot, 2), out + first * H);
        if (!s.all_resident)
          cu::check(cudaEventRecord(s.done[slot_index_u], stream), "record expert done");
      }
      cu::combine(out, H, s.slot_of.get(), s.combine_weights.get(), n, K, moe_out, stream);
    }
    if (c.shared_intermediate_size > 0) {
      const int64_t shared = c.shared_intermediate_size;
      float* shared_gate = s.gate.grow(std::max(n * shared, n * K * inter));
      float* shared_up = s.up.grow(std::max(n * shared, n * K * inter));
      s.blas->matmul(normed, n, w.shared_gate, shared_gate);
      s.blas->matmul(normed, n, w.shared_up, shared_up);
      cu::silu_mul(shared_gate, shared_up, n * shared, stream);
      s.blas->matmul(shared_gate, n, w.shared_down, moe_out, 0, 0, /*accumulate=*/true);
    }
    if (!direct) cu::add(hidden, moe_out, n * H, stream);
  }

  if (wanted > 0) {
    float* lm_in = s.lm_in.grow(wanted * H);
    float* device_logits = s.logits.grow(wanted * c.vocab_size);
    cu::gather_rows(hidden, H, s.logit_rows.get(), wanted, lm_in, stream);
    cu::rms_norm(lm_in, wanted, H, H, s.final_norm.data, s.final_norm.dtype, c.rms_norm_eps, lm_in,
                 H, stream);
    s.blas->matmul(lm_in, wanted, s.lm_head, device_logits);
  }
}

template <class T>
T* pinned(size_t count) {
  void* p = nullptr;
  cu::check(cudaHostAlloc(&p, std::max<size_t>(count, 1) * sizeof(T), cudaHostAllocDefault),
            "pinned staging");
  return static_cast<T*>(p);
}

// A decode step (one token per sequence, every expert resident) replayed from the CUDA graph of
// its batch size. Returns false for a step the caller runs eagerly instead: the first of a batch
// size, which sizes every buffer the graph will capture. Throws when a graph cannot be made.
bool replay_decode(CudaEngine::State& s, std::span<const SequenceInput> batch,
                   const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                   const std::vector<int32_t>& slot_index, const std::vector<float>& cos_sin,
                   std::vector<float>& logits) {
  const auto n = static_cast<int64_t>(tokens.size());
  CudaEngine::State::Graph& g = s.graphs[n];
  if (!g.warmed) {
    g.warmed = true;
    return false;
  }
  const ModelConfig& c = s.model.config();
  const int64_t rope_dim = s.rope.dim(), vocab = c.vocab_size, table = s.max_table;
  const auto count = static_cast<size_t>(n);
  if (!g.tokens) {
    g.tokens = pinned<int32_t>(count);
    g.positions = pinned<int32_t>(count);
    g.slot_index = pinned<int32_t>(count);
    g.table_offset = pinned<int32_t>(count);
    g.logit_rows = pinned<int32_t>(count);
    g.tables = pinned<int32_t>(count * static_cast<size_t>(table));
    g.cos_sin = pinned<float>(count * static_cast<size_t>(rope_dim));
    g.logits = pinned<float>(count * static_cast<size_t>(vocab));
    for (int64_t i = 0; i < n; ++i) {
      g.table_offset[i] = static_cast<int32_t>(i * table);
      g.logit_rows[i] = static_cast<int32_t>(i);
    }
  }
  std::copy(tokens.begin(), tokens.end(), g.tokens);
  std::copy(positions.begin(), positions.end(), g.positions);
  std::copy(slot_index.begin(), slot_index.end(), g.slot_index);
  std::copy(cos_sin.begin(), cos_sin.end(), g.cos_sin);
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int32_t>& own = batch[static_cast<size_t>(i)].sequence->block_table();
    std::copy(own.begin(), own.end(), g.tables + i * table);
  }
  int32_t* device_tokens = s.tokens.grow(n);
  int32_t* device_positions = s.positions.grow(n);
  int32_t* device_slots = s.slot_index.grow(n);
  int32_t* device_offsets = s.table_offset.grow(n);
  int32_t* device_tables = s.tables.grow(n * table);
  int32_t* device_rows = s.logit_rows.grow(n);
  float* device_angles = s.cos_sin.grow(n * rope_dim);
  cudaStream_t stream = s.compute;
  const size_t signature = s.buffer_signature();
  if (!g.exec || g.signature != signature) {
    if (g.exec) cu::check(cudaGraphExecDestroy(g.exec), "destroy graph");
    g.exec = nullptr;
    cu::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), "begin capture");
    try {
      auto copy_in = [&](void* dst, const void* src, size_t bytes) {
        cu::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), "capture");
      };
      copy_in(device_tokens, g.tokens, count * sizeof(int32_t));
      copy_in(device_positions, g.positions, count * sizeof(int32_t));
      copy_in(device_slots, g.slot_index, count * sizeof(int32_t));
      copy_in(device_offsets, g.table_offset, count * sizeof(int32_t));
      copy_in(device_rows, g.logit_rows, count * sizeof(int32_t));
      copy_in(device_tables, g.tables, count * static_cast<size_t>(table) * sizeof(int32_t));
      copy_in(device_angles, g.cos_sin, count * static_cast<size_t>(rope_dim) * sizeof(float));
      s.capturing = true;  // counted per replay instead
      enqueue_forward(s, n, n);
      s.capturing = false;
      cu::check(cudaMemcpyAsync(g.logits, s.logits.get(),
                                count * static_cast<size_t>(vocab) * sizeof(float),
                                cudaMemcpyDeviceToHost, stream),
                "capture");
    } catch (...) {
      s.capturing = false;
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream, &broken);
      if (broken) cudaGraphDestroy(broken);
      throw;
    }
    cudaGraph_t graph = nullptr;
    cu::check(cudaStreamEndCapture(stream, &graph), "end capture");
    size_t nodes = 0;
    if (cudaGraphGetNodes(graph, nullptr, &nodes) == cudaSuccess) g.nodes = nodes;
    const cudaError_t made = cudaGraphInstantiate(&g.exec, graph, 0);
    cudaGraphDestroy(graph);
    cu::check(made, "instantiate graph");
    if (s.buffer_signature() != signature)
      throw std::runtime_error("a buffer moved while the decode step was captured");
    g.signature = signature;
  }
  cu::check(cudaGraphLaunch(g.exec, stream), "graph launch");
  cu::check(cudaStreamSynchronize(stream), "graph replay");
  logits.assign(g.logits, g.logits + count * static_cast<size_t>(vocab));
  ++s.graph_replays;
  return true;
}

}  // namespace

Status CudaEngine::forward(std::span<const SequenceInput> batch, std::vector<float>& logits) {
  State& s = *state_;
  const ModelConfig& c = s.model.config();
  if (Status status = validate_batch(c, batch, s.pool.free_blocks()); !status.ok()) return status;
  int64_t n = 0;
  for (const SequenceInput& input : batch) n += static_cast<int64_t>(input.tokens.size());
  if (n == 0) {
    logits.clear();
    return Status::ok_status();
  }
  try {
    cu::check(cudaSetDevice(s.device), "cudaSetDevice");
    cudaStream_t stream = s.compute;
    std::vector<int32_t> tokens, positions, slot_index, tables, table_offset, logit_rows;
    std::vector<float> cos_sin;
    const int64_t rope_dim = s.rope.dim();
    for (const SequenceInput& input : batch) {
      input.sequence->reserve(s.pool, static_cast<int64_t>(input.tokens.size()));
      const auto offset = static_cast<int32_t>(tables.size());
      tables.insert(tables.end(), input.sequence->block_table().begin(),
                    input.sequence->block_table().end());
      for (size_t i = 0; i < input.tokens.size(); ++i) {
        const int64_t position = input.sequence->length() + static_cast<int64_t>(i);
        tokens.push_back(input.tokens[i]);
        positions.push_back(static_cast<int32_t>(position));
        slot_index.push_back(static_cast<int32_t>(
            input.sequence->block_table()[static_cast<size_t>(position / kBlockTokens)] *
                kBlockTokens +
            position % kBlockTokens));
        table_offset.push_back(offset);
        const size_t at = cos_sin.size();
        cos_sin.resize(at + static_cast<size_t>(rope_dim));
        s.rope.angles(position, cos_sin.data() + at);
      }
      if (input.every_logit) {
        for (size_t i = input.tokens.size(); i > 0; --i)
          logit_rows.push_back(static_cast<int32_t>(tokens.size() - i));
      } else if (input.want_logits && !input.tokens.empty()) {
        logit_rows.push_back(static_cast<int32_t>(tokens.size() - 1));
      }
    }
    if (!s.all_resident) s.register_host_pool();
    s.reserve_observed(n);
    bool decode_step = s.use_graphs && s.all_resident &&
                       n * std::max<int64_t>(c.experts_per_token, 1) <= kDevicePairs;
    for (const SequenceInput& input : batch)
      decode_step = decode_step && input.tokens.size() == 1 && input.want_logits &&
                    static_cast<int64_t>(input.sequence->block_table().size()) <= s.max_table;
    if (decode_step) {
      try {
        if (replay_decode(s, batch, tokens, positions, slot_index, cos_sin, logits)) {
          // The replayed step's experts were all device hits (counted at capture otherwise).
          s.stats.hits += static_cast<uint64_t>(n * c.experts_per_token * s.moe_layers);
          s.report_observed(batch, n);
          for (const SequenceInput& input : batch) input.sequence->commit(input.tokens);
          return Status::ok_status();
        }
      } catch (const std::exception& e) {
        // Graphs are an optimisation: without them every step runs eagerly, as prefill does.
        s.use_graphs = false;
        cudaGetLastError();
        std::cerr << "stage=cuda event=decode_graphs_off reason=\"" << e.what() << "\"\n";
      }
    }
    upload(s.tokens, tokens, stream);
    upload(s.positions, positions, stream);
    upload(s.slot_index, slot_index, stream);
    upload(s.tables, tables, stream);
    upload(s.table_offset, table_offset, stream);
    upload(s.cos_sin, cos_sin, stream);

    const auto wanted = static_cast<int64_t>(logit_rows.size());
    upload(s.logit_rows, logit_rows, stream);
    enqueue_forward(s, n, wanted);
    logits.resize(static_cast<size_t>(wanted * c.vocab_size));
    if (wanted > 0)
      cu::check(cudaMemcpyAsync(logits.data(), s.logits.get(), logits.size() * sizeof(float),
                                cudaMemcpyDeviceToHost, stream),
                "logits back");
    cu::check(cudaStreamSynchronize(stream), "forward");
    if (!s.all_resident) {
      cu::check(cudaStreamSynchronize(s.copy), "expert copies");
      s.harvest_timings();
    }
    s.report_observed(batch, n);
    for (const SequenceInput& input : batch) input.sequence->commit(input.tokens);
    return Status::ok_status();
  } catch (const std::exception& e) {
    return Error{std::string("cuda forward: ") + e.what(), StatusCode::kInternal};
  }
}

}  // namespace moeline::model
