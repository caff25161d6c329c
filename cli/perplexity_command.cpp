#include "cli/perplexity_command.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/progress.h"
#include "base/suggest.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/kernel_report.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/model_text.h"
#include "offload/resident_provider.h"

namespace moeline::cli {
namespace {

constexpr const char* kUsage = R"(usage: moeline perplexity --model DIR|FILE --text FILE [options]

The model's perplexity on a text, computed as llama.cpp's perplexity tool computes it: the text
is tokenized whole (with the tokenizer's BOS), cut into chunks of --context tokens whose first
token is BOS when the tokenizer adds one, and each chunk's second half is scored (every scored
token sees at least half a context before it). Prints each chunk's running estimate and the
final PPL with its standard error.

  --model DIR|FILE    checkpoint folder or GGUF file
  --text FILE         UTF-8 text (e.g. wiki.test.raw)
  --context N         tokens per chunk (default 512)
  --chunks N          score at most N chunks (default: all)
  --threads N         compute threads (default: all cores)
  --quant-math exact|fast
                      quantized weights' arithmetic (default fast)
  --bf16-math exact|fast
                      BF16 weights' arithmetic (default exact; fast: BF16 activations and the
                      CPU's AVX512_BF16 dot products)
  --json              one JSON object instead of text
)";

struct Options {
  std::string model, text;
  int64_t context = 512;
  int64_t chunks = -1;
  int threads = 0;
  bool json = false;
};

int fail(const std::string& message) {
  std::cerr << "moeline: error: " << message << '\n';
  return 2;
}

bool parse_int(const std::string& flag, const std::string& text, int64_t& out) {
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (error != std::errc() || end != text.data() + text.size()) {
    std::cerr << "moeline perplexity: " << flag << " expects an integer, not '" << text << "'\n";
    return false;
  }
  return true;
}

// Σ -log softmax(logits)[target], in double.
double negative_log_likelihood(const float* logits, int64_t vocab, int32_t target) {
  float top = logits[0];
  for (int64_t i = 1; i < vocab; ++i) top = std::max(top, logits[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - top));
  return std::log(sum) - static_cast<double>(logits[target] - top);
}

}  // namespace

int perplexity_command(int argc, char** argv) {
  Options options;
  for (int i = 0; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (flag == "--json") {
      options.json = true;
      continue;
    }
    static const char* const kValued[] = {"--model",   "--text",       "--context",  "--chunks",
                                          "--threads", "--quant-math", "--bf16-math"};
    if (std::find(std::begin(kValued), std::end(kValued), flag) == std::end(kValued))
      return fail(unknown_option(flag, kUsage) + "\n" + kUsage);
    if (i + 1 >= argc) return fail(flag + " needs a value\n" + kUsage);
    const std::string value = argv[++i];
    int64_t number = 0;
    if (flag == "--model") {
      options.model = value;
    } else if (flag == "--text") {
      options.text = value;
    } else if (flag == "--context" || flag == "--chunks" || flag == "--threads") {
      if (!parse_int(flag, value, number)) return 2;
      if (number < (flag == "--context" ? 4 : 1))
        return fail(flag + " must be at least " + (flag == "--context" ? "4" : "1"));
      if (flag == "--context") options.context = number;
      if (flag == "--chunks") options.chunks = number;
      if (flag == "--threads") options.threads = static_cast<int>(std::min<int64_t>(number, 1024));
    } else if (flag == "--quant-math") {
      kernels::QuantMath math;
      if (!kernels::parse_quant_math(value.c_str(), math))
        return fail("--quant-math must be exact or fast, not '" + value + "'");
      kernels::set_quant_math(math);
    } else {  // --bf16-math, the last of kValued
      kernels::Bf16Math math;
      if (!kernels::parse_bf16_math(value.c_str(), math))
        return fail("--bf16-math must be exact or fast, not '" + value + "'");
      kernels::set_bf16_math(math);
    }
  }
  if (options.model.empty() || options.text.empty()) return fail("--model and --text are needed");

  std::ifstream in(options.text, std::ios::binary);
  if (!in) return fail(options.text + ": cannot open");
  std::stringstream content;
  content << in.rdbuf();
  auto tokenizer = model::load_model_tokenizer(options.model);
  if (!tokenizer) return fail(tokenizer.error().message);
  auto encoded = tokenizer->encode(content.str(), {.add_special_tokens = true});
  if (!encoded) return fail(options.text + ": " + encoded.error().message);
  const std::vector<int32_t>& tokens = *encoded;

  // The progress line is erased when the load returns (the end of this statement).
  auto loaded =
      model::Model::load(options.model, TerminalProgress("loading model", "layers").callback());
  if (!loaded) return fail(loaded.error().message);
  const model::Model& model = **loaded;
  const model::ModelConfig& config = model.config();
  if (config.max_position_embeddings > 0 && options.context > config.max_position_embeddings)
    return fail("--context " + std::to_string(options.context) + " exceeds the model's " +
                std::to_string(config.max_position_embeddings) + " positions");
  int64_t chunks = static_cast<int64_t>(tokens.size()) / options.context;
  if (options.chunks > 0) chunks = std::min(chunks, options.chunks);
  if (chunks < 1)
    return fail(options.text + " has " + std::to_string(tokens.size()) +
                " tokens, fewer than one chunk of --context " + std::to_string(options.context));
  // The tokenizer adds BOS when its first token is the model's BOS: every chunk then starts so.
  const bool chunks_start_with_bos = config.bos_token_id && !tokens.empty() &&
                                     tokens.front() == static_cast<int32_t>(*config.bos_token_id);

  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  kernels::ThreadPool pool(threads);
  offload::ResidentExpertProvider experts(model.experts());
  model::KvCache cache(config, static_cast<int32_t>((options.context + model::kBlockTokens - 1) /
                                                    model::kBlockTokens));
  model::Engine engine(model, experts, pool, cache);

  const int64_t first = options.context / 2;
  double total = 0.0, total_squares = 0.0;
  int64_t scored = 0;
  nlohmann::json per_chunk = nlohmann::json::array();
  std::vector<float> logits;
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<int32_t> chunk(tokens.begin() + c * options.context,
                               tokens.begin() + (c + 1) * options.context);
    if (chunks_start_with_bos) chunk[0] = static_cast<int32_t>(*config.bos_token_id);
    model::Sequence sequence(static_cast<uint64_t>(c + 1), model.model_id(), 0);
    const model::SequenceInput input{.sequence = &sequence, .tokens = chunk, .every_logit = true};
    const moeline::Status status = engine.forward(std::span(&input, 1), logits);
    sequence.release(engine.blocks());
    if (!status.ok()) return fail("chunk " + std::to_string(c) + ": " + status.error().message);
    for (int64_t j = first; j + 1 < options.context; ++j) {
      const double nll =
          negative_log_likelihood(logits.data() + j * config.vocab_size, config.vocab_size,
                                  chunk[static_cast<size_t>(j + 1)]);
      total += nll;
      total_squares += nll * nll;
      ++scored;
    }
    const double running = std::exp(total / static_cast<double>(scored));
    per_chunk.push_back(running);
    if (!options.json) std::cout << "[" << c + 1 << "]" << running << (c + 1 < chunks ? "," : "\n");
    std::cout.flush();
  }
  const double mean = total / static_cast<double>(scored);
  const double variance = std::max(0.0, total_squares / static_cast<double>(scored) - mean * mean);
  const double ppl = std::exp(mean);
  // The standard error of the mean NLL, carried through exp (as llama.cpp reports it).
  const double error =
      ppl * std::sqrt(variance / static_cast<double>(std::max<int64_t>(1, scored - 1)));
  if (options.json) {
    std::cout << nlohmann::json{{"ppl", ppl},
                                {"ppl_error", error},
                                {"mean_nll", mean},
                                {"tokens", tokens.size()},
                                {"chunks", chunks},
                                {"context", options.context},
                                {"scored_tokens", scored},
                                {"quant_math", kernels::quant_math() == kernels::QuantMath::kFast
                                                   ? "fast"
                                                   : "exact"},
                                {"bf16_math", kernels::kernel_report().bf16_math},
                                {"per_chunk", per_chunk}}
                     .dump()
              << '\n';
  } else {
    std::cout << "Final estimate: PPL = " << ppl << " +/- " << error << '\n';
  }
  return 0;
}

}  // namespace moeline::cli
