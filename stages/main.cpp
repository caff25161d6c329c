// `moeline <command>`: one executable for every role: the stage processes, the stack supervisor,
// the load generator and the tools; every command parses --key value and --key=value alike.
#include <cstring>
#include <iostream>
#include <string>

#include "cli/client_command.h"
#include "cli/experts_command.h"
#include "cli/gguf_command.h"
#include "cli/keys_command.h"
#include "cli/perplexity_command.h"
#include "cli/quantize_command.h"
#include "cli/run_command.h"
#include "cli/signature_command.h"
#include "cli/tokenize_command.h"
#include "stages/decode/decode.h"
#include "stages/gateway/gateway.h"
#include "stages/http/http_front.h"
#include "stages/load/load.h"
#include "stages/offload_manager/offload_manager.h"
#include "stages/prefill/prefill.h"
#include "stages/probe/probe.h"
#include "stages/stack/stack.h"

namespace {

constexpr const char* kUsage = R"(usage: moeline <command> [options]

commands:
  run          load a checkpoint and generate in this process (moeline run --help)
  tokenize     text on stdin -> token ids as a JSON array (moeline tokenize --help)
  detokenize   JSON array of token ids on stdin -> text (moeline detokenize --help)
  chat-template  JSON messages on stdin -> the model's chat prompt (moeline chat-template --help)
  stack        start, inspect, stop a local stack (moeline stack --help)
  client       talk to a stack: generate, status (moeline client --help)
  load         load generator for the stack or one stage (moeline load --help)
  signature    activation signatures of prompts, JSON lines in and out (moeline signature --help)
  experts      router health heat map of a stack; replay expert traces (moeline experts --help)
  keys         stage keys (CurveZMQ) and client API keys (moeline keys --help)
  gguf         what a GGUF file holds; a tensor dequantized to .npy (moeline gguf --help)
  perplexity   a model's perplexity on a text, as llama.cpp measures it (moeline perplexity --help)
  quantize     a checkpoint written as a (quantized) GGUF file (moeline quantize --help)
  version      print the version (also --version)

stage processes (each: moeline <stage> --help):
  gateway      client endpoint, tokenizer, request tracking; the hub the stages connect to
  probe        reuse lookup for every job
  prefill      batched prefill, first token, KV handoff
  decode       continuous batching decode
  offload      expert residency and usage (offload manager)
  http         the OpenAI-compatible HTTP API, a client of the gateway
)";

}  // namespace

namespace {

// Every command takes `--key value` and `--key=value` alike: the second is split here, once,
// before any command's parser sees it ("--prompt=--x=1" keeps "--x=1" as the value).
std::vector<std::string> split_key_values(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const bool flag_name = arg.size() > 3 && arg.compare(0, 2, "--") == 0 &&
                           eq != std::string::npos && eq > 2 &&
                           arg.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-", 2) == eq;
    if (i > 0 && flag_name) {
      args.push_back(arg.substr(0, eq));
      args.push_back(arg.substr(eq + 1));
    } else {
      args.push_back(arg);
    }
  }
  return args;
}

}  // namespace

int main(int raw_argc, char** raw_argv) {
  std::vector<std::string> args = split_key_values(raw_argc, raw_argv);
  std::vector<char*> pointers;
  for (std::string& arg : args) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  const int argc = static_cast<int>(args.size());
  char** argv = pointers.data();
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "help") == 0) {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  if (std::strcmp(argv[1], "--version") == 0 || std::strcmp(argv[1], "version") == 0) {
    std::cout << "moeline " << MOELINE_VERSION << '\n';
    return 0;
  }
  const std::string command = argv[1];
  if (command == "run") return moeline::cli::run_command(argc - 2, argv + 2);
  if (command == "tokenize") return moeline::cli::tokenize_command(argc - 2, argv + 2);
  if (command == "chat-template") return moeline::cli::chat_template_command(argc - 2, argv + 2);
  if (command == "detokenize") return moeline::cli::detokenize_command(argc - 2, argv + 2);
  if (command == "keys") return moeline::cli::keys_command(argc - 2, argv + 2);
  if (command == "gguf") return moeline::cli::gguf_command(argc - 2, argv + 2);
  if (command == "perplexity") return moeline::cli::perplexity_command(argc - 2, argv + 2);
  if (command == "quantize") return moeline::cli::quantize_command(argc - 2, argv + 2);
  if (command == "stack") return moeline::stages::stack_command(argc - 2, argv + 2);
  if (command == "client") return moeline::cli::client_command(argc - 2, argv + 2);
  if (command == "signature") return moeline::cli::signature_command(argc - 2, argv + 2);
  if (command == "load") return moeline::stages::load_command(argc - 2, argv + 2);
  if (command == "experts") return moeline::cli::experts_command(argc - 2, argv + 2);
  if (command == "gateway") return moeline::stages::gateway_main(argc - 2, argv + 2);
  if (command == "probe") return moeline::stages::probe_main(argc - 2, argv + 2);
  if (command == "prefill") return moeline::stages::prefill_main(argc - 2, argv + 2);
  if (command == "decode") return moeline::stages::decode_main(argc - 2, argv + 2);
  if (command == "offload") return moeline::stages::offload_main(argc - 2, argv + 2);
  if (command == "http") return moeline::stages::http_main(argc - 2, argv + 2);
  std::cerr << kUsage << "moeline: error: unknown command '" << command << "'\n";
  return 2;
}
