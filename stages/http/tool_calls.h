#pragma once
// Tool calls read back from generated text, in the Hermes format that Qwen2.5 and Qwen3 are
// trained on (their chat templates write a call as one, and vLLM's "hermes" parser reads it):
//
//   optional text<tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call><tool_call>...</tool_call>
//
// The text before the first <tool_call> is the message's content. A block that is not a call
// (not JSON, no name) leaves the whole text as content, as vLLM's parser does.

#include <optional>
#include <string>
#include <vector>

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

// A streamed text with tools on offer: the content is written as it comes until a call may
// begin; from the first "<tool_call>" (or what could still become one at the end of the text so
// far) it is held back, and at the end parsed as calls or, if it is not one, written as text.
class ToolCallHold {
 public:
  // The part of `delta` that is certain to be content.
  std::string feed(const std::string& delta);
  // Everything held back (the calls' text, or an unfinished prefix of the marker).
  const std::string& held() const { return held_; }

 private:
  std::string held_;
  bool in_call_ = false;
};

}  // namespace moeline::stages::http
