#include "stages/http/messages.h"

#include <cctype>
#include <string_view>
#include <utility>

namespace moeline::stages::http {
namespace {

using json = nlohmann::json;

std::string at(const std::string& where, size_t index) {
  return where + "[" + std::to_string(index) + "]";
}

// A block's "type" (empty where it has none or is no object).
std::string block_type(const json& block) {
  return block.is_object() && block.contains("type") && block["type"].is_string()
             ? block["type"].get<std::string>()
             : std::string();
}

std::optional<ApiError> need_string(const json& object, const char* key, const std::string& where) {
  if (!object.contains(key) || !object[key].is_string())
    return invalid_field(where + "." + key, std::string("'") + key + "' must be a string");
  return std::nullopt;
}

// Text blocks joined (system prompts and tool results may be strings or lists of text blocks);
// any other block is refused rather than dropped.
std::variant<std::string, ApiError> text_of(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    return invalid_field(where, "'" + where + "' must be a string or a list of content blocks");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string type = block_type(content[i]);
    if (type != "text")
      return unsupported_field(at(where, i), "a content block of type '" + type + "' here");
    if (auto error = need_string(content[i], "text", at(where, i))) return *error;
    text += content[i]["text"].get<std::string>();
  }
  return text;
}

// A user turn's blocks: its text as a user message, each tool_result as a tool message, in the
// order they come (Anthropic puts the results first).
std::optional<ApiError> add_user_blocks(const json& blocks, const std::string& where,
                                        json& messages) {
  std::string text;
  bool has_text = false;
  const auto flush = [&] {
    if (has_text) messages.push_back({{"role", "user"}, {"content", text}});
    text.clear();
    has_text = false;
  };
  for (size_t i = 0; i < blocks.size(); ++i) {
    const json& block = blocks[i];
    const std::string type = block_type(block);
    if (type == "text") {
      if (auto error = need_string(block, "text", at(where, i))) return *error;
      text += block["text"].get<std::string>();
      has_text = true;
    } else if (type == "tool_result") {
      if (auto error = need_string(block, "tool_use_id", at(where, i))) return *error;
      std::string result;
      if (block.contains("content") && !block["content"].is_null()) {
        auto content = text_of(block["content"], at(where, i) + ".content");
        if (auto* error = std::get_if<ApiError>(&content)) return *error;
        result = std::move(std::get<std::string>(content));
      }
      // The chat templates have no place for is_error: the model reads it in the result.
      if (block.value("is_error", false)) result = "Error: " + result;
      flush();
      messages.push_back(
          {{"role", "tool"}, {"tool_call_id", block["tool_use_id"]}, {"content", result}});
    } else {
      return unsupported_field(at(where, i) + ".type",
                               "a user content block of type '" + type + "'");
    }
  }
  flush();
  return std::nullopt;
}

// An assistant turn's blocks: text, tool_use (as tool calls) and thinking (as the turn's
// reasoning, for the templates that write it back).
std::optional<ApiError> add_assistant_blocks(const json& blocks, const std::string& where,
                                             json& messages) {
  json message = {{"role", "assistant"}, {"content", ""}};
  std::string text, reasoning;
  json calls = json::array();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const json& block = blocks[i];
    const std::string type = block_type(block);
    if (type == "text") {
      if (auto error = need_string(block, "text", at(where, i))) return *error;
      text += block["text"].get<std::string>();
    } else if (type == "tool_use") {
      for (const char* key : {"id", "name"})
        if (auto error = need_string(block, key, at(where, i))) return *error;
      if (!block.contains("input") || !block["input"].is_object())
        return invalid_field(at(where, i) + ".input", "'input' must be an object");
      calls.push_back(
          {{"id", block["id"]},
           {"type", "function"},
           {"function", {{"name", block["name"]}, {"arguments", block["input"].dump()}}}});
    } else if (type == "thinking") {
      if (auto error = need_string(block, "thinking", at(where, i))) return *error;
      reasoning += block["thinking"].get<std::string>();
    } else if (type != "redacted_thinking") {  // another server's encrypted reasoning: no text
      return unsupported_field(at(where, i) + ".type",
                               "an assistant content block of type '" + type + "'");
    }
  }
  message["content"] = text;
  if (!calls.empty()) message["tool_calls"] = std::move(calls);
  if (!reasoning.empty()) message["reasoning_content"] = reasoning;
  messages.push_back(std::move(message));
  return std::nullopt;
}

std::optional<ApiError> add_messages(const json& body, json& messages) {
  if (!body.contains("messages")) return invalid_field("messages", "'messages' is required");
  const json& turns = body["messages"];
  if (!turns.is_array() || turns.empty())
    return invalid_field("messages", "'messages' must be a non-empty list");
  for (size_t i = 0; i < turns.size(); ++i) {
    const json& turn = turns[i];
    const std::string where = at("messages", i);
    if (!turn.is_object()) return invalid_field(where, "a message must be an object");
    const std::string role =
        turn.contains("role") && turn["role"].is_string() ? turn["role"].get<std::string>() : "";
    if (role != "user" && role != "assistant")
      return invalid_field(where + ".role", "a message's role must be user or assistant");
    if (!turn.contains("content"))
      return invalid_field(where + ".content", "a message needs content");
    const json& content = turn["content"];
    if (content.is_string()) {
      messages.push_back({{"role", role}, {"content", content}});
      continue;
    }
    if (!content.is_array())
      return invalid_field(where + ".content",
                           "'content' must be a string or a list of content blocks");
    auto error = role == "user" ? add_user_blocks(content, where + ".content", messages)
                                : add_assistant_blocks(content, where + ".content", messages);
    if (error) return error;
  }
  return std::nullopt;
}

// Anthropic's tools ({name, description, input_schema}) as chat's functions. Anthropic's own
// tool types (bash, text editor, web search: a `type` with a version) are run by Anthropic's
// servers or defined by them, and are refused.
std::variant<json, ApiError> chat_tools(const json& tools) {
  if (!tools.is_array()) return invalid_field("tools", "'tools' must be a list");
  json out = json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& tool = tools[i];
    const std::string where = at("tools", i);
    if (!tool.is_object()) return invalid_field(where, "a tool must be an object");
    const std::string type = block_type(tool);
    if (!type.empty() && type != "custom")
      return unsupported_field(where + ".type", "a tool of type '" + type + "'");
    if (auto error = need_string(tool, "name", where)) return *error;
    if (!tool.contains("input_schema") || !tool["input_schema"].is_object())
      return invalid_field(where + ".input_schema", "'input_schema' must be an object");
    json function = {{"name", tool["name"]}};
    if (tool.contains("description") && !tool["description"].is_null())
      function["description"] = tool["description"];
    function["parameters"] = tool["input_schema"];
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

std::optional<ApiError> add_tool_choice(const json& choice, json& chat) {
  if (!choice.is_object()) return invalid_field("tool_choice", "'tool_choice' must be an object");
  const std::string type = block_type(choice);
  if (type == "auto" || type == "none") {
    chat["tool_choice"] = type;
  } else if (type == "any") {
    chat["tool_choice"] = "required";
  } else if (type == "tool") {
    if (auto error = need_string(choice, "name", "tool_choice")) return *error;
    chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", choice["name"]}}}};
  } else {
    return invalid_field("tool_choice.type", "'tool_choice.type' must be auto, any, tool or none");
  }
  if (choice.value("disable_parallel_tool_use", false)) chat["parallel_tool_calls"] = false;
  return std::nullopt;
}

// thinking {type: enabled|disabled|adaptive}: the chat template's switch for the models that
// have one (enable_thinking, as Qwen3's and DeepSeek-V3.1's templates read it; `thinking` too,
// for DeepSeek's). budget_tokens is checked but not enforced: a thinking block ends where the
// model ends it, within max_tokens.
std::optional<ApiError> add_thinking(const json& thinking, json& chat) {
  if (!thinking.is_object()) return invalid_field("thinking", "'thinking' must be an object");
  const std::string type = block_type(thinking);
  if (type != "enabled" && type != "disabled" && type != "adaptive")
    return invalid_field("thinking.type", "'thinking.type' must be enabled, disabled or adaptive");
  if (thinking.contains("budget_tokens") && (!thinking["budget_tokens"].is_number_integer() ||
                                             thinking["budget_tokens"].get<int64_t>() < 1))
    return invalid_field("thinking.budget_tokens", "'budget_tokens' must be a positive integer");
  if (type == "adaptive") return std::nullopt;  // the model's own default
  json kwargs = chat.value("chat_template_kwargs", json::object());
  if (!kwargs.is_object())
    return invalid_field("chat_template_kwargs", "'chat_template_kwargs' must be an object");
  kwargs["enable_thinking"] = kwargs["thinking"] = type == "enabled";
  chat["chat_template_kwargs"] = std::move(kwargs);
  return std::nullopt;
}

std::variant<MessagesRequest, ApiError> translate(const json& body, MessagesUse use) {
  if (!body.is_object()) return invalid_field("", "the request body must be a JSON object");
  if (body.contains("mcp_servers") && !body["mcp_servers"].is_null() &&
      !(body["mcp_servers"].is_array() && body["mcp_servers"].empty()))
    return unsupported_field("mcp_servers", "mcp_servers");
  if (body.contains("container") && !body["container"].is_null())
    return unsupported_field("container", "container");
  MessagesRequest out;
  out.id = random_id("msg_");
  json chat = json::object();
  json messages = json::array();
  if (body.contains("system") && !body["system"].is_null()) {
    auto system = text_of(body["system"], "system");
    if (auto* error = std::get_if<ApiError>(&system)) return *error;
    messages.push_back({{"role", "system"}, {"content", std::get<std::string>(system)}});
  }
  if (auto error = add_messages(body, messages)) return *error;
  // A final assistant turn with text is the start of the answer, which the model continues
  // (Anthropic's prefill); like Anthropic, its text may not end in whitespace.
  const json& last = messages.back();
  const std::string& text = last["content"].get_ref<const std::string&>();
  if (last["role"] == "assistant" && !last.contains("tool_calls") && !text.empty()) {
    if (std::isspace(static_cast<unsigned char>(text.back())))
      return invalid_field("messages",
                           "final assistant content cannot end with trailing whitespace");
    chat["continue_final_message"] = true;
  }
  chat["messages"] = std::move(messages);
  if (!body.contains("model")) return invalid_field("model", "'model' is required");
  chat["model"] = body["model"];
  // The extensions chat reads the same way, checked there.
  for (const char* key : {"chat_template_kwargs", "skip_special_tokens"})
    if (body.contains(key) && !body[key].is_null()) chat[key] = body[key];
  if (body.contains("tools") && !body["tools"].is_null()) {
    auto tools = chat_tools(body["tools"]);
    if (auto* error = std::get_if<ApiError>(&tools)) return *error;
    if (!std::get<json>(tools).empty()) chat["tools"] = std::move(std::get<json>(tools));
  }
  if (body.contains("tool_choice") && !body["tool_choice"].is_null())
    if (auto error = add_tool_choice(body["tool_choice"], chat)) return *error;
  if (body.contains("thinking") && !body["thinking"].is_null())
    if (auto error = add_thinking(body["thinking"], chat)) return *error;
  if (use == MessagesUse::kGenerate) {
    if (!body.contains("max_tokens") || body["max_tokens"].is_null())
      return invalid_field("max_tokens", "'max_tokens' is required");
    if (!body["max_tokens"].is_number_integer() || body["max_tokens"].get<int64_t>() < 1)
      return invalid_field("max_tokens", "'max_tokens' must be a positive integer");
    chat["max_tokens"] = body["max_tokens"];
    // The sampling settings chat reads the same way, checked there (vLLM's extensions too).
    for (const char* key : {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                            "frequency_penalty", "repetition_penalty"})
      if (body.contains(key) && !body[key].is_null()) chat[key] = body[key];
    if (body.contains("stop_sequences") && !body["stop_sequences"].is_null()) {
      const json& stops = body["stop_sequences"];
      if (!stops.is_array())
        return invalid_field("stop_sequences", "'stop_sequences' must be a list of strings");
      std::vector<std::string> checked;
      if (auto error = read_stop_strings(stops, "stop_sequences", checked)) return *error;
      chat["stop"] = stops;
    }
    if (body.contains("metadata") && body["metadata"].is_object() &&
        body["metadata"].contains("user_id") && body["metadata"]["user_id"].is_string())
      chat["user"] = body["metadata"]["user_id"];
    out.stream = body.value("stream", false);
    if (out.stream) {
      chat["stream"] = true;
      // message_start carries the prompt's token count, message_delta the whole usage.
      chat["stream_options"] = {{"include_usage", true}, {"continuous_usage_stats", true}};
    }
  }
  out.chat_body = to_text(chat);
  return out;
}

// `stop_reason`: the stop string that ended the text (empty: none did).
const char* stop_reason_of(const std::string& finish_reason, const std::string& stop_reason) {
  if (finish_reason == "length") return "max_tokens";
  if (finish_reason == "tool_calls") return "tool_use";
  return stop_reason.empty() ? "end_turn" : "stop_sequence";
}

json stop_sequence_of(const std::string& finish_reason, const std::string& stop_reason) {
  return finish_reason == "stop" && !stop_reason.empty() ? json(stop_reason) : json(nullptr);
}

// Anthropic counts the prompt tokens read from its cache apart from the others.
json usage_of(const json& chat_usage) {
  if (!chat_usage.is_object()) return {{"input_tokens", 0}, {"output_tokens", 0}};
  const int64_t prompt = chat_usage.value("prompt_tokens", int64_t{0});
  int64_t cached = 0;
  if (chat_usage.contains("prompt_tokens_details") &&
      chat_usage["prompt_tokens_details"].is_object())
    cached = chat_usage["prompt_tokens_details"].value("cached_tokens", int64_t{0});
  return {{"input_tokens", prompt - cached},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", cached},
          {"output_tokens", chat_usage.value("completion_tokens", int64_t{0})}};
}

// A tool call's arguments as the object Anthropic's `input` is (the call parsers give valid
// JSON; anything else would be a bug here, and is passed as an empty input).
json input_of(const std::string& arguments) {
  json input = json::parse(arguments, nullptr, /*allow_exceptions=*/false);
  return input.is_object() ? input : json::object();
}

json tool_use_block(const json& call) {
  const json function = call.value("function", json::object());
  return {{"type", "tool_use"},
          {"id", call.value("id", "")},
          {"name", function.value("name", "")},
          {"input", input_of(function.value("arguments", "{}"))}};
}

const char* error_type(int status) {
  switch (status) {
    case 400:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 503:
    case 529:
      return "overloaded_error";
    case 504:
      return "timeout_error";
    default:
      return status >= 400 && status < 500 ? "invalid_request_error" : "api_error";
  }
}

// The HTTP status an error event of the chat stream had, from its type (a stream's errors carry
// no status).
int status_of(const std::string& openai_type) {
  if (openai_type == "invalid_request_error") return 400;
  if (openai_type == "authentication_error") return 401;
  if (openai_type == "permission_error") return 403;
  if (openai_type == "rate_limit_error") return 429;
  if (openai_type == "service_unavailable") return 503;
  if (openai_type == "timeout_error") return 504;
  return 500;
}

}  // namespace

std::variant<MessagesRequest, ApiError> parse_messages_request(const std::string& text,
                                                               MessagesUse use) {
  const json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return invalid_field("", "the request body is not valid JSON");
  // A field of another JSON type than the API's throws where it is read: the caller's error.
  try {
    return translate(body, use);
  } catch (const json::exception& e) {
    return invalid_field(
        "", std::string("a field of the request has the wrong type (") + e.what() + ")");
  }
}

json message_from_chat(const MessagesRequest& request, const json& chat) {
  const json& choice = chat["choices"][0];
  const json& message = choice["message"];
  const std::string finish_reason = choice.value("finish_reason", "");
  const std::string stop_reason =
      choice.contains("stop_reason") && choice["stop_reason"].is_string()
          ? choice["stop_reason"].get<std::string>()
          : "";
  json content = json::array();
  if (message.contains("reasoning_content") && message["reasoning_content"].is_string() &&
      !message["reasoning_content"].get<std::string>().empty())
    content.push_back(
        {{"type", "thinking"}, {"thinking", message["reasoning_content"]}, {"signature", ""}});
  if (message["content"].is_string() && !message["content"].get<std::string>().empty())
    content.push_back({{"type", "text"}, {"text", message["content"]}});
  if (message.contains("tool_calls") && message["tool_calls"].is_array())
    for (const json& call : message["tool_calls"]) content.push_back(tool_use_block(call));
  json out = {{"id", request.id},
              {"type", "message"},
              {"role", "assistant"},
              {"model", chat.value("model", "")},
              {"content", std::move(content)},
              {"stop_reason", stop_reason_of(finish_reason, stop_reason)},
              {"stop_sequence", stop_sequence_of(finish_reason, stop_reason)},
              {"usage", usage_of(chat.value("usage", json()))}};
  if (chat.contains("moeline")) out["moeline"] = chat["moeline"];
  return out;
}

json anthropic_error(int status, const std::string& message) {
  return {{"type", "error"}, {"error", {{"type", error_type(status)}, {"message", message}}}};
}

json anthropic_error_from(int status, const json& openai_error) {
  const json error = openai_error.is_object() ? openai_error.value("error", json()) : json();
  const std::string message =
      error.is_object() && error.contains("message") && error["message"].is_string()
          ? error["message"].get<std::string>()
          : "the request failed (HTTP " + std::to_string(status) + ")";
  return anthropic_error(status, message);
}

bool MessagesStream::feed(const char* data, size_t size, httplib::DataSink& sink) {
  return events_.feed(data, size, [&](const std::string& event) { return on_event(event, sink); });
}

bool MessagesStream::on_event(const std::string& event, httplib::DataSink& sink) {
  if (event.rfind(":", 0) == 0)  // a keep-alive comment: Anthropic's keep-alive is a ping
    return emit("ping", json::object(), sink);
  if (event.rfind("data: ", 0) != 0 || ended_) return true;
  const std::string_view data = std::string_view(event).substr(6);
  if (data == "[DONE]") {
    ended_ = true;
    if (!close_block(sink)) return false;
    json delta = {{"stop_reason", stop_reason_of(finish_reason_, stop_reason_)},
                  {"stop_sequence", stop_sequence_of(finish_reason_, stop_reason_)}};
    return emit("message_delta", {{"delta", std::move(delta)}, {"usage", usage_object()}}, sink) &&
           emit("message_stop", json::object(), sink);
  }
  const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!chunk.is_object()) return true;
  if (chunk.contains("error")) {
    ended_ = true;
    const json& error = chunk["error"];
    const std::string type = error.is_object() ? error.value("type", "") : "";
    return emit("error", {{"error", anthropic_error_from(status_of(type), chunk)["error"]}}, sink);
  }
  return on_chunk(chunk, sink);
}

bool MessagesStream::on_chunk(const json& chunk, httplib::DataSink& sink) {
  if (chunk.contains("usage") && chunk["usage"].is_object()) usage_ = chunk["usage"];
  if (!started_) {
    started_ = true;
    json message = {{"id", request_.id},        {"type", "message"},
                    {"role", "assistant"},      {"model", chunk.value("model", "")},
                    {"content", json::array()}, {"stop_reason", nullptr},
                    {"stop_sequence", nullptr}, {"usage", usage_object()}};
    if (!emit("message_start", {{"message", std::move(message)}}, sink)) return false;
  }
  if (!chunk.contains("choices") || !chunk["choices"].is_array() || chunk["choices"].empty())
    return true;
  const json& choice = chunk["choices"][0];
  const json delta = choice.value("delta", json::object());
  for (const auto& [field, kind] :
       {std::pair{"reasoning_content", Block::kThinking}, std::pair{"content", Block::kText}})
    if (delta.contains(field) && delta[field].is_string() &&
        !delta[field].get_ref<const std::string&>().empty() && !add_text(kind, delta[field], sink))
      return false;
  if (delta.contains("tool_calls") && delta["tool_calls"].is_array()) {
    if (!close_block(sink)) return false;
    for (const json& call : delta["tool_calls"]) {  // each comes whole (token_stream.h)
      json block = tool_use_block(call);
      const std::string input = block["input"].dump();
      block["input"] = json::object();
      const int64_t index = blocks_++;
      if (!emit("content_block_start", {{"index", index}, {"content_block", std::move(block)}},
                sink) ||
          !emit("content_block_delta",
                {{"index", index},
                 {"delta", {{"type", "input_json_delta"}, {"partial_json", input}}}},
                sink) ||
          !emit("content_block_stop", {{"index", index}}, sink))
        return false;
    }
  }
  if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) {
    finish_reason_ = choice["finish_reason"];
    if (choice.contains("stop_reason") && choice["stop_reason"].is_string())
      stop_reason_ = choice["stop_reason"];
  }
  return true;
}

bool MessagesStream::add_text(Block kind, const std::string& piece, httplib::DataSink& sink) {
  const bool thinking = kind == Block::kThinking;
  if (open_ != kind) {
    if (!close_block(sink)) return false;
    json block = thinking ? json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                          : json{{"type", "text"}, {"text", ""}};
    if (!emit("content_block_start", {{"index", blocks_}, {"content_block", std::move(block)}},
              sink))
      return false;
    open_ = kind;
  }
  json delta = thinking ? json{{"type", "thinking_delta"}, {"thinking", piece}}
                        : json{{"type", "text_delta"}, {"text", piece}};
  return emit("content_block_delta", {{"index", blocks_}, {"delta", std::move(delta)}}, sink);
}

bool MessagesStream::close_block(httplib::DataSink& sink) {
  if (open_ == Block::kNone) return true;
  open_ = Block::kNone;
  return emit("content_block_stop", {{"index", blocks_++}}, sink);
}

json MessagesStream::usage_object() const {
  return usage_of(usage_);
}

bool MessagesStream::emit(const char* type, json event, httplib::DataSink& sink) {
  event["type"] = type;
  const std::string text = named_event(type, event);
  return sink.write(text.data(), text.size());
}

}  // namespace moeline::stages::http
