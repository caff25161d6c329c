#pragma once
// `moeline perplexity --model M --text FILE [--context N]`: a model's perplexity on a text, as
// llama.cpp's perplexity tool measures it (the second half of each chunk scored), so quantized
// and unquantized models are compared with a number users know.

namespace moeline::cli {

int perplexity_command(int argc, char** argv);

}  // namespace moeline::cli
