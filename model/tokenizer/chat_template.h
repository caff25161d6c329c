#pragma once
// Chat prompts. moeline does not run Jinja: it recognises the chat template in
// tokenizer_config.json as one of the formats of the families it serves and renders that format
// with built-in code, checked against the real templates rendered by a Jinja engine
// (tests/parity/test_chat_template.py). An unrecognised template is an error, never a guess.
//
//   chatml      <|im_start|>role\ncontent<|im_end|>\n ...   (Qwen2 / Qwen2.5 style; no default
//                                                             system prompt is injected)
//   qwen3       ChatML plus Qwen3's thinking blocks: the final assistant turn gets
//               <think>...</think>, earlier ones lose theirs; enable_thinking=false adds an empty
//               one
//   deepseek_v3 BOS, system prompts joined by blank lines, <｜User｜>/<｜Assistant｜> turns
//   mistral     BOS, [INST] user [/INST] assistant EOS (system text starts the first user turn)

#include <optional>
#include <string>
#include <vector>

#include "model/status.h"

namespace moeline::model {

struct ChatMessage {
  std::string role;  // system, user, assistant (qwen3 and chatml also take tool)
  std::string content;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  std::optional<bool> enable_thinking;  // qwen3 only; unset = the template's default
};

class ChatTemplate {
 public:
  enum class Format { kChatML, kQwen3, kDeepSeekV3, kMistral };

  // Reads tokenizer_config.json: its chat_template (a string, or a list of named templates whose
  // "default" is used) and its bos/eos token strings.
  static Expected<ChatTemplate> load(const std::string& tokenizer_config_path);
  static Expected<ChatTemplate> from_template(const std::string& jinja_source,
                                              std::string bos_token, std::string eos_token);

  Expected<std::string> render(const std::vector<ChatMessage>& messages,
                               const ChatOptions& options = {}) const;
  Format format() const { return format_; }
  const char* format_name() const;

 private:
  ChatTemplate(Format format, std::string bos, std::string eos)
      : format_(format), bos_(std::move(bos)), eos_(std::move(eos)) {}
  Format format_;
  std::string bos_;
  std::string eos_;
};

}  // namespace moeline::model
