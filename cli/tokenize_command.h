#pragma once
// `moeline tokenize` and `moeline detokenize`: the tokenizer on the command line, reading stdin.

namespace moeline::cli {

int tokenize_command(int argc, char** argv);
int detokenize_command(int argc, char** argv);
int chat_template_command(int argc, char** argv);

}  // namespace moeline::cli
