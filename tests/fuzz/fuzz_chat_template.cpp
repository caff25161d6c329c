// What a client controls on the way to the model: messages for the chat template (as the CLI and
// the HTTP front read them: a JSON array of {role, content}) and prompt text for the tokenizer,
// with the qwen3 chat template (of a generated model, kept here) and the demo model's tokenizer.
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {
const moeline::tokenizer::Tokenizer& demo_tokenizer() {
  static auto tokenizer =
      moeline::tokenizer::Tokenizer::load(std::string(MOELINE_DEMO_MODEL) + "/tokenizer.json");
  if (!tokenizer) std::abort();  // the harness's own setup, not input
  return *tokenizer;
}
const moeline::tokenizer::ChatTemplate& demo_template() {
  static auto chat = moeline::tokenizer::ChatTemplate::load(std::string(MOELINE_FUZZ_DIR) +
                                                            "/qwen3_tokenizer_config.json");
  if (!chat) std::abort();
  return *chat;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto ids = demo_tokenizer().encode(text, {})) (void)demo_tokenizer().decode(*ids, {});
  const nlohmann::json parsed = nlohmann::json::parse(text, nullptr, false);
  if (!parsed.is_array()) return 0;
  std::vector<moeline::tokenizer::ChatMessage> messages;
  for (const auto& m : parsed) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      return 0;
    messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  if (auto prompt = demo_template().render(messages)) (void)demo_tokenizer().encode(*prompt, {});
  return 0;
}
