#include "cli/tokenize_command.h"

#include <cstring>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/suggest.h"
#include "model/model_text.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moeline::cli {
namespace {

constexpr const char* kTokenizeUsage = R"(usage: moeline tokenize --tokenizer PATH [--no-special]

Reads UTF-8 text on stdin and prints its token ids as one JSON array.

  --tokenizer PATH   tokenizer.json, a model folder that holds one, or a GGUF model
  --no-special       do not apply the post-processor (no BOS/EOS added); special-token strings
                     in the text are still recognised, as in the reference library
)";

constexpr const char* kDetokenizeUsage =
    R"(usage: moeline detokenize --tokenizer PATH [--skip-special]

Reads a JSON array of token ids on stdin and prints the decoded text.

  --tokenizer PATH   tokenizer.json, a model folder that holds one, or a GGUF model
  --skip-special     leave special tokens out of the text
)";

constexpr const char* kChatTemplateUsage =
    R"(usage: moeline chat-template --tokenizer PATH [--no-generation-prompt] [--no-thinking]

Reads a JSON array of messages ([{"role": "user", "content": "..."}, ...]; an assistant's may
carry "reasoning_content") on stdin and prints the prompt the model's chat template makes of them.

  --tokenizer PATH         tokenizer_config.json, a model folder that holds one, or a GGUF model
  --no-generation-prompt   do not end with the opening of the assistant's turn
  --no-thinking            Qwen3: enable_thinking=false (an empty thinking block)
)";

std::string resolve(const std::string& path, const char* file = "tokenizer.json") {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return (std::filesystem::path(path) / file).string();
  return path;
}

// A GGUF model's tokenizer is its metadata's (model/model_text.h).
moeline::Expected<tokenizer::Tokenizer> load_tokenizer(const std::string& path) {
  if (path.ends_with(".gguf")) return model::load_model_tokenizer(path);
  return tokenizer::Tokenizer::load(resolve(path));
}

struct Args {
  std::string tokenizer;
  bool flag = false;
  bool help = false;
};

// Parses --tokenizer and one boolean flag; returns false (after printing why) on a usage error.
bool parse(int argc, char** argv, const char* flag_name, const char* usage, Args& args) {
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      args.help = true;
    } else if (a == "--tokenizer" && i + 1 < argc) {
      args.tokenizer = argv[++i];
    } else if (a == flag_name) {
      args.flag = true;
    } else {
      std::cerr << usage << "moeline: error: unexpected argument '" << a << "'"
                << did_you_mean(a, flags_in(usage)) << '\n';
      return false;
    }
  }
  if (!args.help && args.tokenizer.empty()) {
    std::cerr << "moeline: error: --tokenizer PATH is required\n" << usage;
    return false;
  }
  return true;
}

// One `moeline: error:` line; exit status 1.
int fail(const std::string& message) {
  std::cerr << "moeline: error: " << message << "\n";
  return 1;
}

std::string read_stdin() {
  std::cin >> std::noskipws;
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

}  // namespace

int tokenize_command(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, "--no-special", kTokenizeUsage, args)) return 2;
  if (args.help) {
    std::cout << kTokenizeUsage;
    return 0;
  }
  auto tokenizer = load_tokenizer(args.tokenizer);
  if (!tokenizer.ok()) {
    return fail(tokenizer.error().message);
  }
  const std::string input = read_stdin();
  auto ids = tokenizer->encode(input, {.add_special_tokens = !args.flag});
  if (!ids.ok()) {
    return fail(ids.error().message);
  }
  std::string out = "[";
  for (std::size_t i = 0; i < ids->size(); ++i) {
    if (i) out += ',';
    out += std::to_string((*ids)[i]);
  }
  out += "]\n";
  std::cout << out;
  return 0;
}

int detokenize_command(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, "--skip-special", kDetokenizeUsage, args)) return 2;
  if (args.help) {
    std::cout << kDetokenizeUsage;
    return 0;
  }
  auto tokenizer = load_tokenizer(args.tokenizer);
  if (!tokenizer.ok()) {
    return fail(tokenizer.error().message);
  }
  std::vector<std::int32_t> ids;
  try {
    const auto parsed = nlohmann::json::parse(read_stdin());
    if (!parsed.is_array()) throw std::invalid_argument("expected a JSON array of token ids");
    for (const auto& v : parsed) {
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0 ||
          v.get<std::int64_t>() > INT32_MAX) {
        throw std::invalid_argument("expected non-negative integer token ids, got " + v.dump());
      }
      ids.push_back(v.get<std::int32_t>());
    }
  } catch (const std::exception& e) {
    return fail(std::string("stdin: ") + e.what());
  }
  auto text = tokenizer->decode(ids, {.skip_special_tokens = args.flag});
  if (!text.ok()) {
    return fail(text.error().message);
  }
  std::cout << *text;
  return 0;
}

int chat_template_command(int argc, char** argv) {
  std::string path;
  tokenizer::ChatOptions options;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << kChatTemplateUsage;
      return 0;
    }
    if (a == "--tokenizer" && i + 1 < argc) {
      path = argv[++i];
    } else if (a == "--no-generation-prompt") {
      options.add_generation_prompt = false;
    } else if (a == "--no-thinking") {
      options.enable_thinking = false;
    } else {
      std::cerr << kChatTemplateUsage << "moeline: error: unexpected argument '" << a << "'"
                << did_you_mean(a, flags_in(kChatTemplateUsage)) << '\n';
      return 2;
    }
  }
  if (path.empty()) {
    std::cerr << "moeline: error: --tokenizer PATH is required\n" << kChatTemplateUsage;
    return 2;
  }
  auto chat = path.ends_with(".gguf")
                  ? model::load_model_chat_template(path)
                  : tokenizer::ChatTemplate::load(resolve(path, "tokenizer_config.json"));
  if (!chat.ok()) {
    return fail(chat.error().message);
  }
  std::vector<tokenizer::ChatMessage> messages;
  try {
    const auto parsed = nlohmann::json::parse(read_stdin());
    if (!parsed.is_array()) throw std::invalid_argument("expected a JSON array of messages");
    for (const auto& m : parsed) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
          !m.contains("content") || !m["content"].is_string()) {
        throw std::invalid_argument("each message needs string \"role\" and \"content\", got " +
                                    m.dump());
      }
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
      tokenizer::ChatMessage& message = messages.back();
      // An answer's reasoning as the HTTP front gives it out (and takes it back).
      if (m.contains("reasoning_content") && m["reasoning_content"].is_string())
        message.reasoning_content = m["reasoning_content"].get<std::string>();
    }
  } catch (const std::exception& e) {
    return fail(std::string("stdin: ") + e.what());
  }
  auto text = chat->render(messages, options);
  if (!text.ok()) {
    return fail(text.error().message);
  }
  std::cout << *text;
  return 0;
}

}  // namespace moeline::cli
