#include "cli/quantize_command.h"

#include <chrono>
#include <iostream>
#include <string>

#include "base/progress.h"
#include "base/suggest.h"
#include "model/gguf_export.h"

namespace moeline::cli {
namespace {

constexpr const char* kUsage =
    R"(usage: moeline quantize --model DIR --type TYPE --out FILE.gguf

Writes a Hugging Face checkpoint (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5;
F32, BF16 or F16 safetensors, or FP8 with block scales) as a GGUF file laid out as llama.cpp's converter writes it, so
moeline and llama.cpp both read it: llama.cpp's tensor names and metadata, the tokenizer and chat
template embedded.

  --type TYPE   q8_0, q4_k_m, q5_k_m (llama.cpp's mixes), or one type for every matrix: f32, f16,
                bf16, q8_0, q4_0, q4_k, q5_k, q6_k. Norms, routers and biases stay F32.
  --model DIR   the checkpoint folder
  --out FILE    the GGUF to write (written to FILE.partial, then renamed)
)";

}  // namespace

int quantize_command(int argc, char** argv) {
  std::string model, type, out;
  for (int i = 0; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      return 0;
    }
    const bool known = flag == "--model" || flag == "--type" || flag == "--out";
    if (!known || i + 1 >= argc) {
      std::cerr << kUsage << "moeline: error: "
                << (known ? flag + " needs a value" : unknown_option(flag, kUsage)) << '\n';
      return 2;
    }
    (flag == "--model" ? model : flag == "--type" ? type : out) = argv[++i];
  }
  if (model.empty() || type.empty() || out.empty()) {
    std::cerr << kUsage << "moeline: error: --model, --type and --out are needed\n";
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  auto report = model::export_gguf(model, out, type,
                                   TerminalProgress("quantizing to " + type, "tensors").callback());
  if (!report) {
    std::cerr << "moeline quantize: " << report.error().message << '\n';
    return 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "wrote " << out << ": " << report->tensors << " tensors (" << report->types << "), "
            << report->bytes << " bytes from " << report->source_bytes
            << " bytes of checkpoint tensors in " << seconds << " s\n";
  return 0;
}

}  // namespace moeline::cli
