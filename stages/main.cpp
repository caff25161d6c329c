// `moeline <command>`: one executable for every role. Today: `run`; the stage processes, `stack`,
// `client` and `load` join with the pipeline issue.
#include <cstring>
#include <iostream>
#include <string>

#include "stages/run_command.h"
#include "stages/tokenize_command.h"

namespace {

constexpr const char* kUsage = R"(usage: moeline <command> [options]

commands:
  run          load a checkpoint and generate in this process (moeline run --help)
  tokenize     text on stdin -> token ids as a JSON array (moeline tokenize --help)
  detokenize   JSON array of token ids on stdin -> text (moeline detokenize --help)
  chat-template  JSON messages on stdin -> the model's chat prompt (moeline chat-template --help)
  version      print the version
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "help") == 0) {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  if (command == "run") return moeline::stages::run_command(argc - 2, argv + 2);
  if (command == "tokenize") return moeline::stages::tokenize_command(argc - 2, argv + 2);
  if (command == "chat-template") return moeline::stages::chat_template_command(argc - 2, argv + 2);
  if (command == "detokenize") return moeline::stages::detokenize_command(argc - 2, argv + 2);
  if (command == "version") {
    std::cout << "moeline 0.1.0\n";
    return 0;
  }
  std::cerr << "moeline: error: unknown command '" << command << "'\n" << kUsage;
  return 2;
}
