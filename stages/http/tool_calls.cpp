#include "stages/http/tool_calls.h"

#include <string_view>

#include <nlohmann/json.hpp>

#include "stages/http/markers.h"
#include "stages/http/openai.h"

namespace moeline::stages::http {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";
// DeepSeek's markers (U+FF5C fullwidth bars, U+2581 lower blocks), as its tokenizer spells them.
constexpr std::string_view kDeepSeekCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kDeepSeekCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDeepSeekCallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kDeepSeekCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kDeepSeekSep = "<｜tool▁sep｜>";
constexpr std::string_view kMistralCalls = "[TOOL_CALLS]";
constexpr std::string_view kMistralArgs = "[ARGS]";
constexpr std::string_view kMistralCallId = "[CALL_ID]";
constexpr std::string_view kKeyOpen = "<arg_key>", kKeyClose = "</arg_key>";
constexpr std::string_view kValueOpen = "<arg_value>", kValueClose = "</arg_value>";

bool blank(std::string_view text) {
  return text.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

// Writing JSON back (dump) recurses once per level: generated text that nests deeper than any
// tool's arguments would is left as text rather than risk the stack.
constexpr int kMaxNesting = 64;

// Whether the brackets of `text` (outside its strings) nest at most kMaxNesting deep.
bool shallow(std::string_view text) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxNesting) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

std::string_view trimmed(std::string_view text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(" \t\r\n") - first + 1);
}

// The text before the calls that begin at `at`, without its trailing whitespace.
std::string content_before(const std::string& text, size_t at) {
  std::string content = text.substr(0, at);
  content.erase(content.find_last_not_of(" \t\r\n") + 1);
  return content;
}

// Each block of `text` (from its first <tool_call>), read by `read_call(body, closed)`; the
// content before it.
template <typename ReadCall>
std::optional<ToolCallOutput> parse_blocks(const std::string& text, ReadCall read_call) {
  const size_t first = text.find(kOpen);
  if (first == std::string::npos) return std::nullopt;
  ToolCallOutput out;
  out.content = content_before(text, first);
  size_t at = first;
  while (at != std::string::npos && at < text.size()) {
    if (text.compare(at, kOpen.size(), kOpen) != 0) {
      // Between calls only whitespace; anything else is not the format.
      if (!blank(std::string_view(text).substr(at))) return std::nullopt;
      break;
    }
    const size_t body = at + kOpen.size();
    size_t end = text.find(kClose, body);
    std::optional<ToolCallOut> call =
        read_call(std::string_view(text).substr(
                      body, end == std::string::npos ? std::string::npos : end - body),
                  end != std::string::npos);
    if (!call) return std::nullopt;
    out.calls.push_back(std::move(*call));
    if (end == std::string::npos) break;
    at = end + kClose.size();
    at = text.find_first_not_of(" \t\r\n", at);
  }
  return out;
}

// The JSON type the request's tools give parameter `key` of function `name` ("" when unsaid).
std::string parameter_type(const nlohmann::json& tools, const std::string& name,
                           const std::string& key) {
  if (!tools.is_array()) return "";
  for (const auto& tool : tools) {
    const auto& function = tool.is_object() && tool.contains("function") ? tool["function"] : tool;
    if (!function.is_object() || function.value("name", "") != name) continue;
    const auto& parameters = function.value("parameters", nlohmann::json::object());
    if (!parameters.is_object() || !parameters.contains("properties") ||
        !parameters["properties"].is_object() || !parameters["properties"].contains(key))
      return "";
    const auto& property = parameters["properties"][key];
    return property.is_object() && property.contains("type") && property["type"].is_string()
               ? property["type"].get<std::string>()
               : "";
  }
  return "";
}

}  // namespace

std::optional<ToolCallOutput> parse_glm45_tool_calls(const std::string& text,
                                                     const std::string& tools_json) {
  const auto tools = nlohmann::json::parse(tools_json, nullptr, /*allow_exceptions=*/false);
  return parse_blocks(text, [&](std::string_view body, bool closed) -> std::optional<ToolCallOut> {
    // A block cut off before its closing tag (max_tokens) may have lost arguments, or part of its
    // name: not a call, as vLLM's glm45 parser reads it.
    if (!closed) return std::nullopt;
    const size_t first_key = body.find(kKeyOpen);
    const std::string name(trimmed(body.substr(0, first_key)));
    if (name.empty() || name.find_first_of("<>\n") != std::string::npos) return std::nullopt;
    nlohmann::ordered_json arguments = nlohmann::ordered_json::object();
    size_t at = first_key;
    while (at != std::string_view::npos) {
      // <arg_key>K</arg_key> (whitespace) <arg_value>V</arg_value>, then whitespace or the next.
      const size_t key_end = body.find(kKeyClose, at);
      if (key_end == std::string_view::npos) return std::nullopt;
      const std::string key(
          trimmed(body.substr(at + kKeyOpen.size(), key_end - at - kKeyOpen.size())));
      size_t value_at = body.find_first_not_of(" \t\r\n", key_end + kKeyClose.size());
      if (value_at == std::string_view::npos ||
          body.compare(value_at, kValueOpen.size(), kValueOpen) != 0)
        return std::nullopt;
      value_at += kValueOpen.size();
      const size_t value_end = body.find(kValueClose, value_at);
      if (value_end == std::string_view::npos) return std::nullopt;
      const std::string value(trimmed(body.substr(value_at, value_end - value_at)));
      const auto parsed = parameter_type(tools, name, key) == "string" || !shallow(value)
                              ? nlohmann::ordered_json(nlohmann::json::value_t::discarded)
                              : nlohmann::ordered_json::parse(value, nullptr, false);
      arguments[key] = parsed.is_discarded() ? nlohmann::ordered_json(value) : parsed;
      at = body.find_first_not_of(" \t\r\n", value_end + kValueClose.size());
      if (at != std::string_view::npos && body.compare(at, kKeyOpen.size(), kKeyOpen) != 0)
        return std::nullopt;
    }
    // A model's text is not always valid UTF-8 (a byte token alone): replaced, as in every other
    // text of a response, rather than thrown on.
    return ToolCallOut{random_id("call_"), name,
                       arguments.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)};
  });
}

namespace {

// A call's arguments as the JSON text of an object: `value` where it is an object, the object a
// string holds where it holds one; nullopt otherwise.
std::optional<std::string> arguments_text(const nlohmann::ordered_json& value) {
  if (value.is_object())
    return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (!value.is_string()) return std::nullopt;
  const std::string& text = value.get_ref<const std::string&>();
  if (!shallow(text)) return std::nullopt;
  const auto parsed = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object()) return std::nullopt;
  return parsed.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::optional<std::string> arguments_text(std::string_view text) {
  if (!shallow(text)) return std::nullopt;
  const auto parsed = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return std::nullopt;
  return arguments_text(parsed);
}

// A name as models write it: one line, no markup.
bool plausible_name(std::string_view name) {
  return !name.empty() && name.find_first_of("<>[]{}\n\r\t ") == std::string_view::npos;
}

// Mistral's call ids: nine letters and digits (its templates refuse any other id when the call
// comes back in the next turn).
std::string mistral_call_id() {
  return random_id("", 9, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789");
}

// A call written as the JSON object {"name": ..., "arguments": {...} or its text} (arguments
// optional), with id `id`; nullopt for any other value.
std::optional<ToolCallOut> call_from_object(const nlohmann::ordered_json& call, std::string id) {
  if (!call.is_object() || !call.contains("name") || !call["name"].is_string()) return std::nullopt;
  std::optional<std::string> arguments = std::string("{}");
  if (call.contains("arguments")) arguments = arguments_text(call["arguments"]);
  if (!arguments) return std::nullopt;
  return ToolCallOut{std::move(id), call["name"].get<std::string>(), std::move(*arguments)};
}

}  // namespace

std::optional<ToolCallOutput> parse_deepseek_tool_calls(const std::string& text) {
  const size_t first = text.find(kDeepSeekCallsBegin);
  if (first == std::string::npos) return std::nullopt;
  ToolCallOutput out;
  out.content = content_before(text, first);
  const std::string_view all(text);
  size_t at = all.find_first_not_of(" \t\r\n", first + kDeepSeekCallsBegin.size());
  while (at != std::string_view::npos &&
         all.compare(at, kDeepSeekCallBegin.size(), kDeepSeekCallBegin) == 0) {
    // A call cut off before its end marker (max_tokens) may have lost arguments: not a call, as
    // vLLM's deepseek_v3 parser reads it.
    const size_t body = at + kDeepSeekCallBegin.size();
    const size_t end = all.find(kDeepSeekCallEnd, body);
    if (end == std::string_view::npos) return std::nullopt;
    const std::string_view call = all.substr(body, end - body);
    const size_t sep = call.find(kDeepSeekSep);
    if (sep == std::string_view::npos) return std::nullopt;
    const std::string_view head = trimmed(call.substr(0, sep));
    const std::string_view tail = call.substr(sep + kDeepSeekSep.size());
    ToolCallOut parsed{random_id("call_"), "", ""};
    std::optional<std::string> arguments;
    if (const size_t fence = tail.find("```json"); fence != std::string_view::npos) {
      // V3 and R1: TYPE<sep>NAME\n```json\nARGUMENTS\n```
      parsed.name = std::string(trimmed(tail.substr(0, fence)));
      std::string_view json = tail.substr(fence + 7);
      const size_t close = json.rfind("```");
      if (close == std::string_view::npos) return std::nullopt;
      arguments = arguments_text(trimmed(json.substr(0, close)));
    } else {
      // V3.1: NAME<sep>ARGUMENTS
      parsed.name = std::string(head);
      arguments = arguments_text(trimmed(tail));
    }
    if (!plausible_name(parsed.name) || !arguments) return std::nullopt;
    parsed.arguments = std::move(*arguments);
    out.calls.push_back(std::move(parsed));
    at = all.find_first_not_of(" \t\r\n", end + kDeepSeekCallEnd.size());
  }
  if (out.calls.empty()) return std::nullopt;
  // Then the end marker, or nothing (an end of sequence may come first); nothing else.
  if (at != std::string_view::npos) {
    if (all.compare(at, kDeepSeekCallsEnd.size(), kDeepSeekCallsEnd) != 0) return std::nullopt;
    if (!blank(all.substr(at + kDeepSeekCallsEnd.size()))) return std::nullopt;
  }
  return out;
}

std::optional<ToolCallOutput> parse_mistral_tool_calls(const std::string& text) {
  const size_t first = text.find(kMistralCalls);
  if (first == std::string::npos) return std::nullopt;
  ToolCallOutput out;
  out.content = content_before(text, first);
  const std::string_view all(text);
  const std::string_view rest = trimmed(all.substr(first + kMistralCalls.size()));
  if (!rest.empty() && (rest.front() == '[' || rest.front() == '{')) {
    // v3 tokenizers (Mixtral 8x22B, Mistral 7B v0.3): [TOOL_CALLS] [{"name": ..., "arguments":
    // {...}}, ...], or a single object.
    if (!shallow(rest)) return std::nullopt;
    auto calls = nlohmann::ordered_json::parse(rest, nullptr, /*allow_exceptions=*/false);
    if (calls.is_object()) calls = nlohmann::ordered_json::array({calls});
    if (!calls.is_array() || calls.empty()) return std::nullopt;
    for (const auto& call : calls) {
      auto parsed = call_from_object(call, mistral_call_id());
      if (!parsed) return std::nullopt;
      out.calls.push_back(std::move(*parsed));
    }
    return out;
  }
  // v11 and later: [TOOL_CALLS]NAME[ARGS]{...} (a [CALL_ID]ID between them in some), once per
  // call.
  size_t at = first;
  while (at != std::string_view::npos) {
    const size_t body = at + kMistralCalls.size();
    const size_t next = all.find(kMistralCalls, body);
    const std::string_view call =
        all.substr(body, next == std::string_view::npos ? std::string_view::npos : next - body);
    const size_t args = call.find(kMistralArgs);
    if (args == std::string_view::npos) return std::nullopt;
    std::string_view name = call.substr(0, args);
    if (const size_t id = name.find(kMistralCallId); id != std::string_view::npos)
      name = name.substr(0, id);
    name = trimmed(name);
    auto arguments = arguments_text(trimmed(call.substr(args + kMistralArgs.size())));
    if (!plausible_name(name) || !arguments) return std::nullopt;
    out.calls.push_back({mistral_call_id(), std::string(name), std::move(*arguments)});
    at = next;
  }
  return out;
}

std::optional<ToolCallOutput> parse_forced_call(const std::string& text,
                                                tokenizer::ToolCallFormat format) {
  const std::string_view document = trimmed(text);
  if (!shallow(document)) return std::nullopt;
  auto call = call_from_object(
      nlohmann::ordered_json::parse(document, nullptr, /*allow_exceptions=*/false),
      format == tokenizer::ToolCallFormat::kMistral ? mistral_call_id() : random_id("call_"));
  if (!call) return std::nullopt;
  ToolCallOutput out;
  out.calls.push_back(std::move(*call));
  return out;
}

std::string_view tool_call_marker(tokenizer::ToolCallFormat format) {
  switch (format) {
    case tokenizer::ToolCallFormat::kHermes:
    case tokenizer::ToolCallFormat::kGlm45:
      return kOpen;
    case tokenizer::ToolCallFormat::kDeepSeek:
      return kDeepSeekCallsBegin;
    case tokenizer::ToolCallFormat::kMistral:
      return kMistralCalls;
    case tokenizer::ToolCallFormat::kNone:
      break;
  }
  return {};
}

std::optional<ToolCallOutput> parse_tool_calls(const std::string& text,
                                               tokenizer::ToolCallFormat format,
                                               const std::string& tools_json, bool parallel,
                                               bool bare_json) {
  if (bare_json) return parse_forced_call(text, format);
  std::optional<ToolCallOutput> parsed;
  switch (format) {
    case tokenizer::ToolCallFormat::kHermes:
      parsed = parse_hermes_tool_calls(text);
      break;
    case tokenizer::ToolCallFormat::kGlm45:
      parsed = parse_glm45_tool_calls(text, tools_json);
      break;
    case tokenizer::ToolCallFormat::kDeepSeek:
      parsed = parse_deepseek_tool_calls(text);
      break;
    case tokenizer::ToolCallFormat::kMistral:
      parsed = parse_mistral_tool_calls(text);
      break;
    case tokenizer::ToolCallFormat::kNone:
      break;
  }
  if (parsed && !parallel && parsed->calls.size() > 1) parsed->calls.resize(1);
  return parsed;
}

std::optional<ToolCallOutput> parse_hermes_tool_calls(const std::string& text) {
  // A last call cut off before its closing tag (max_tokens, or an end token first) is still read
  // when its JSON is whole, as vLLM's hermes parser does.
  return parse_blocks(text, [](std::string_view body, bool) -> std::optional<ToolCallOut> {
    if (!shallow(body)) return std::nullopt;
    const nlohmann::ordered_json call =
        nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (!call.is_object() || !call.contains("name") || !call["name"].is_string())
      return std::nullopt;
    ToolCallOut parsed{random_id("call_"), call["name"].get<std::string>(), "{}"};
    if (call.contains("arguments")) {
      const auto& arguments = call["arguments"];
      parsed.arguments = arguments.is_string() ? arguments.get<std::string>() : arguments.dump();
    }
    return parsed;
  });
}

std::string ToolCallHold::feed(const std::string& delta) {
  if (in_call_) {
    held_ += delta;
    return {};
  }
  const std::string text = held_ + delta;
  if (const size_t open = text.find(marker_); open != std::string::npos) {
    in_call_ = true;
    held_ = text.substr(open);
    return text.substr(0, open);
  }
  const size_t keep = partial_marker(text, marker_);
  held_ = text.substr(text.size() - keep);
  return text.substr(0, text.size() - keep);
}

namespace {

using ordered = nlohmann::ordered_json;

// A tool's parameters inside the call's schema: its own "#" and "#/$defs/NAME" (or
// "#/definitions/NAME") references become references to `prefix` and `prefix`_NAME in the call
// schema's $defs, where its definitions move. True if it has any.
bool move_references(ordered& schema, const std::string& prefix) {
  bool found = false;
  if (schema.is_object()) {
    if (auto ref = schema.find("$ref"); ref != schema.end() && ref->is_string()) {
      const std::string target = ref->get<std::string>();
      found = true;
      if (target == "#") {
        *ref = "#/$defs/" + prefix;
      } else {
        for (const char* from : {"#/$defs/", "#/definitions/"})
          if (target.rfind(from, 0) == 0)
            *ref = "#/$defs/" + prefix + "_" + target.substr(std::string_view(from).size());
      }
    }
    for (auto& [key, value] : schema.items()) found = move_references(value, prefix) || found;
  } else if (schema.is_array()) {
    for (ordered& value : schema) found = move_references(value, prefix) || found;
  }
  return found;
}

}  // namespace

std::string forced_call_schema(const std::string& tools_json, const std::string& function) {
  const ordered tools = ordered::parse(tools_json, nullptr, /*allow_exceptions=*/false);
  ordered alternatives = ordered::array();
  ordered definitions = ordered::object();
  size_t index = 0;
  for (const ordered& tool : tools.is_array() ? tools : ordered::array()) {
    const ordered& spec = tool["function"];
    const std::string name = spec["name"].get<std::string>();
    const std::string prefix = "tool" + std::to_string(index++);
    if (!function.empty() && name != function) continue;
    ordered parameters = spec.contains("parameters") && spec["parameters"].is_object()
                             ? spec["parameters"]
                             : ordered{{"type", "object"}};
    // The tool's own definitions and references, moved under the call schema's $defs.
    ordered own = ordered::object();
    for (const char* key : {"$defs", "definitions"}) {
      if (parameters.contains(key) && parameters[key].is_object())
        for (auto& [def, body] : parameters[key].items()) own[prefix + "_" + def] = body;
      parameters.erase(key);
    }
    bool referenced = move_references(parameters, prefix);
    for (auto& [def, body] : own.items()) referenced = move_references(body, prefix) || referenced;
    ordered arguments = parameters;
    if (referenced || !own.empty()) {
      for (auto& [def, body] : own.items()) definitions[def] = body;
      definitions[prefix] = parameters;
      arguments = {{"$ref", "#/$defs/" + prefix}};
    }
    ordered call = {{"type", "object"},
                    {"properties", {{"name", {{"const", name}}}, {"arguments", arguments}}},
                    {"required", {"name", "arguments"}}};
    alternatives.push_back(std::move(call));
  }
  ordered schema = alternatives.size() == 1 ? alternatives[0] : ordered{{"anyOf", alternatives}};
  if (!definitions.empty()) schema["$defs"] = definitions;
  return schema.dump();
}

}  // namespace moeline::stages::http
