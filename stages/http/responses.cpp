#include "stages/http/responses.h"

#include <algorithm>
#include <ctime>
#include <string_view>
#include <utility>

namespace moeline::stages::http {
namespace {

using json = nlohmann::json;

// A message's content: a string, or parts whose text is joined (input_text, output_text, text).
std::variant<std::string, ApiError> content_text(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    return invalid_field(where, "'" + where + "' must be a string or a list");
  std::string text;
  for (const json& part : content) {
    const std::string type = part.is_object() ? part.value("type", "") : "";
    if (type != "input_text" && type != "output_text" && type != "text")
      return unsupported_field(where, "a content part of type '" + type + "'");
    if (!part.contains("text") || !part["text"].is_string())
      return invalid_field(where, "a text part needs its 'text'");
    text += part["text"].get<std::string>();
  }
  return text;
}

// The input items as chat messages (after the instructions' system message).
std::optional<ApiError> add_input(const json& input, json& messages) {
  if (input.is_string()) {
    messages.push_back({{"role", "user"}, {"content", input}});
    return std::nullopt;
  }
  if (!input.is_array() || input.empty())
    return invalid_field("input", "'input' must be a string or a non-empty list of items");
  for (size_t i = 0; i < input.size(); ++i) {
    const json& item = input[i];
    const std::string where = "input[" + std::to_string(i) + "]";
    if (!item.is_object()) return invalid_field(where, "an input item must be an object");
    const std::string type = item.value("type", "message");
    if (type == "message") {
      std::string role = item.value("role", "");
      if (role == "developer") role = "system";
      if (role != "user" && role != "assistant" && role != "system")
        return invalid_field(where + ".role",
                             "a message's role must be user, assistant, system or "
                             "developer");
      if (!item.contains("content"))
        return invalid_field(where + ".content", "a message needs content");
      auto text = content_text(item["content"], where + ".content");
      if (auto* error = std::get_if<ApiError>(&text)) return *error;
      messages.push_back({{"role", role}, {"content", std::get<std::string>(text)}});
    } else if (type == "function_call") {
      for (const char* key : {"call_id", "name", "arguments"})
        if (!item.contains(key) || !item[key].is_string())
          return invalid_field(where + "." + key,
                               std::string("a function_call needs its '") + key + "'");
      json call = {{"id", item["call_id"]},
                   {"type", "function"},
                   {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}};
      // Calls one after another are one assistant turn, as the model wrote them.
      json* last = messages.empty() ? nullptr : &messages.back();
      if (last != nullptr && (*last)["role"] == "assistant" && last->contains("tool_calls")) {
        (*last)["tool_calls"].push_back(std::move(call));
      } else {
        messages.push_back(
            {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array({call})}});
      }
    } else if (type == "function_call_output") {
      if (!item.contains("call_id") || !item["call_id"].is_string())
        return invalid_field(where + ".call_id", "a function_call_output needs its 'call_id'");
      if (!item.contains("output"))
        return invalid_field(where + ".output", "it needs its 'output'");
      auto text = content_text(item["output"], where + ".output");
      if (auto* error = std::get_if<ApiError>(&text)) return *error;
      messages.push_back({{"role", "tool"},
                          {"tool_call_id", item["call_id"]},
                          {"content", std::get<std::string>(text)}});
    } else if (type == "reasoning") {
      continue;  // an earlier answer's reasoning: not shown to the model again (as chat drops it)
    } else {
      return unsupported_field(where + ".type", "an input item of type '" + type + "'");
    }
  }
  return std::nullopt;
}

// Responses' function tools ({type, name, description, parameters}) as chat's.
std::variant<json, ApiError> chat_tools(const json& tools) {
  if (!tools.is_array()) return invalid_field("tools", "'tools' must be a list");
  json out = json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& tool = tools[i];
    const std::string type = tool.is_object() ? tool.value("type", "") : "";
    if (type != "function")
      return unsupported_field("tools[" + std::to_string(i) + "]", "a tool of type '" + type + "'");
    json function = {{"name", tool.value("name", json())}};
    for (const char* key : {"description", "parameters", "strict"})
      if (tool.contains(key) && !tool[key].is_null()) function[key] = tool[key];
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

json usage_of(const json& chat_usage) {
  if (!chat_usage.is_object()) return nullptr;
  const int64_t input = chat_usage.value("prompt_tokens", int64_t{0});
  const int64_t output = chat_usage.value("completion_tokens", int64_t{0});
  int64_t cached = 0;
  if (chat_usage.contains("prompt_tokens_details") &&
      chat_usage["prompt_tokens_details"].is_object())
    cached = chat_usage["prompt_tokens_details"].value("cached_tokens", int64_t{0});
  return {{"input_tokens", input},
          {"input_tokens_details", {{"cached_tokens", cached}}},
          {"output_tokens", output},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", input + output}};
}

json reasoning_item(const std::string& id, const std::string& text) {
  return {{"type", "reasoning"},
          {"id", id},
          {"summary", json::array()},
          {"content", json::array({{{"type", "reasoning_text"}, {"text", text}}})}};
}

json text_part(const std::string& text) {
  return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}};
}

json message_item(const std::string& id, const std::string& text, const char* status) {
  return {{"type", "message"},
          {"id", id},
          {"status", status},
          {"role", "assistant"},
          {"content", json::array({text_part(text)})}};
}

json function_call_item(const json& call, const char* status) {
  const json& function = call.value("function", json::object());
  return {{"type", "function_call"},
          {"id", random_id("fc_")},
          {"call_id", call.value("id", "")},
          {"name", function.value("name", "")},
          {"arguments", function.value("arguments", "{}")},
          {"status", status}};
}

// The response object: the request's echo, then what was made.
json response_with(const ResponsesRequest& request, const std::string& model, int64_t created,
                   const char* status, const std::string& finish_reason, json output, json usage) {
  json response = {{"id", request.id},
                   {"object", "response"},
                   {"created_at", created},
                   {"status", status},
                   {"error", nullptr},
                   {"incomplete_details", nullptr},
                   {"model", model},
                   {"output", std::move(output)},
                   {"previous_response_id", nullptr},
                   {"store", false},
                   {"usage", std::move(usage)}};
  for (const auto& [key, value] : request.echo.items()) response[key] = value;
  if (finish_reason == "length") response["incomplete_details"] = {{"reason", "max_output_tokens"}};
  return response;
}

std::variant<ResponsesRequest, ApiError> translate(const json& body) {
  if (!body.is_object()) return invalid_field("", "the request body must be a JSON object");
  if (body.contains("previous_response_id") && !body["previous_response_id"].is_null())
    return unsupported_field("previous_response_id",
                             "previous_response_id (responses are not stored: send the whole "
                             "conversation as input items)");
  if (body.value("background", false)) return unsupported_field("background", "background");
  ResponsesRequest out;
  out.id = random_id("resp_");
  json chat = json::object();
  json messages = json::array();
  json echo = {{"instructions", nullptr},
               {"max_output_tokens", nullptr},
               {"metadata", json::object()},
               {"parallel_tool_calls", true},
               {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
               {"temperature", 1.0},
               {"text", {{"format", {{"type", "text"}}}}},
               {"tool_choice", "auto"},
               {"tools", json::array()},
               {"top_p", 1.0},
               {"truncation", "disabled"},
               {"user", nullptr}};
  if (body.contains("instructions") && !body["instructions"].is_null()) {
    if (!body["instructions"].is_string())
      return invalid_field("instructions", "'instructions' must be a string");
    messages.push_back({{"role", "system"}, {"content", body["instructions"]}});
    echo["instructions"] = body["instructions"];
  }
  if (!body.contains("input")) return invalid_field("input", "'input' is required");
  if (auto error = add_input(body["input"], messages)) return *error;
  chat["messages"] = std::move(messages);
  if (body.contains("model")) chat["model"] = body["model"];
  // The sampling settings chat reads the same way, checked there (vLLM's extensions included).
  for (const char* key : {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                          "frequency_penalty", "repetition_penalty", "parallel_tool_calls", "user",
                          "chat_template_kwargs", "skip_special_tokens"})
    if (body.contains(key) && !body[key].is_null()) chat[key] = body[key];
  for (const char* key : {"temperature", "top_p", "parallel_tool_calls", "user", "metadata"})
    if (body.contains(key) && !body[key].is_null()) echo[key] = body[key];
  if (body.contains("max_output_tokens") && !body["max_output_tokens"].is_null()) {
    chat["max_tokens"] = body["max_output_tokens"];
    echo["max_output_tokens"] = body["max_output_tokens"];
  }
  if (body.contains("tools") && !body["tools"].is_null()) {
    auto tools = chat_tools(body["tools"]);
    if (auto* error = std::get_if<ApiError>(&tools)) return *error;
    if (!std::get<json>(tools).empty()) chat["tools"] = std::move(std::get<json>(tools));
    echo["tools"] = body["tools"];
  }
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const json& choice = body["tool_choice"];
    if (choice.is_object()) {
      if (choice.value("type", "") != "function" || !choice.contains("name"))
        return invalid_field("tool_choice",
                             "'tool_choice' must be auto, none, required or "
                             "{\"type\": \"function\", \"name\": ...}");
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", choice["name"]}}}};
    } else {
      chat["tool_choice"] = choice;
    }
    echo["tool_choice"] = choice;
  }
  if (body.contains("text") && body["text"].is_object() && body["text"].contains("format")) {
    const json& format = body["text"]["format"];
    const std::string type = format.is_object() ? format.value("type", "") : "";
    if (type == "json_schema") {
      json schema = {{"name", format.value("name", "response")}};
      for (const char* key : {"schema", "strict", "description"})
        if (format.contains(key)) schema[key] = format[key];
      chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
    } else if (type == "json_object") {
      chat["response_format"] = {{"type", "json_object"}};
    } else if (type != "text") {
      return invalid_field("text.format",
                           "'text.format' must be of type text, json_object or "
                           "json_schema");
    }
    echo["text"] = body["text"];
  }
  out.stream = body.value("stream", false);
  if (out.stream) {
    chat["stream"] = true;
    chat["stream_options"] = {{"include_usage", true}};  // response.completed carries the usage
  }
  out.chat_body = chat.dump(-1, ' ', false, json::error_handler_t::replace);
  out.echo = std::move(echo);
  return out;
}

}  // namespace

std::variant<ResponsesRequest, ApiError> parse_responses_request(const std::string& text) {
  const json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  // A field of another JSON type than the API's (a number for a role, a string for stream)
  // throws where it is read: the caller's error, named.
  try {
    return translate(body);
  } catch (const json::exception& e) {
    return invalid_field(
        "", std::string("a field of the request has the wrong type (") + e.what() + ")");
  }
}

json response_from_chat(const ResponsesRequest& request, const json& chat) {
  const json& choice = chat["choices"][0];
  const json& message = choice["message"];
  const std::string finish_reason = choice.value("finish_reason", "");
  json output = json::array();
  if (message.contains("reasoning_content") && message["reasoning_content"].is_string() &&
      !message["reasoning_content"].get<std::string>().empty())
    output.push_back(reasoning_item(random_id("rs_"), message["reasoning_content"]));
  const bool calls = message.contains("tool_calls") && message["tool_calls"].is_array() &&
                     !message["tool_calls"].empty();
  const std::string text =
      message["content"].is_string() ? message["content"].get<std::string>() : std::string();
  const char* status = finish_reason == "length" ? "incomplete" : "completed";
  if (!text.empty() || !calls) output.push_back(message_item(random_id("msg_"), text, status));
  if (calls)
    for (const json& call : message["tool_calls"])
      output.push_back(function_call_item(call, "completed"));
  return response_with(request, chat.value("model", ""), chat.value("created", int64_t{0}), status,
                       finish_reason, std::move(output), usage_of(chat.value("usage", json())));
}

bool ResponsesStream::feed(const char* data, size_t size, httplib::DataSink& sink) {
  return events_.feed(data, size, [&](const std::string& event) { return on_event(event, sink); });
}

bool ResponsesStream::on_event(const std::string& event, httplib::DataSink& sink) {
  if (event.rfind(":", 0) == 0) {  // a keep-alive comment: passed on, the proxy's traffic
    const std::string comment = event + "\n\n";
    return sink.write(comment.data(), comment.size());
  }
  if (event.rfind("data: ", 0) != 0 || ended_) return true;
  const std::string_view data = std::string_view(event).substr(6);
  if (data == "[DONE]") {
    // An answer of no text and no call still has its (empty) message, as the whole response.
    const bool answered = std::any_of(output_.begin(), output_.end(), [](const json& item) {
      return item["type"] == "message" || item["type"] == "function_call";
    });
    if (!answered && open_ != Open::kMessage && !open_item(Open::kMessage, sink)) return false;
    if (!close_item(sink)) return false;
    ended_ = true;
    json done = {
        {"response", response_object(finish_reason_ == "length" ? "incomplete" : "completed")}};
    return emit(finish_reason_ == "length" ? "response.incomplete" : "response.completed",
                std::move(done), sink);
  }
  const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!chunk.is_object()) return true;
  if (chunk.contains("error")) {
    ended_ = true;
    const json& error = chunk["error"];
    return emit("error",
                {{"code", error.value("code", json())},
                 {"message", error.value("message", "")},
                 {"param", error.value("param", json())}},
                sink);
  }
  return on_chunk(chunk, sink);
}

bool ResponsesStream::on_chunk(const json& chunk, httplib::DataSink& sink) {
  if (!started_) {
    started_ = true;
    model_ = chunk.value("model", "");
    created_ = chunk.value("created", int64_t{0});
    if (!emit("response.created", {{"response", response_object("in_progress")}}, sink) ||
        !emit("response.in_progress", {{"response", response_object("in_progress")}}, sink))
      return false;
  }
  if (chunk.contains("usage") && chunk["usage"].is_object()) usage_ = usage_of(chunk["usage"]);
  if (!chunk.contains("choices") || !chunk["choices"].is_array() || chunk["choices"].empty())
    return true;
  const json& choice = chunk["choices"][0];
  const json delta = choice.value("delta", json::object());
  const auto index = [this] { return static_cast<int64_t>(output_.size()); };
  // Empty deltas (the first chunk's, with the role) open no item.
  for (const auto& [field, kind] :
       {std::pair{"reasoning_content", Open::kReasoning}, std::pair{"content", Open::kMessage}})
    if (delta.contains(field) && delta[field].is_string() &&
        !delta[field].get_ref<const std::string&>().empty() && !add_text(kind, delta[field], sink))
      return false;
  if (delta.contains("tool_calls") && delta["tool_calls"].is_array()) {
    if (!close_item(sink)) return false;
    for (const json& call : delta["tool_calls"]) {  // each comes whole (token_stream.h)
      json item = function_call_item(call, "in_progress");
      const std::string arguments = item["arguments"];
      const std::string id = item["id"];
      item["arguments"] = "";
      if (!emit("response.output_item.added", {{"output_index", index()}, {"item", item}}, sink) ||
          !emit("response.function_call_arguments.delta",
                {{"item_id", id}, {"output_index", index()}, {"delta", arguments}}, sink) ||
          !emit("response.function_call_arguments.done",
                {{"item_id", id}, {"output_index", index()}, {"arguments", arguments}}, sink))
        return false;
      item["arguments"] = arguments;
      item["status"] = "completed";
      if (!emit("response.output_item.done", {{"output_index", index()}, {"item", item}}, sink))
        return false;
      output_.push_back(std::move(item));
    }
  }
  if (choice.contains("finish_reason") && choice["finish_reason"].is_string())
    finish_reason_ = choice["finish_reason"];
  return true;
}

bool ResponsesStream::open_item(Open kind, httplib::DataSink& sink) {
  if (!close_item(sink)) return false;
  open_ = kind;
  open_id_ = random_id(kind == Open::kMessage ? "msg_" : "rs_");
  open_text_.clear();
  const int64_t index = static_cast<int64_t>(output_.size());
  json item = kind == Open::kMessage ? message_item(open_id_, "", "in_progress")
                                     : reasoning_item(open_id_, "");
  item["content"] = json::array();
  if (!emit("response.output_item.added", {{"output_index", index}, {"item", std::move(item)}},
            sink))
    return false;
  return kind != Open::kMessage || emit("response.content_part.added",
                                        {{"item_id", open_id_},
                                         {"output_index", index},
                                         {"content_index", 0},
                                         {"part", text_part("")}},
                                        sink);
}

bool ResponsesStream::add_text(Open kind, const std::string& piece, httplib::DataSink& sink) {
  if (open_ != kind && !open_item(kind, sink)) return false;
  open_text_ += piece;
  json event = {{"item_id", open_id_},
                {"output_index", static_cast<int64_t>(output_.size())},
                {"content_index", 0},
                {"delta", piece}};
  if (kind == Open::kMessage) event["logprobs"] = json::array();
  return emit(
      kind == Open::kMessage ? "response.output_text.delta" : "response.reasoning_text.delta",
      std::move(event), sink);
}

bool ResponsesStream::close_item(httplib::DataSink& sink) {
  const int64_t index = static_cast<int64_t>(output_.size());
  json item;
  if (open_ == Open::kReasoning) {
    item = reasoning_item(open_id_, open_text_);
    if (!emit("response.reasoning_text.done",
              {{"item_id", open_id_},
               {"output_index", index},
               {"content_index", 0},
               {"text", open_text_}},
              sink))
      return false;
  } else if (open_ == Open::kMessage) {
    item =
        message_item(open_id_, open_text_, finish_reason_ == "length" ? "incomplete" : "completed");
    if (!emit("response.output_text.done",
              {{"item_id", open_id_},
               {"output_index", index},
               {"content_index", 0},
               {"text", open_text_},
               {"logprobs", json::array()}},
              sink) ||
        !emit("response.content_part.done",
              {{"item_id", open_id_},
               {"output_index", index},
               {"content_index", 0},
               {"part", text_part(open_text_)}},
              sink))
      return false;
  } else {
    return true;
  }
  open_ = Open::kNone;
  if (!emit("response.output_item.done", {{"output_index", index}, {"item", item}}, sink))
    return false;
  output_.push_back(std::move(item));
  return true;
}

json ResponsesStream::response_object(const char* status) const {
  const bool done = std::string_view(status) != "in_progress";
  return response_with(request_, model_, created_, status, done ? finish_reason_ : "",
                       done ? output_ : json::array(), done ? usage_ : json());
}

bool ResponsesStream::emit(const char* type, json event, httplib::DataSink& sink) {
  event["type"] = type;
  event["sequence_number"] = sequence_++;
  const std::string text = named_event(type, event);
  return sink.write(text.data(), text.size());
}

}  // namespace moeline::stages::http
