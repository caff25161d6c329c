#pragma once
// Chat prompts: the model's own chat template (the Jinja `chat_template` of tokenizer_config.json)
// rendered by moeline's Jinja engine (tokenizer/jinja/) as transformers' apply_chat_template
// renders it, with messages, add_generation_prompt, bos_token, eos_token, enable_thinking and the
// request's other template variables (chat_template_kwargs);
// checked against Python's jinja2 and @huggingface/jinja on real models' templates (tests/parity).
// A template that uses something the engine does not support is an error naming the construct.
//
// A checkpoint without a chat template gets the built-in format of its family (from config.json's
// model_type), rendered by code of its own:
//
//   chatml      <|im_start|>role\ncontent<|im_end|>\n ...   (Qwen2 / Qwen2.5 style; no default
//                                                             system prompt is injected)
//   qwen3       ChatML plus Qwen3's thinking blocks: the final assistant turn gets
//               <think>...</think>, earlier ones lose theirs; enable_thinking=false adds an empty
//               one
//   deepseek_v3 BOS, system prompts joined by blank lines, <｜User｜>/<｜Assistant｜> turns
//   mistral     BOS, [INST] user [/INST] assistant EOS (system text starts the first user turn)

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace moeline::tokenizer::jinja {
class Template;
}

namespace moeline::tokenizer {

// A function call an assistant turn made (OpenAI's tool_calls entry).
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text, as OpenAI's API carries it
};

struct ChatMessage {
  std::string role;  // system, user, assistant (qwen3 and chatml also take tool)
  std::string content;
  std::vector<ToolCall> tool_calls;  // assistant: the calls it made
  std::string tool_call_id;          // tool: the call this message answers
  std::string name;                  // tool: the function's name, where given
  // assistant: the reasoning its answer began with (reasoning_content, as the server gave it
  // out), which Qwen3's templates put back in a <think> block for the turns after the last
  // user message.
  std::string reasoning_content;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  // vLLM's and transformers' continue_final_message: the chat ends inside the final message,
  // which the model continues (an assistant's answer begun for it, as Anthropic's prefill): it
  // is rendered without the generation prompt and cut after the final message's content. The
  // content must be non-empty and appear in the rendered chat (stripped of surrounding
  // whitespace if not as it is).
  bool continue_final_message = false;
  std::optional<bool> enable_thinking;  // qwen3 only; unset = the template's default
  // The tools a request offers: a JSON array of OpenAI tool definitions, as its body gave them
  // (empty: none). A Jinja template gets them as `tools`; the built-in formats refuse them.
  std::string tools_json;
  // The request's other variables for a Jinja template (chat_template_kwargs, as vLLM passes
  // them: DeepSeek-V3.1's `thinking`, gpt-oss's `reasoning_effort`, ...), a JSON object as text
  // (empty: none); the built-in formats have no variables and ignore them. None of them may be
  // one of the variables the renderer sets itself (reserved_template_variable).
  std::string template_kwargs_json;
};

// Whether `name` is a variable the renderer sets itself (messages, tools, add_generation_prompt,
// bos_token, eos_token, enable_thinking), which a request's chat_template_kwargs may not set.
bool reserved_template_variable(std::string_view name);

// How a chat template writes an assistant's tool calls, which is how the model was trained to
// write them (and so how the server reads them back from its output).
enum class ToolCallFormat {
  kNone,    // the template writes no tool calls
  kHermes,  // <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Qwen3)
  kGlm45,   // <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call> (GLM-4.5)
  kDeepSeek,  // <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁sep｜>... (DeepSeek V3, R1,
              // V3.1)
  kMistral,  // [TOOL_CALLS] [{"name": ..., "arguments": {...}}] or [TOOL_CALLS]name[ARGS]{...}
};
// "none", "hermes", "glm45", "deepseek", "mistral" (as the HTTP stage logs it).
const char* tool_call_format_name(ToolCallFormat format);

class ChatTemplate {
 public:
  enum class Format { kJinja, kChatML, kQwen3, kDeepSeekV3, kMistral };

  // Reads tokenizer_config.json: its bos/eos token strings, and its chat_template (a string, or a
  // list of named templates whose "default" is used, and "tool_use" for chats with tools) unless a
  // chat_template.jinja lies beside it, which wins as in transformers (newer releases, GLM-4.5's
  // among them, keep the template only there). Without either, the built-in format of the
  // model_type in the config.json beside it (qwen2_moe: chatml, qwen3_moe: qwen3, deepseek_v2/v3:
  // deepseek_v3, mixtral/mistral: mistral).
  static Expected<ChatTemplate> load(const std::string& tokenizer_config_path);
  // A Jinja template (parsed once; an unsupported construct is an error naming it).
  static Expected<ChatTemplate> from_template(const std::string& jinja_source,
                                              std::string bos_token, std::string eos_token);
  static ChatTemplate builtin(Format format, std::string bos_token, std::string eos_token);
  // Another Jinja template with this one's BOS and EOS (a template file given instead of the
  // checkpoint's own).
  Expected<ChatTemplate> with_source(const std::string& jinja_source) const {
    return from_template(jinja_source, bos_, eos_);
  }

  Expected<std::string> render(const std::vector<ChatMessage>& messages,
                               const ChatOptions& options = {}) const;
  Format format() const { return format_; }
  const char* format_name() const;
  // The format the template writes tool calls in (kNone for the built-in formats); the "tool_use"
  // template's, where the config names one (a chat that offers tools is rendered with it).
  ToolCallFormat tool_call_format() const {
    return tool_use_ ? tool_use_->tool_call_format_ : tool_call_format_;
  }
  // Whether the model thinks in <think> ... </think> blocks before it answers (the template
  // writes them: Qwen3, DeepSeek-R1, GLM-4.5), which the server then reads out of the answer.
  bool writes_reasoning() const { return writes_reasoning_; }

 private:
  ChatTemplate(Format format, std::string bos, std::string eos)
      : format_(format), bos_(std::move(bos)), eos_(std::move(eos)) {}
  Expected<std::string> render_jinja(const std::vector<ChatMessage>& messages,
                                     const ChatOptions& options) const;
  Format format_;
  std::shared_ptr<const jinja::Template> jinja_;  // kJinja
  ToolCallFormat tool_call_format_ = ToolCallFormat::kNone;
  std::shared_ptr<const ChatTemplate> tool_use_;  // a list's "tool_use" template, if it has one
  bool writes_reasoning_ = false;
  std::string bos_;
  std::string eos_;
};

}  // namespace moeline::tokenizer
