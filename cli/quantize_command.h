#pragma once
// `moeline quantize --model DIR --type TYPE --out FILE.gguf`: a Hugging Face checkpoint written as
// a GGUF that moeline and llama.cpp both read (model/gguf_export.h).

namespace moeline::cli {

int quantize_command(int argc, char** argv);

}  // namespace moeline::cli
