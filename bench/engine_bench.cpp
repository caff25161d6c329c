// moeline_bench: prefill and decode throughput of the in-process engine on one checkpoint, next to
// the machine's measured read bandwidth, printed as one JSON object. scripts/bench runs it per
// thread count (one process each, so peak RSS is per configuration) and prints the table.
//
//   moeline_bench --model DIR [--threads N] [--prompt 512] [--decode 128] [--repeat 3]
//                 [--bf16-math exact|fast]
//
// Decode roofline = read bandwidth / bytes one decoded token reads: the weights it touches
// (attention, router, top-k experts per layer, LM head; shared by the sequences of a batch) and
// its sequence's KV cache over the positions it attends to (each step's context, within the
// sliding window), averaged over the decode steps: the speed at which decode would only wait for
// memory. decode_fraction_of_weight_roofline leaves the KV reads out (the definition before
// 2026-12-06, and what depth-0 runs read within 1%).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/kernel_report.h"
#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/sampling.h"
#include "offload/resident_provider.h"
#include "read_probe.h"

namespace {

using Clock = std::chrono::steady_clock;
using moeline::kernels::ThreadPool;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// GB/s reading 1 GiB with every thread of the pool, each thread's share as one stream and as two
// (the best of four passes after one that faults the pages in: the machine's best read rate,
// whichever way it is read). The buffer is mapped and unmapped here so that it never counts in
// the engine's RSS.
double read_bandwidth(ThreadPool& pool) {
  const size_t bytes = size_t{1} << 30;
  const size_t count = bytes / sizeof(float);
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return 0.0;
  auto* buffer = static_cast<float*>(mapped);
  std::fill(buffer, buffer + count, 1.0f);
  double best = 0.0;
  volatile uint64_t sink = 0;
  for (int pass = 0; pass < 5; ++pass) {
    std::vector<uint64_t> partial(static_cast<size_t>(pool.size()));
    const bool two_streams = pass % 2 == 0;
    const auto start = Clock::now();
    pool.run([&](int thread, int threads) {
      auto [begin, end] = ThreadPool::split(static_cast<int64_t>(count), thread, threads, 1024);
      partial[static_cast<size_t>(thread)] = moeline::bench::read_sum(
          buffer + begin, static_cast<size_t>(end - begin) * sizeof(float), two_streams);
    });
    const double seconds = seconds_since(start);
    for (uint64_t p : partial) sink = sink + p;
    if (pass > 0) best = std::max(best, static_cast<double>(bytes) / seconds / 1e9);
  }
  munmap(mapped, bytes);
  return best;
}

// A "Key:   123 kB" field of a /proc file, in bytes.
long proc_field_bytes(const char* file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::strtol(line.c_str() + key.size(), nullptr, 10) * 1024;
  return 0;
}

// With several threads, where decode's time goes besides the ops' own work: the share of the decode
// time outside the pool's ops (one thread alone: norms, routing, sampling), the share the caller
// spent waiting for the others at the end of ops, the distribution of one wait, and how much of
// the waiting the slowest 1% of waits hold (a few long waits are a thread descheduled, many
// short ones imbalance).
void add_pool_timings(nlohmann::json& out, ThreadPool::Timings timings, double decode_seconds,
                      double decoded_steps) {
  std::vector<float>& waits = timings.waits;
  if (waits.empty() || decode_seconds <= 0.0) return;
  std::sort(waits.begin(), waits.end());
  auto quantile_us = [&](double q) {
    return 1e6 * waits[std::min(waits.size() - 1, static_cast<size_t>(q * waits.size()))];
  };
  double total = 0.0, slowest = 0.0;
  const size_t slowest_from = waits.size() - std::max<size_t>(1, waits.size() / 100);
  for (size_t i = 0; i < waits.size(); ++i) {
    total += waits[i];
    if (i >= slowest_from) slowest += waits[i];
  }
  out["pool_ops_per_decode_step"] = static_cast<double>(waits.size()) / decoded_steps;
  out["decode_fraction_outside_pool_ops"] = 1.0 - timings.in_ops / decode_seconds;
  out["pool_wait_fraction_of_decode"] = total / decode_seconds;
  out["pool_wait_p50_us"] = quantile_us(0.5);
  out["pool_wait_p99_us"] = quantile_us(0.99);
  out["pool_wait_p999_us"] = quantile_us(0.999);
  out["pool_wait_share_of_slowest_1pct"] = total > 0.0 ? slowest / total : 0.0;
}

struct Options {
  std::string model_dir;
  int threads = 1;
  int prompt = 512;
  int decode = 128;
  int repeat = 3;
  int batch = 1;  // sequences decoded together (batched decode)
  int depth = 0;  // tokens already in each sequence's cache when decoding starts (llama-bench -d)
  std::string bf16_math = "exact";
};

// The KV cache one decoded token reads, averaged over the decode steps: step s attends to the
// context's max(depth, 1) tokens and the s + 1 decoded since (itself included), at most the
// sliding window.
double kv_bytes_read_per_decoded_token(const moeline::model::ModelConfig& config,
                                       const Options& options) {
  if (options.decode <= 0) return 0.0;
  double positions = 0.0;
  for (int step = 0; step < options.decode; ++step) {
    int64_t attended = std::max(options.depth, 1) + step + 1;
    if (config.sliding_window > 0) attended = std::min(attended, config.sliding_window);
    positions += static_cast<double>(attended);
  }
  return positions / options.decode *
         static_cast<double>(moeline::model::KvCache::bytes_per_token(config));
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--model")
      options.model_dir = value;
    else if (flag == "--threads")
      options.threads = std::stoi(value);
    else if (flag == "--prompt")
      options.prompt = std::stoi(value);
    else if (flag == "--decode")
      options.decode = std::stoi(value);
    else if (flag == "--repeat")
      options.repeat = std::stoi(value);
    else if (flag == "--batch")
      options.batch = std::max(1, std::stoi(value));
    else if (flag == "--depth")
      options.depth = std::max(0, std::stoi(value));
    else if (flag == "--bf16-math")
      options.bf16_math = value;
    else
      throw std::invalid_argument("unknown option " + flag);
  }
  if (options.model_dir.empty()) throw std::invalid_argument("--model DIR is required");
  moeline::kernels::Bf16Math math;
  if (!moeline::kernels::parse_bf16_math(options.bf16_math.c_str(), math))
    throw std::invalid_argument("--bf16-math must be exact or fast");
  moeline::kernels::set_bf16_math(math);
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  namespace model = moeline::model;
  Options options;
  try {
    options = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "moeline_bench: " << e.what()
              << "\nusage: moeline_bench --model DIR [--threads N] [--prompt 512] [--decode 128] "
                 "[--repeat 3] [--batch 1] [--depth 0] [--bf16-math exact|fast]\n";
    return 2;
  }
  auto loaded = model::Model::load(options.model_dir);
  if (!loaded) {
    std::cerr << "moeline_bench: " << loaded.error().message << '\n';
    return 2;
  }
  const model::Model& m = **loaded;
  const int64_t vocab = m.config().vocab_size;
  ThreadPool pool(options.threads);
  moeline::offload::ResidentExpertProvider experts(m.experts());
  const int64_t context = std::max(options.depth + options.prompt, options.decode + 1);
  model::KvCache cache(
      m.config(),
      static_cast<int32_t>(std::max<int64_t>(
          (context + 15) / 16, options.batch * ((options.depth + options.decode + 16) / 16 + 1))));
  model::Engine engine(m, experts, pool, cache);

  std::vector<int32_t> prompt(static_cast<size_t>(options.prompt));
  for (int i = 0; i < options.prompt; ++i)
    prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % vocab);

  std::vector<float> logits;
  double best_prefill = 1e30, best_decode = 1e30;
  // Run 0 is a warm-up: it faults the mapped weights in, as a server's first request would.
  // Prefill: the whole prompt in one forward. Decode: like llama-bench's tg test, `decode` tokens
  // one at a time from a one-token context, each step greedy on the previous step's logits.
  double bandwidth = 0.0;
  long peak_rss = 0;
  // The pool's ops during the measured decode steps (with several threads).
  ThreadPool::Timings decode_timings;
  double measured_decode_seconds = 0.0;
  // Prefill at a depth (llama-bench's pp512 @ dN) continues a sequence that already holds `depth`
  // tokens: the prompt attends over them too.
  std::vector<int32_t> depth_tokens(static_cast<size_t>(options.depth));
  for (size_t i = 0; i < depth_tokens.size(); ++i)
    depth_tokens[i] = static_cast<int32_t>((i * 104729 + 7) % vocab);
  for (int r = 0; r <= options.repeat; ++r) {
    model::Sequence prefilled(1, m.model_id(), 0);
    if (options.depth > 0) {
      model::SequenceInput context_input{&prefilled, depth_tokens, false};
      if (!engine.forward(std::span(&context_input, 1), logits).ok()) return 1;
    }
    model::SequenceInput input{&prefilled, prompt, true};
    auto start = Clock::now();
    if (!engine.forward(std::span(&input, 1), logits).ok()) return 1;
    const double prefill = seconds_since(start);
    prefilled.release(cache.pool());

    // `batch` sequences, each from its own context of `depth` tokens (one token when 0), decoded
    // together step by step.
    std::vector<std::unique_ptr<model::Sequence>> decoded;
    std::vector<int32_t> next(static_cast<size_t>(options.batch));
    std::vector<model::SequenceInput> inputs;
    std::vector<std::vector<int32_t>> contexts;
    for (int b = 0; b < options.batch; ++b) {
      std::vector<int32_t> context_tokens(static_cast<size_t>(std::max(options.depth, 1)));
      for (size_t i = 0; i < context_tokens.size(); ++i)
        context_tokens[i] = static_cast<int32_t>((b * 31 + i * 7919 + 13) % vocab);
      contexts.push_back(std::move(context_tokens));
    }
    for (int b = 0; b < options.batch; ++b) {
      decoded.push_back(std::make_unique<model::Sequence>(2 + b, m.model_id(), 0));
      inputs.push_back({decoded.back().get(), contexts[static_cast<size_t>(b)], true});
    }
    if (!engine.forward(inputs, logits).ok()) return 1;
    for (int b = 0; b < options.batch; ++b)
      next[static_cast<size_t>(b)] = model::argmax(logits.data() + b * vocab, vocab);
    pool.record_timings(r > 0);
    start = Clock::now();
    for (int step = 0; step < options.decode; ++step) {
      for (int b = 0; b < options.batch; ++b)
        inputs[static_cast<size_t>(b)] = {decoded[static_cast<size_t>(b)].get(),
                                          std::span(&next[static_cast<size_t>(b)], 1), true};
      if (!engine.forward(inputs, logits).ok()) return 1;
      for (int b = 0; b < options.batch; ++b)
        next[static_cast<size_t>(b)] = model::argmax(logits.data() + b * vocab, vocab);
    }
    const double decode = seconds_since(start);
    pool.record_timings(false);
    if (r > 0) {
      const ThreadPool::Timings timings = pool.take_timings();
      decode_timings.waits.insert(decode_timings.waits.end(), timings.waits.begin(),
                                  timings.waits.end());
      decode_timings.in_ops += timings.in_ops;
      measured_decode_seconds += decode;
    }
    for (auto& sequence : decoded) sequence->release(cache.pool());
    // The engine's resident set: mapped weights touched, KV cache, activations.
    peak_rss = std::max(peak_rss, proc_field_bytes("/proc/self/status", "VmRSS:"));
    if (r > 0) {
      best_prefill = std::min(best_prefill, prefill);
      best_decode = std::min(best_decode, decode);
      // Sampled between the runs, not once at the end: the VM's bandwidth drifts over minutes.
      bandwidth = std::max(bandwidth, read_bandwidth(pool));
    }
  }
  const long huge_mapped = proc_field_bytes("/proc/self/smaps_rollup", "FilePmdMapped:");
  const double bytes_per_token = static_cast<double>(m.bytes_touched_per_token());
  // Tokens per second over all sequences of the batch.
  const double decode_rate = static_cast<double>(options.decode) * options.batch / best_decode;
  const double kv_per_token = kv_bytes_read_per_decoded_token(m.config(), options);
  const double decode_bytes_per_token = bytes_per_token / options.batch + kv_per_token;
  const double roofline = bandwidth * 1e9 / decode_bytes_per_token;
  const double weight_roofline = bandwidth * 1e9 / bytes_per_token;
  nlohmann::json out = {
      {"model", options.model_dir},
      {"weights", m.dtype_summary()},
      {"isa", std::string(moeline::kernels::isa_name(moeline::kernels::active_isa()))},
      {"bf16_math", moeline::kernels::kernel_report().bf16_math},
      {"threads", options.threads},
      {"prompt_tokens", options.prompt},
      {"decode_tokens", options.decode},
      {"decode_batch", options.batch},
      {"decode_depth", options.depth},
      {"prefill_tokens_per_second", options.prompt / best_prefill},
      {"decode_tokens_per_second", decode_rate},
      {"read_bandwidth_gb_per_second", bandwidth},
      {"weight_bytes_per_decoded_token", bytes_per_token},
      {"kv_bytes_read_per_decoded_token", kv_per_token},
      {"decode_bytes_per_token", decode_bytes_per_token},
      {"decode_roofline_tokens_per_second", roofline},
      {"decode_fraction_of_roofline", decode_rate / roofline},
      {"decode_fraction_of_weight_roofline", decode_rate / weight_roofline},
      {"mapped_weight_bytes", m.mapped_bytes()},
      {"kv_cache_bytes", cache.bytes()},
      // What the cache keeps per token (MLA: the latent and the rope key), and what it would keep
      // holding every head's key and value.
      {"kv_bytes_per_token", model::KvCache::bytes_per_token(m.config())},
      {"kv_naive_bytes_per_token", model::KvCache::naive_bytes_per_token(m.config())},
      {"weights_mapped_with_huge_pages_bytes", huge_mapped},
      {"peak_rss_bytes", peak_rss}};
  if (options.threads > 1)
    add_pool_timings(out, decode_timings, measured_decode_seconds,
                     static_cast<double>(options.decode) * options.repeat);
  std::cout << out.dump() << '\n';
  return 0;
}
