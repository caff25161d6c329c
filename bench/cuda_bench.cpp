// The CUDA backend's speed on one device: prefill and decode tokens/s at several batch sizes, the
// device expert cache's decode speed at several budgets (experts copied from pinned host memory),
// against the device's measured memory bandwidth and the decode roofline.
//
//   moeline_cuda_bench --model DIR [--prompt 512] [--decode 128] [--batches 1,16]
//                      [--budgets 1,0.5,0.25] [--repeat 2]
//
// Prints one JSON object per measurement, then the markdown table of docs/PERFORMANCE.md.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "model/cuda_engine.h"
#include "model/sampling.h"

namespace {

using namespace moeline;
namespace cu = kernels::cuda;
using Clock = std::chrono::steady_clock;

std::vector<double> parse_list(const std::string& text) {
  std::vector<double> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) values.push_back(std::stod(item));
  return values;
}

double percentile(std::vector<float> values, double q) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(q * static_cast<double>(values.size() - 1))];
}

// The best of 5 timed copies (after one warm-up), in milliseconds.
float best_copy_ms(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  float best = 1e30f;
  for (int i = 0; i < 6; ++i) {
    cudaEventRecord(begin);
    cu::check(cudaMemcpyAsync(dst, src, bytes, kind), "timed copy");
    cudaEventRecord(end);
    cudaEventSynchronize(end);
    float ms = 0;
    cudaEventElapsedTime(&ms, begin, end);
    if (i > 0) best = std::min(best, ms);
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return best;
}

// Device-to-device copy bandwidth: bytes read plus bytes written per second.
double device_bandwidth() {
  const size_t bytes = size_t{2} << 30;
  void *src = nullptr, *dst = nullptr;
  cu::check(cudaMalloc(&src, bytes), "malloc");
  cu::check(cudaMalloc(&dst, bytes), "malloc");
  cu::check(cudaMemset(src, 1, bytes), "memset");
  const float ms = best_copy_ms(dst, src, bytes, cudaMemcpyDeviceToDevice);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

// Pinned host to device copy bandwidth.
double host_to_device_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *host = nullptr, *device = nullptr;
  cu::check(cudaHostAlloc(&host, bytes, cudaHostAllocDefault), "pinned");
  cu::check(cudaMalloc(&device, bytes), "malloc");
  std::fill(static_cast<char*>(host), static_cast<char*>(host) + bytes, 1);
  const float ms = best_copy_ms(device, host, bytes, cudaMemcpyHostToDevice);
  cudaFreeHost(host);
  cudaFree(device);
  return static_cast<double>(bytes) / (ms * 1e-3);
}

struct Speed {
  double prefill = 0, decode = 0;
};

Speed measure(model::CudaEngine& engine, int batch, int prompt, int decode, int repeat,
              bool with_prefill) {
  const int64_t vocab = engine.model().config().vocab_size;
  Speed best;
  for (int r = 0; r <= repeat; ++r) {
    std::vector<std::unique_ptr<model::Sequence>> sequences;
    std::vector<std::vector<int32_t>> prompts;
    std::vector<model::SequenceInput> inputs;
    std::vector<float> logits;
    for (int b = 0; b < batch; ++b) {
      sequences.push_back(std::make_unique<model::Sequence>(b + 1, 0, 0));
      std::vector<int32_t> tokens(static_cast<size_t>(with_prefill ? prompt : 1));
      for (size_t i = 0; i < tokens.size(); ++i)
        tokens[i] = static_cast<int32_t>((b * 131 + i * 7919 + 13) % vocab);
      prompts.push_back(std::move(tokens));
    }
    for (int b = 0; b < batch; ++b)
      inputs.push_back(
          {sequences[static_cast<size_t>(b)].get(), prompts[static_cast<size_t>(b)], true});
    auto start = Clock::now();
    if (!engine.forward(inputs, logits).ok()) throw std::runtime_error("prefill failed");
    const double prefill = std::chrono::duration<double>(Clock::now() - start).count();
    std::vector<int32_t> next(static_cast<size_t>(batch));
    for (int b = 0; b < batch; ++b)
      next[static_cast<size_t>(b)] = model::argmax(logits.data() + b * vocab, vocab);
    start = Clock::now();
    for (int step = 0; step < decode; ++step) {
      for (int b = 0; b < batch; ++b)
        inputs[static_cast<size_t>(b)] = {sequences[static_cast<size_t>(b)].get(),
                                          std::span(&next[static_cast<size_t>(b)], 1), true};
      if (!engine.forward(inputs, logits).ok()) throw std::runtime_error("decode failed");
      for (int b = 0; b < batch; ++b)
        next[static_cast<size_t>(b)] = model::argmax(logits.data() + b * vocab, vocab);
    }
    const double decoding = std::chrono::duration<double>(Clock::now() - start).count();
    for (auto& sequence : sequences) sequence->release(engine.pool());
    if (r == 0) continue;  // warm-up
    best.prefill = std::max(best.prefill, batch * static_cast<double>(prompts[0].size()) / prefill);
    best.decode = std::max(best.decode, batch * static_cast<double>(decode) / decoding);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir;
  int prompt = 512, decode = 128, repeat = 2;
  std::vector<double> batches = {1, 16}, budgets = {1, 0.5, 0.25};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model") {
      model_dir = value;
    } else if (flag == "--prompt") {
      prompt = std::stoi(value);
    } else if (flag == "--decode") {
      decode = std::stoi(value);
    } else if (flag == "--repeat") {
      repeat = std::stoi(value);
    } else if (flag == "--batches") {
      batches = parse_list(value);
    } else if (flag == "--budgets") {
      budgets = parse_list(value);
    } else {
      std::cerr << "moeline_cuda_bench: unknown option " << flag << '\n';
      return 2;
    }
  }
  if (model_dir.empty()) {
    std::cerr << "usage: moeline_cuda_bench --model DIR [--prompt 512] [--decode 128] "
                 "[--batches 1,16] [--budgets 1,0.5,0.25] [--repeat 2]\n";
    return 2;
  }
  std::string why;
  if (!cu::device_available(&why)) {
    std::cerr << "moeline_cuda_bench: " << why << '\n';
    return 3;
  }
  auto loaded = model::Model::load(model_dir);
  if (!loaded) {
    std::cerr << "moeline_cuda_bench: " << loaded.error().message << '\n';
    return 2;
  }
  const model::Model& m = **loaded;
  cudaDeviceProp properties{};
  cudaGetDeviceProperties(&properties, 0);
  const double bandwidth = device_bandwidth();
  const double h2d = host_to_device_bandwidth();
  const double bytes_per_token = static_cast<double>(m.bytes_touched_per_token());
  const double roofline = bandwidth / bytes_per_token;
  std::cout << nlohmann::json{{"device", properties.name},
                              {"device_bandwidth_gb_per_second", bandwidth / 1e9},
                              {"host_to_device_gb_per_second", h2d / 1e9},
                              {"weight_bytes_per_decoded_token", bytes_per_token},
                              {"decode_roofline_tokens_per_second", roofline}}
                   .dump()
            << '\n';
  const int max_batch = static_cast<int>(*std::max_element(batches.begin(), batches.end()));
  const auto kv_blocks = static_cast<int32_t>(max_batch * ((prompt + decode) / 16 + 2) + 16);
  std::ostringstream table;
  table << "| budget | batch | prefill t/s | decode t/s | decode / roofline | expert hits | "
           "expert loads | load p50 ms | load p95 ms |\n|---|---|---|---|---|---|---|---|---|\n";
  double resident_decode = 0;
  // Batch-1 decode with every expert resident, launched one kernel at a time (no graph): against
  // the graph's speed, what launching costs. Measured first, alone on the device.
  double eager_decode = 0;
  if (std::find(batches.begin(), batches.end(), 1.0) != batches.end()) {
    auto eager = model::CudaEngine::create(
        m, {.kv_blocks = kv_blocks, .expert_budget_fraction = 1.0, .decode_graphs = false});
    try {
      if (!eager) throw std::runtime_error(eager.error().message);
      eager_decode = measure(**eager, 1, prompt, decode, repeat, true).decode;
    } catch (const std::exception& e) {
      std::cerr << "moeline_cuda_bench: eager decode not measured: " << e.what() << '\n';
    }
  }
  for (double budget : budgets) {
    auto engine =
        model::CudaEngine::create(m, {.kv_blocks = kv_blocks, .expert_budget_fraction = budget});
    if (!engine) {
      std::cerr << "moeline_cuda_bench: " << engine.error().message << '\n';
      return 1;
    }
    for (double batch_value : batches) {
      const int batch = static_cast<int>(batch_value);
      if (budget < 1 && batch != 1) continue;  // the expert cache is judged at batch 1
      const Speed speed = measure(**engine, batch, prompt, decode, repeat, true);
      const model::CudaExpertStats stats = (*engine)->expert_stats();
      if (budget >= 1 && batch == 1) resident_decode = speed.decode;
      // Where a graph's step goes beyond the bytes: its node count (and eager_decode, below).
      const size_t nodes = (*engine)->graph_nodes(batch);
      const double fraction_of_resident = resident_decode > 0 ? speed.decode / resident_decode : 0;
      std::cout << nlohmann::json{{"budget", budget},
                                  {"batch", batch},
                                  {"slots", (*engine)->expert_slots()},
                                  {"prefill_tokens_per_second", speed.prefill},
                                  {"decode_tokens_per_second", speed.decode},
                                  {"decode_fraction_of_roofline", speed.decode / batch / roofline},
                                  {"decode_fraction_of_all_resident", fraction_of_resident},
                                  {"expert_hits", stats.hits},
                                  {"expert_loads", stats.misses},
                                  {"prefetched", stats.prefetched},
                                  {"prefetch_used", stats.prefetch_used},
                                  {"load_ms_p50", percentile(stats.load_ms, 0.5)},
                                  {"load_ms_p95", percentile(stats.load_ms, 0.95)},
                                  {"decode_graph_replays", (*engine)->graph_replays()},
                                  {"decode_graph_nodes", nodes},
                                  {"decode_step_us_per_graph_node",
                                   nodes > 0 && speed.decode > 0
                                       ? 1e6 * batch / speed.decode / static_cast<double>(nodes)
                                       : 0.0},
                                  {"decode_eager_tokens_per_second",
                                   budget >= 1 && batch == 1 ? eager_decode : 0.0},
                                  {"device_weight_bytes", (*engine)->device_weight_bytes()}}
                       .dump()
                << '\n';
      char row[512];
      std::snprintf(
          row, sizeof row, "| %.0f%% | %d | %.0f | %.1f | %.0f%% | %llu | %llu | %.3f | %.3f |\n",
          budget * 100, batch, speed.prefill, speed.decode, 100.0 * speed.decode / batch / roofline,
          static_cast<unsigned long long>(stats.hits),
          static_cast<unsigned long long>(stats.misses), percentile(stats.load_ms, 0.5),
          percentile(stats.load_ms, 0.95));
      table << row;
    }
  }
  std::printf(
      "\n%s: %.0f GB/s device copy, %.1f GB/s pinned host to device, %.1f MB of weights "
      "per decoded token, roofline %.0f t/s\n\n%s",
      properties.name, bandwidth / 1e9, h2d / 1e9, bytes_per_token / 1e6, roofline,
      table.str().c_str());
  return 0;
}
