#pragma once
// Tool calls read back from generated text, in the format the model's chat template writes them
// (tokenizer::ToolCallFormat), as vLLM's "hermes" and "glm45" parsers read them:
//
//   Hermes (Qwen2.5, Qwen3):  optional text<tool_call>
//                             {"name": "get_weather", "arguments": {"city": "Paris"}}
//                             </tool_call><tool_call>...</tool_call>
//   GLM-4.5:                  optional text<tool_call>get_weather
//                             <arg_key>city</arg_key>
//                             <arg_value>Paris</arg_value>
//                             </tool_call><tool_call>...</tool_call>
//
// The text before the first <tool_call> is the message's content. A block that is not a call
// (not JSON, no name) leaves the whole text as content, as vLLM's parsers do.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/chat_template.h"

namespace moeline::stages::http {

struct ToolCallOut {
  std::string id;  // call_ and 24 hex digits
  std::string name;
  std::string arguments;  // JSON text of the arguments object
};

struct ToolCallOutput {
  std::string content;  // the text before the first call (trailing whitespace dropped)
  std::vector<ToolCallOut> calls;
};

// The calls in `text`; nullopt when it has none, or a block that is not a call.
std::optional<ToolCallOutput> parse_hermes_tool_calls(const std::string& text);
// DeepSeek's calls in `text`: V3 and R1's <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME then the
// arguments in a ```json fence, and V3.1's <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS, each
// ended by <｜tool▁call▁end｜>, all inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>.
std::optional<ToolCallOutput> parse_deepseek_tool_calls(const std::string& text);
// Mistral's calls in `text`: [TOOL_CALLS] then a JSON list of {"name", "arguments"} (v3
// tokenizers: Mixtral 8x22B), or [TOOL_CALLS]NAME[ARGS]{...} once per call (v11 and later). Their
// ids are nine letters and digits, the only ids Mistral's templates take back.
std::optional<ToolCallOutput> parse_mistral_tool_calls(const std::string& text);
// GLM-4.5's calls in `text`. Its values are text; `tools_json` (the request's tools) says which
// are strings: a parameter its schema types "string" stays text, any other value is read as JSON
// where it is JSON (3, true, [1, 2], {"a": 1}) and stays text where it is not.
std::optional<ToolCallOutput> parse_glm45_tool_calls(const std::string& text,
                                                     const std::string& tools_json);
// A forced call decoded as the bare document {"name": ..., "arguments": {...}} (with surrounding
// whitespace), its id as `format`'s calls have them; nullopt for any other text.
std::optional<ToolCallOutput> parse_forced_call(const std::string& text,
                                                tokenizer::ToolCallFormat format);
// The calls in `text` in the template's `format` (none for kNone), or with `bare_json` the one
// call of a forced call's bare document (forces_bare_json_call); with `parallel` false only the
// first (OpenAI's parallel_tool_calls: false).
std::optional<ToolCallOutput> parse_tool_calls(const std::string& text,
                                               tokenizer::ToolCallFormat format,
                                               const std::string& tools_json, bool parallel = true,
                                               bool bare_json = false);

// A forced call's document, as a JSON Schema (text): {"name": one of the tools' names (only
// `function` where it is given), "arguments": that tool's parameters (an object where it has
// none)}, one alternative per tool, the properties in that order as Hermes calls write them.
std::string forced_call_schema(const std::string& tools_json, const std::string& function);

// The text that opens a format's calls ("<tool_call>", "<｜tool▁calls▁begin｜>", "[TOOL_CALLS]";
// empty for kNone).
std::string_view tool_call_marker(tokenizer::ToolCallFormat format);

// A streamed text with tools on offer: the content is written as it comes until a call may
// begin; from the format's first marker (or what could still become one at the end of the text
// so far) it is held back, and at the end parsed as calls or, if it is not one, written as text.
// With an empty marker (a forced call's bare document) all of it is held.
class ToolCallHold {
 public:
  explicit ToolCallHold(std::string_view marker = "<tool_call>") : marker_(marker) {}
  // The part of `delta` that is certain to be content.
  std::string feed(const std::string& delta);
  // Everything held back (the calls' text, or an unfinished prefix of the marker).
  const std::string& held() const { return held_; }

 private:
  std::string marker_;
  std::string held_;
  bool in_call_ = false;
};

}  // namespace moeline::stages::http
