#include "cli/run_command.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "base/environment.h"
#include "base/progress.h"
#include "base/suggest.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/kernel_report.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/generator.h"
#ifdef MOELINE_HAVE_CUDA
#include "model/cuda_engine.h"
#endif
#include "cli/args.h"
#include "cli/npy.h"
#include "model/model.h"
#include "model/model_text.h"
#include "offload/expert_pool.h"
#include "offload/resident_provider.h"
#include "offload/trace.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moeline::cli {
namespace {

constexpr const char* kUsage =
    R"(usage: moeline run --model DIR (--prompt TEXT [--chat] | --tokens 1,2,3) [options]

Loads a Hugging Face checkpoint (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5)
or a GGUF file and generates in this process.

  --model DIR|FILE     checkpoint folder (config.json + safetensors + tokenizer.json), or a GGUF
                       file (config, tokenizer, chat template from its metadata); default:
                       $MOELINE_MODEL, else the embedded demo model (models/demo-qwen3-moe)
  --prompt TEXT        prompt text, tokenized with the model's tokenizer.json; prints the text
  --chat               wrap --prompt as a user turn with the model's chat template
                       (tokenizer_config.json) and end with the assistant's turn
  --system TEXT        with --chat: a system message before the user turn
  --tokens IDS         prompt token ids, comma-separated; prints the ids
  --max-tokens N       tokens to generate (default 16)
  --temperature T      0 = greedy (default 0)
  --top-k K            keep the K most likely tokens (default 0 = all)
  --top-p P            nucleus sampling mass in (0, 1] (default 1)
  --seed S             seed for sampling (same seed, same tokens)
  --min-p P            keep tokens at least P times as likely as the best (default 0 = off)
  --presence-penalty X, --frequency-penalty X
                       OpenAI's penalties in [-2, 2] on tokens already generated (default 0)
  --repetition-penalty R
                       > 0: logits of prompt and output tokens divided by R (multiplied when
                       negative), as Hugging Face and vLLM (default 1 = off)
  --logprobs N         with --json: each token's log-probability and the N (0..20) most likely
                       tokens' ("logprobs": [{"logprob", "top": [[id, logprob], ...]}])
  --prompt-logprobs N  with --json: the same for every prompt token after the first, under the
                       tokens before it ("prompt_ids", "prompt_logprobs"; N as --logprobs, which
                       shares it)
  --logit-bias T=B,... OpenAI's logit_bias: B in [-100, 100] added to token T's logit before the
                       penalties and the choice (greedy too)
  --json-object        structured output: the answer is a JSON object (OpenAI's json_object)
  --json-schema FILE   structured output: a document the JSON Schema in FILE accepts
                       (properties in the schema's order; README "Structured output")
  --reasoning may-open|open
                       structured output on a model that thinks: the grammar holds after a
                       <think> block the answer may open (may-open) or that the prompt opened
                       (open): any text up to "</think>", then at most 4 bytes of whitespace
                       (default none: from the first token)
  --stop-ids IDS       extra stop token ids, comma-separated (end-of-sequence ids always stop)
  --ignore-eos         do not stop at the model's end-of-sequence tokens
  --min-tokens N       no end-of-sequence or stop token before N tokens (0)
  --threads N          compute threads (default: all cores)
  --quant-math exact|fast
                       quantized (GGUF) weights: fast (default; activations quantized to 8-bit
                       blocks, integer dot products) or exact (weights dequantized to F32)
  --bf16-math exact|fast
                       BF16 weights: exact (default; widened to F32, F32 activations) or fast
                       (activations rounded to BF16, the CPU's AVX512_BF16 dot products)
  --device cpu|cuda    where the forward pass runs (default cpu); cuda needs a build with nvcc
                       and a GPU; with it --expert-budget sizes the GPU's expert cache, filled
                       from pinned host memory
  --json               print one JSON object at the end instead of the ids
  --logits-out FILE    write the last prompt position's logits as float32 .npy [vocab_size]
  --step-logits-out FILE
                       write the raw logits each generated token was drawn from, float32 .npy
                       [tokens, vocab_size] (to check the sampler against a reference)
  --expert-budget SIZE keep at most SIZE of expert weights in memory: a share of the experts
                       ("25%") or a size ("512MiB"); experts are read from the checkpoint on
                       demand (O_DIRECT) into a pool of that size. Default: all resident
  --prefetch-depth N   with --expert-budget: MoE layers ahead to predict and prefetch (default 1;
                       0: off)
  --loader-threads N   with --expert-budget: threads reading experts from disk (default 1)
  --expert-trace FILE  write every expert acquisition (layer expert, one per line) for
                       `moeline experts replay`
)";

class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct RunOptions {
  std::string model_dir;
  std::vector<int32_t> tokens;
  std::optional<std::string> prompt;
  std::optional<std::string> system;
  bool chat = false;
  bool default_model = false;  // no --model: the embedded model (or $MOELINE_MODEL)
  model::SamplingParams sampling;
  int threads = 0;
  bool json = false;
  std::string logits_out;
  std::string step_logits_out;
  std::string expert_budget;
  int prefetch_depth = 1;
  int loader_threads = 1;
  std::string device = "cpu";
  std::string expert_trace;
};

// The model `moeline run` uses without --model: $MOELINE_MODEL, else the demo model that ships in
// the source tree.
std::string default_model_dir() {
  if (const char* env = env::get(env::kModel); env != nullptr && *env != '\0') return env;
  return MOELINE_DEFAULT_MODEL;
}

RunOptions parse(int argc, char** argv) {
  RunOptions options;
  std::map<std::string, bool> flags_with_value = {
      {"--model", true},          {"--tokens", true},         {"--threads", true},
      {"--quant-math", true},     {"--bf16-math", true},      {"--logits-out", true},
      {"--json", false},          {"--prompt", true},         {"--chat", false},
      {"--system", true},         {"--expert-budget", true},  {"--prefetch-depth", true},
      {"--expert-trace", true},   {"--loader-threads", true}, {"--device", true},
      {"--step-logits-out", true}};
  flags_with_value.insert(sampling_flags().begin(), sampling_flags().end());
  for (int i = 0; i < argc; ++i) {
    const std::string flag = argv[i];
    auto known = flags_with_value.find(flag);
    if (known == flags_with_value.end()) throw UsageError(unknown_option(flag, kUsage));
    std::string value;
    if (known->second) {
      if (i + 1 >= argc) throw UsageError(flag + " needs a value");
      value = argv[++i];
    }
    if (parse_sampling_flag(flag, value, options.sampling)) continue;
    if (flag == "--model")
      options.model_dir = value;
    else if (flag == "--tokens")
      options.tokens = parse_id_list(flag, value);
    else if (flag == "--threads")
      options.threads = parse_number<int>(flag, value);
    else if (flag == "--quant-math") {
      kernels::QuantMath math;
      if (!kernels::parse_quant_math(value.c_str(), math))
        throw std::invalid_argument("--quant-math must be exact or fast, not '" + value + "'");
      kernels::set_quant_math(math);
    } else if (flag == "--bf16-math") {
      kernels::Bf16Math math;
      if (!kernels::parse_bf16_math(value.c_str(), math))
        throw std::invalid_argument("--bf16-math must be exact or fast, not '" + value + "'");
      kernels::set_bf16_math(math);
    } else if (flag == "--logits-out")
      options.logits_out = value;
    else if (flag == "--json")
      options.json = true;
    else if (flag == "--prompt")
      options.prompt = value;
    else if (flag == "--chat")
      options.chat = true;
    else if (flag == "--system")
      options.system = value;
    else if (flag == "--expert-budget")
      options.expert_budget = value;
    else if (flag == "--prefetch-depth")
      options.prefetch_depth = parse_number<int>(flag, value);
    else if (flag == "--expert-trace")
      options.expert_trace = value;
    else if (flag == "--loader-threads")
      options.loader_threads = parse_number<int>(flag, value);
    else if (flag == "--device")
      options.device = value;
    else if (flag == "--step-logits-out")
      options.step_logits_out = value;
  }
  if (options.model_dir.empty()) {
    options.model_dir = default_model_dir();
    options.default_model = true;
  }
  if (options.prompt && !options.tokens.empty())
    throw UsageError("give either --prompt or --tokens, not both");
  if (!options.prompt && options.tokens.empty())
    throw UsageError("--prompt TEXT or --tokens IDS is required");
  if ((options.chat || options.system) && !options.prompt)
    throw UsageError("--chat and --system go with --prompt");
  if (options.system && !options.chat) throw UsageError("--system needs --chat");
  if (options.threads < 0) throw UsageError("--threads must be >= 1");
  if (options.prefetch_depth < 0) throw UsageError("--prefetch-depth must be >= 0");
  if (options.loader_threads < 1) throw UsageError("--loader-threads must be >= 1");
  if (options.device != "cpu" && options.device != "cuda")
    throw UsageError("--device must be cpu or cuda, not '" + options.device + "'");
  if (options.device == "cuda" && !options.expert_trace.empty())
    throw UsageError("--expert-trace records the CPU engine's expert pool; not with --device cuda");
  if (options.threads == 0)
    options.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (moeline::Status status = options.sampling.validate(); !status.ok())
    throw UsageError(status.error().message);
  return options;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int fail(const std::string& message, int code) {
  std::cerr << "moeline: error: " << message << '\n';
  return code;
}

}  // namespace

int run_command(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    if (std::string(argv[i]) == "--help") {
      std::cout << kUsage;
      return 0;
    }
  }
  RunOptions options;
  try {
    options = parse(argc, argv);
  } catch (const std::invalid_argument& e) {  // UsageError, or a flag's value
    std::cerr << kUsage;
    return fail(e.what(), 2);
  }

  if (std::error_code ec; !std::filesystem::exists(options.model_dir, ec)) {
    return fail("model " + options.model_dir + " does not exist" +
                    (options.default_model ? " (no --model given: this is the default model)" : ""),
                2);
  }
  // Text in, text out: the tokenizer (and for --chat the template) load before the weights so a
  // bad prompt fails fast.
  std::optional<tokenizer::Tokenizer> tokenizer;
  if (options.prompt) {
    auto loaded_tokenizer = model::load_model_tokenizer(options.model_dir);
    if (!loaded_tokenizer) return fail(loaded_tokenizer.error().message, 2);
    tokenizer = std::move(*loaded_tokenizer);
    std::string text = *options.prompt;
    if (options.chat) {
      auto chat = model::load_model_chat_template(options.model_dir);
      if (!chat) return fail(chat.error().message, 2);
      std::vector<tokenizer::ChatMessage> messages;
      if (options.system) messages.push_back({"system", *options.system});
      messages.push_back({"user", text});
      auto rendered = chat->render(messages);
      if (!rendered) return fail(rendered.error().message, 2);
      text = std::move(*rendered);
    }
    // A rendered chat already carries its special tokens (as transformers' apply_chat_template).
    auto ids = tokenizer->encode(text, {.add_special_tokens = !options.chat});
    if (!ids) return fail("--prompt: " + ids.error().message, 2);
    if (ids->empty()) return fail("--prompt: the prompt has no tokens", 2);
    options.tokens = std::move(*ids);
  }

  const auto load_start = std::chrono::steady_clock::now();
  // The progress line is erased when the load returns (the end of this statement).
  auto loaded =
      model::Model::load(options.model_dir, TerminalProgress("loading model", "layers").callback());
  if (!loaded) return fail(loaded.error().message, 2);
  const model::Model& model = **loaded;
  const model::ModelConfig& config = model.config();
  std::cerr << "stage=run event=model_loaded dir=" << options.model_dir << ' ' << config.summary()
            << " dtype=" << model.dtype_summary() << " threads=" << options.threads
            << " load_seconds=" << seconds_since(load_start) << '\n';
  const kernels::KernelReport kernel_report = kernels::kernel_report();
  std::cerr << "stage=run event=kernels";
  for (const auto& [name, value] : kernels::report_fields(kernel_report))
    std::cerr << ' ' << name << '='
              << (value.find(' ') == std::string::npos ? value : '"' + value + '"');
  std::cerr << '\n';
  if (const std::string problem = kernels::forced_path_problem(kernel_report); !problem.empty())
    std::cerr << "moeline: warning: " << problem << '\n';

  // KV room for the prompt and every token asked for, up to the model's context (or, for configs
  // that do not state one, a bound that keeps a huge --max-tokens from allocating without limit).
  constexpr int64_t kContextWithoutLimit = 32768;
  const int64_t limit =
      config.max_position_embeddings > 0 ? config.max_position_embeddings : kContextWithoutLimit;
  const int64_t context =
      std::min(static_cast<int64_t>(options.tokens.size()) + options.sampling.max_tokens, limit);
  const auto blocks =
      static_cast<int32_t>((context + model::kBlockTokens - 1) / model::kBlockTokens);

  kernels::ThreadPool pool(options.threads);
  offload::ResidentExpertProvider resident(model.experts());
  offload::ExpertProvider* experts = &resident;
  // --expert-budget: a pool of this process's own (the stack shares one per node instead).
  std::unique_ptr<offload::ExpertPool> expert_pool;
  std::unique_ptr<offload::PoolClient> pool_client;
  if (!options.expert_budget.empty() && options.device == "cpu") {
    try {
      const offload::ExpertCatalog catalog = model.expert_catalog();
      auto created = offload::ExpertPool::create(
          catalog, {.name = "/moeline-run-" + std::to_string(::getpid()),
                    .budget_bytes = offload::parse_expert_budget(options.expert_budget,
                                                                 catalog.pool_bytes_for_all())});
      if (!created) return fail("--expert-budget: " + created.error().message, 2);
      expert_pool = std::move(*created);
      auto attached = offload::PoolClient::attach(expert_pool->name(), catalog);
      if (!attached) return fail("--expert-budget: " + attached.error().message, 2);
      pool_client = std::move(*attached);
      expert_pool->make_private();
      pool_client->set_prefetch_depth(options.prefetch_depth);
      experts = pool_client.get();
      model.release_expert_mappings();
    } catch (const std::exception& e) {
      return fail(std::string("--expert-budget: ") + e.what(), 2);
    }
  }
  std::unique_ptr<offload::TraceRecorder> trace;
  if (!options.expert_trace.empty()) {
    trace = std::make_unique<offload::TraceRecorder>(*experts, model.expert_catalog());
    experts = trace.get();
  }
  model::KvCache cache(config, options.device == "cpu" ? blocks : 0);
  model::Engine engine(model, *experts, pool, cache);
  model::ForwardPass* forward = &engine;
#ifdef MOELINE_HAVE_CUDA
  std::unique_ptr<model::CudaEngine> device_engine;
  if (options.device == "cuda") {
    double fraction = 1.0;
    if (!options.expert_budget.empty()) {
      try {
        fraction = offload::expert_budget_fraction(options.expert_budget,
                                                   model.expert_catalog().pool_bytes_for_all());
      } catch (const std::exception& e) {
        return fail(std::string("--expert-budget: ") + e.what(), 2);
      }
    }
    auto created = model::CudaEngine::create(
        model, {.kv_blocks = blocks, .expert_budget_fraction = std::min(fraction, 1.0)});
    if (!created) return fail("--device cuda: " + created.error().message, 2);
    device_engine = std::move(*created);
    forward = device_engine.get();
  }
#else
  if (options.device == "cuda")
    return fail("--device cuda: this build has no CUDA backend (no nvcc when it was built)", 2);
#endif
  model::Generator generator(*forward);
  model::GenerationRequest request{options.tokens, options.sampling, "",
                                   !options.step_logits_out.empty()};
  auto generated = generator.generate({request});
  if (!generated) return fail(generated.error().message, 2);
  const model::GenerationResult& result = generated->front();

  if (trace && !trace->write(options.expert_trace))
    return fail("cannot write " + options.expert_trace, 1);
  if (!options.logits_out.empty() &&
      !write_npy(options.logits_out, result.prompt_logits, {config.vocab_size}))
    return fail("cannot write " + options.logits_out, 1);
  if (!options.step_logits_out.empty() &&
      !write_npy(options.step_logits_out, result.step_logits,
                 {static_cast<int64_t>(result.tokens.size()), config.vocab_size}))
    return fail("cannot write " + options.step_logits_out, 1);

  const double prompt_tokens = static_cast<double>(options.tokens.size());
  const double decoded = static_cast<double>(result.tokens.size()) - 1;
  const double prefill_rate = prompt_tokens / std::max(result.prefill_seconds, 1e-9);
  const double decode_rate = decoded > 0 ? decoded / std::max(result.decode_seconds, 1e-9) : 0.0;
  std::cerr << "stage=run event=generated prompt_tokens=" << options.tokens.size()
            << " completion_tokens=" << result.tokens.size()
            << " finish_reason=" << model::finish_reason_name(result.finish_reason)
            << " prefill_tokens_per_second=" << prefill_rate
            << " decode_tokens_per_second=" << decode_rate << '\n';

  std::string text;
  if (tokenizer) {
    // Ids the model can emit but the tokenizer has no text for are left out of the text.
    std::vector<int32_t> known;
    for (int32_t id : result.tokens) {
      if (tokenizer->id_to_token(id)) known.push_back(id);
    }
    auto decoded_text = tokenizer->decode(known, {.skip_special_tokens = true});
    if (!decoded_text) return fail(decoded_text.error().message, 1);
    text = std::move(*decoded_text);
  }

  if (options.json) {
    nlohmann::json out = {
        {"ids", result.tokens},
        {"finish_reason", model::finish_reason_name(result.finish_reason)},
        {"usage",
         {{"prompt_tokens", options.tokens.size()}, {"completion_tokens", result.tokens.size()}}},
        {"timings",
         {{"prefill_seconds", result.prefill_seconds},
          {"decode_seconds", result.decode_seconds},
          {"prefill_tokens_per_second", prefill_rate},
          {"decode_tokens_per_second", decode_rate}}}};
    if (tokenizer) out["text"] = text;
    auto logprobs_json = [](const std::vector<model::TokenLogprobs>& entries) {
      nlohmann::json logprobs = nlohmann::json::array();
      for (const model::TokenLogprobs& lp : entries) {
        nlohmann::json top = nlohmann::json::array();
        for (size_t k = 0; k < lp.top_ids.size(); ++k)
          top.push_back({lp.top_ids[k], lp.top_logprobs[k]});
        logprobs.push_back({{"logprob", lp.logprob}, {"top", top}});
      }
      return logprobs;
    };
    if (options.sampling.logprobs) out["logprobs"] = logprobs_json(result.logprobs);
    if (options.sampling.prompt_logprobs) {
      out["prompt_ids"] = options.tokens;
      out["prompt_logprobs"] = logprobs_json(result.prompt_logprobs);
    }
    if (pool_client) {
      const offload::PoolStats s = pool_client->stats();
      out["experts"] = {{"budget", options.expert_budget},
                        {"slots", s.slots},
                        {"hit_ratio", s.hit_ratio()},
                        {"hits", s.hits},
                        {"misses", s.misses},
                        {"loads", s.loads},
                        {"evictions", s.evictions},
                        {"bytes_loaded", s.bytes_loaded},
                        {"stall_seconds", static_cast<double>(s.stall_ns) * 1e-9},
                        {"load_seconds", static_cast<double>(s.load_ns) * 1e-9},
                        {"load_p50_us", s.load_us_quantile(0.5)},
                        {"load_p95_us", s.load_us_quantile(0.95)},
                        {"prefetch_requests", s.prefetch_requests},
                        {"prefetch_loads", s.prefetch_loads},
                        {"prefetch_used", s.prefetch_used},
                        {"prefetch_late", s.prefetch_late},
                        {"prefetch_dropped", s.prefetch_dropped},
                        {"direct_io", s.direct_io != 0}};
    }
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  } else if (tokenizer) {
    std::cout << text << '\n';
  } else {
    for (size_t i = 0; i < result.tokens.size(); ++i)
      std::cout << (i ? "," : "") << result.tokens[i];
    std::cout << '\n';
  }
  return 0;
}

}  // namespace moeline::cli
