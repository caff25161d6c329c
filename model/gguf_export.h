#pragma once
// A Hugging Face checkpoint written as a GGUF file that moeline and llama.cpp both read: the
// family's GGUF tensor names (model/arch), llama.cpp's layout (Mixtral's attention rows permuted
// into adjacent RoPE pairs, DeepSeek's kv_b_proj split per head into attn_k_b and attn_v_b,
// experts stacked), its metadata keys, the tokenizer as tokenizer.ggml.*, the chat template.
//
// Types: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k (every matrix of the type, as llama.cpp's
// --pure), and llama.cpp's q4_k_m and q5_k_m mixes (the output matrix Q6_K; attention values and
// ffn_down of the first and last eighth of the layers and every third between one step up; with
// 8 experts, attn_v and attn_k Q8_0 and attn_output Q5_K). Norms, routers and biases stay F32; a
// matrix whose rows are not whole blocks of its type falls back to Q8_0, then F16.

#include <cstdint>
#include <filesystem>
#include <string>

#include "base/progress.h"
#include "base/status.h"

namespace moeline::model {

struct GgufExportReport {
  int64_t tensors = 0;
  uint64_t bytes = 0;         // of the written file
  uint64_t source_bytes = 0;  // of the checkpoint's tensors
  std::string types;          // the tensor types written, "F32+Q4_K+Q6_K"
};

// The type names `export_gguf` takes.
const char* gguf_export_types();

// `progress` hears the tensors written so far.
Expected<GgufExportReport> export_gguf(const std::filesystem::path& checkpoint,
                                       const std::filesystem::path& out, const std::string& type,
                                       const Progress& progress = {});

}  // namespace moeline::model
