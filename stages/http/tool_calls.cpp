#include "stages/http/tool_calls.h"

#include <string_view>

#include <nlohmann/json.hpp>

#include "stages/http/openai.h"

namespace moeline::stages::http {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

bool blank(std::string_view text) {
  return text.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

// The length of the longest suffix of `text` that is a proper prefix of `marker`.
size_t partial_marker(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

}  // namespace

std::optional<ToolCallOutput> parse_hermes_tool_calls(const std::string& text) {
  const size_t first = text.find(kOpen);
  if (first == std::string::npos) return std::nullopt;
  ToolCallOutput out;
  out.content = text.substr(0, first);
  out.content.erase(out.content.find_last_not_of(" \t\r\n") + 1);
  size_t at = first;
  while (at != std::string::npos && at < text.size()) {
    if (text.compare(at, kOpen.size(), kOpen) != 0) {
      // Between calls only whitespace; anything else is not the format.
      if (!blank(std::string_view(text).substr(at))) return std::nullopt;
      break;
    }
    const size_t body = at + kOpen.size();
    size_t end = text.find(kClose, body);
    // A last call cut off before its closing tag (max_tokens, or an end token first) is still
    // read when its JSON is whole, as vLLM does.
    const std::string json_text = text.substr(body, end == std::string::npos ? end : end - body);
    const nlohmann::ordered_json call =
        nlohmann::ordered_json::parse(json_text, nullptr, /*allow_exceptions=*/false);
    if (!call.is_object() || !call.contains("name") || !call["name"].is_string())
      return std::nullopt;
    ToolCallOut parsed{random_id("call_"), call["name"].get<std::string>(), "{}"};
    if (call.contains("arguments")) {
      const auto& arguments = call["arguments"];
      parsed.arguments = arguments.is_string() ? arguments.get<std::string>() : arguments.dump();
    }
    out.calls.push_back(std::move(parsed));
    if (end == std::string::npos) break;
    at = end + kClose.size();
    at = text.find_first_not_of(" \t\r\n", at);
  }
  return out;
}

std::string ToolCallHold::feed(const std::string& delta) {
  if (in_call_) {
    held_ += delta;
    return {};
  }
  const std::string text = held_ + delta;
  if (const size_t open = text.find(kOpen); open != std::string::npos) {
    in_call_ = true;
    held_ = text.substr(open);
    return text.substr(0, open);
  }
  const size_t keep = partial_marker(text, kOpen);
  held_ = text.substr(text.size() - keep);
  return text.substr(0, text.size() - keep);
}

}  // namespace moeline::stages::http
