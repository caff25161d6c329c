#include "tokenizer/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "tokenizer/jinja/template.h"

namespace moeline::tokenizer {

namespace {

bool contains(const std::string& s, const char* what) {
  return s.find(what) != std::string::npos;
}

// Python's str.strip/lstrip/rstrip with a set of characters.
std::string lstrip(const std::string& s, const char* chars) {
  const std::size_t b = s.find_first_not_of(chars);
  return b == std::string::npos ? std::string() : s.substr(b);
}
std::string rstrip(const std::string& s, const char* chars) {
  const std::size_t e = s.find_last_not_of(chars);
  return e == std::string::npos ? std::string() : s.substr(0, e + 1);
}
std::string strip(const std::string& s, const char* chars) {
  return lstrip(rstrip(s, chars), chars);
}

// s.split(sep)[-1] and s.split(sep)[0].
std::string after_last(const std::string& s, const std::string& sep) {
  const std::size_t at = s.rfind(sep);
  return at == std::string::npos ? s : s.substr(at + sep.size());
}
std::string before_first(const std::string& s, const std::string& sep) {
  const std::size_t at = s.find(sep);
  return at == std::string::npos ? s : s.substr(0, at);
}

bool starts_with(const std::string& s, const char* p) {
  return s.rfind(p, 0) == 0;
}
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

std::string token_string(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

Status check_roles(const std::vector<ChatMessage>& messages, bool allow_tool, const char* format) {
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r == "system" || r == "user" || r == "assistant" || (allow_tool && r == "tool")) continue;
    return Error{"messages[" + std::to_string(i) + "]: role \"" + r +
                 "\" is not supported by the " + format +
                 " chat format (use system, user or assistant" + (allow_tool ? ", tool" : "") +
                 ")"};
  }
  return {};
}

}  // namespace

const char* ChatTemplate::format_name() const {
  switch (format_) {
    case Format::kJinja:
      return "jinja";
    case Format::kChatML:
      return "chatml";
    case Format::kQwen3:
      return "qwen3";
    case Format::kDeepSeekV3:
      return "deepseek_v3";
    case Format::kMistral:
      return "mistral";
  }
  return "?";
}

const char* tool_call_format_name(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kNone:
      return "none";
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kGlm45:
      return "glm45";
    case ToolCallFormat::kDeepSeek:
      return "deepseek";
    case ToolCallFormat::kMistral:
      return "mistral";
  }
  return "?";
}

bool reserved_template_variable(std::string_view name) {
  for (const std::string_view reserved :
       {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "enable_thinking"})
    if (name == reserved) return true;
  return false;
}

Expected<ChatTemplate> ChatTemplate::from_template(const std::string& source, std::string bos,
                                                   std::string eos) {
  auto parsed = jinja::Template::parse(source);
  if (!parsed) return Error{"chat template: " + parsed.error().message};
  ChatTemplate chat(Format::kJinja, std::move(bos), std::move(eos));
  chat.jinja_ = std::make_shared<const jinja::Template>(std::move(*parsed));
  if (source.find("<tool_call>") != std::string::npos)
    chat.tool_call_format_ = source.find("<arg_key>") != std::string::npos
                                 ? ToolCallFormat::kGlm45
                                 : ToolCallFormat::kHermes;
  else if (source.find("tool▁calls▁begin") != std::string::npos)
    chat.tool_call_format_ = ToolCallFormat::kDeepSeek;
  else if (source.find("[TOOL_CALLS]") != std::string::npos)
    chat.tool_call_format_ = ToolCallFormat::kMistral;
  chat.writes_reasoning_ = source.find("</think>") != std::string::npos;
  return chat;
}

ChatTemplate ChatTemplate::builtin(Format format, std::string bos, std::string eos) {
  ChatTemplate chat(format, std::move(bos), std::move(eos));
  chat.writes_reasoning_ = format == Format::kQwen3;
  return chat;
}

Expected<std::string> ChatTemplate::render_jinja(const std::vector<ChatMessage>& messages,
                                                 const ChatOptions& options) const {
  using Json = nlohmann::ordered_json;
  Json context;
  Json list = Json::array();
  for (const ChatMessage& m : messages) {
    Json message = {{"role", m.role}, {"content", m.content}};
    if (!m.tool_calls.empty()) {
      // As vLLM passes them: arguments as the object they encode, where they are JSON (the
      // templates write them with tojson), the text as given otherwise. DeepSeek's templates add
      // them to strings with '+', which takes the text (as transformers passes the OpenAI
      // message through).
      Json calls = Json::array();
      for (const ToolCall& call : m.tool_calls) {
        Json arguments = tool_call_format_ == ToolCallFormat::kDeepSeek
                             ? Json(nlohmann::json::value_t::discarded)
                             : Json::parse(call.arguments, nullptr, /*allow_exceptions=*/false);
        if (arguments.is_discarded()) arguments = call.arguments;
        calls.push_back({{"id", call.id},
                         {"type", "function"},
                         {"function", {{"name", call.name}, {"arguments", std::move(arguments)}}}});
      }
      message["tool_calls"] = std::move(calls);
    }
    if (!m.tool_call_id.empty()) message["tool_call_id"] = m.tool_call_id;
    if (!m.name.empty()) message["name"] = m.name;
    if (!m.reasoning_content.empty()) message["reasoning_content"] = m.reasoning_content;
    list.push_back(std::move(message));
  }
  context["messages"] = std::move(list);
  if (!options.tools_json.empty()) {
    Json tools = Json::parse(options.tools_json, nullptr, /*allow_exceptions=*/false);
    if (!tools.is_array()) return Error{"chat template: tools must be a JSON array"};
    context["tools"] = std::move(tools);
  }
  if (!options.template_kwargs_json.empty()) {
    Json kwargs = Json::parse(options.template_kwargs_json, nullptr, /*allow_exceptions=*/false);
    if (!kwargs.is_object())
      return Error{"chat template: chat_template_kwargs must be a JSON object"};
    for (auto& [name, value] : kwargs.items())
      if (!reserved_template_variable(name)) context[name] = std::move(value);
  }
  context["add_generation_prompt"] = options.add_generation_prompt;
  context["bos_token"] = bos_;
  context["eos_token"] = eos_;
  if (options.enable_thinking) context["enable_thinking"] = *options.enable_thinking;
  auto rendered = jinja_->render(context);
  if (!rendered) return Error{"chat template: " + rendered.error().message};
  return std::move(*rendered);
}

Expected<ChatTemplate> ChatTemplate::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Error{path + ": cannot open (a chat template needs tokenizer_config.json)"};
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    return Error{path + ": not valid JSON (" + e.what() + ")"};
  }
  if (!config.is_object()) return Error{path + ": expected a JSON object"};
  std::string source;
  const auto jinja_path = std::filesystem::path(path).parent_path() / "chat_template.jinja";
  if (std::ifstream jinja_in(jinja_path); jinja_in) {
    source.assign(std::istreambuf_iterator<char>(jinja_in), std::istreambuf_iterator<char>());
    if (jinja_in.bad()) return Error{jinja_path.string() + ": cannot read"};
    auto t =
        from_template(source, token_string(config, "bos_token"), token_string(config, "eos_token"));
    if (!t.ok()) return Error{jinja_path.string() + ": " + t.error().message};
    return t;
  }
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
    // No template of its own: the built-in format of its family, if it is one moeline knows.
    const auto model_config = std::filesystem::path(path).parent_path() / "config.json";
    std::ifstream config_in(model_config);
    const nlohmann::json model = nlohmann::json::parse(config_in, nullptr, false);
    const std::string type =
        model.is_object() && model.contains("model_type") && model["model_type"].is_string()
            ? model["model_type"].get<std::string>()
            : "";
    const std::pair<const char*, Format> families[] = {
        {"qwen2_moe", Format::kChatML},       {"qwen3_moe", Format::kQwen3},
        {"deepseek_v2", Format::kDeepSeekV3}, {"deepseek_v3", Format::kDeepSeekV3},
        {"mixtral", Format::kMistral},        {"mistral", Format::kMistral}};
    for (const auto& [name, format] : families)
      if (type == name)
        return builtin(format, token_string(config, "bos_token"),
                       token_string(config, "eos_token"));
    return Error{path + ": has no chat_template (and model_type \"" + type +
                 "\" has no built-in chat format)"};
  }
  std::string tool_use;
  if (it->is_string()) {
    source = it->get<std::string>();
  } else if (it->is_array()) {
    for (const auto& entry : *it) {
      if (!entry.is_object() || !entry.contains("template") || !entry["template"].is_string())
        continue;
      const std::string name = entry.value("name", "");
      if (name == "default") source = entry["template"].get<std::string>();
      if (name == "tool_use") tool_use = entry["template"].get<std::string>();
    }
    if (source.empty()) return Error{path + ": chat_template list has no \"default\" entry"};
  } else {
    return Error{path + ": chat_template must be a string or a list of named templates"};
  }
  auto t =
      from_template(source, token_string(config, "bos_token"), token_string(config, "eos_token"));
  if (!t.ok()) return Error{path + ": " + t.error().message};
  if (!tool_use.empty()) {
    // transformers renders a chat that offers tools with the "tool_use" template where the list
    // has one (Mistral's and Cohere's releases keep their tool format only there).
    auto tools = from_template(tool_use, token_string(config, "bos_token"),
                               token_string(config, "eos_token"));
    if (!tools.ok()) return Error{path + ": the \"tool_use\" template: " + tools.error().message};
    t->tool_use_ = std::make_shared<const ChatTemplate>(std::move(*tools));
  }
  return t;
}

Expected<std::string> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                           const ChatOptions& options) const {
  if (messages.empty()) return Error{"a chat needs at least one message"};
  if (options.continue_final_message) {
    // As transformers does it: the whole chat rendered, then cut after the final message's
    // content (its last occurrence), whatever the template writes around it.
    const std::string& final_content = messages.back().content;
    if (strip(final_content, " \t\r\n").empty())
      return Error{"continue_final_message needs a final message with content to continue"};
    ChatOptions closed = options;
    closed.continue_final_message = false;
    closed.add_generation_prompt = false;
    auto rendered = render(messages, closed);
    if (!rendered) return rendered;
    for (const std::string& needle : {final_content, strip(final_content, " \t\r\n")}) {
      const size_t at = rendered->rfind(needle);
      if (at != std::string::npos) return rendered->substr(0, at + needle.size());
    }
    return Error{
        "continue_final_message: the final message's content does not appear in the chat the "
        "template renders"};
  }
  if (tool_use_ && !options.tools_json.empty()) return tool_use_->render(messages, options);
  if (format_ != Format::kJinja) {
    const bool calls = std::any_of(messages.begin(), messages.end(),
                                   [](const ChatMessage& m) { return !m.tool_calls.empty(); });
    if (!options.tools_json.empty() || calls)
      return Error{std::string("the built-in ") + format_name() +
                   " chat format does not write tools or tool calls (the model's "
                   "tokenizer_config.json needs a chat template that does)"};
  }
  std::string out;
  switch (format_) {
    case Format::kJinja:
      return render_jinja(messages, options);
    case Format::kChatML: {
      if (Status s = check_roles(messages, true, format_name()); !s.ok()) return s.error();
      for (const ChatMessage& m : messages) {
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      }
      if (options.add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    }
    case Format::kQwen3: {
      if (Status s = check_roles(messages, true, format_name()); !s.ok()) return s.error();
      const std::size_t n = messages.size();
      if (messages[0].role == "system") {
        out += "<|im_start|>system\n" + messages[0].content + "<|im_end|>\n";
      }
      // The last user turn that is not a wrapped tool response.
      std::size_t last_query = n - 1;
      for (std::size_t k = n; k-- > 0;) {
        const ChatMessage& m = messages[k];
        if (m.role == "user" && !(starts_with(m.content, "<tool_response>") &&
                                  ends_with(m.content, "</tool_response>"))) {
          last_query = k;
          break;
        }
      }
      for (std::size_t i = 0; i < n; ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user" || (m.role == "system" && i != 0)) {
          out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
        } else if (m.role == "assistant") {
          std::string content = m.content;
          // As Qwen3's template: the reasoning the message carries, or the block its content
          // begins with.
          std::string reasoning = m.reasoning_content;
          if (reasoning.empty() && contains(m.content, "</think>")) {
            content = lstrip(after_last(m.content, "</think>"), "\n");
            reasoning = lstrip(
                after_last(rstrip(before_first(m.content, "</think>"), "\n"), "<think>"), "\n");
          }
          if (i > last_query && (i + 1 == n || !reasoning.empty())) {
            out += "<|im_start|>assistant\n<think>\n" + strip(reasoning, "\n") + "\n</think>\n\n" +
                   lstrip(content, "\n");
          } else {
            out += "<|im_start|>assistant\n" + content;
          }
          out += "<|im_end|>\n";
        } else if (m.role == "tool") {
          if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
          out += "\n<tool_response>\n" + m.content + "\n</tool_response>";
          if (i + 1 == n || messages[i + 1].role != "tool") out += "<|im_end|>\n";
        }
      }
      if (options.add_generation_prompt) {
        out += "<|im_start|>assistant\n";
        if (options.enable_thinking.has_value() && !*options.enable_thinking) {
          out += "<think>\n\n</think>\n\n";
        }
      }
      break;
    }
    case Format::kDeepSeekV3: {
      if (Status s = check_roles(messages, false, format_name()); !s.ok()) return s.error();
      std::string system;
      bool first_system = true;
      for (const ChatMessage& m : messages) {
        if (m.role != "system") continue;
        system += (first_system ? "" : "\n\n") + m.content;
        first_system = false;
      }
      out += bos_ + system;
      for (const ChatMessage& m : messages) {
        if (m.role == "user") {
          out += "<\xEF\xBD\x9CUser\xEF\xBD\x9C>" + m.content;
        } else if (m.role == "assistant") {
          out +=
              "<\xEF\xBD\x9C"
              "Assistant\xEF\xBD\x9C>" +
              m.content +
              "<\xEF\xBD\x9C"
              "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
        }
      }
      if (options.add_generation_prompt)
        out +=
            "<\xEF\xBD\x9C"
            "Assistant\xEF\xBD\x9C>";
      break;
    }
    case Format::kMistral: {
      if (Status s = check_roles(messages, false, format_name()); !s.ok()) return s.error();
      std::size_t first = 0;
      std::string system;
      if (messages[0].role == "system") {
        system = messages[0].content;
        first = 1;
      }
      out += bos_;
      for (std::size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user") {
          if (i == first && !system.empty()) {
            out += "[INST] " + system + "\n\n" + m.content + " [/INST]";
          } else {
            out += "[INST] " + m.content + " [/INST]";
          }
        } else if (m.role == "assistant") {
          out += m.content + eos_;
        } else {
          return Error{"messages[" + std::to_string(i) +
                       "]: the mistral chat format takes a system message only first"};
        }
      }
      break;
    }
  }
  return out;
}

}  // namespace moeline::tokenizer
