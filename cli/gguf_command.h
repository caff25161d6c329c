#pragma once
// `moeline gguf FILE`: what a GGUF file holds (metadata, tensors with their types and shapes), and
// any tensor dequantized to F32 as .npy.

namespace moeline::cli {

int gguf_command(int argc, char** argv);

}  // namespace moeline::cli
