#include "stages/http/openai.h"

#include <charconv>
#include <chrono>
#include <limits>
#include <random>

#include "model/json_grammar.h"
#include "model/sampling.h"
#include "stages/http/stop_matcher.h"

namespace moeline::stages::http {

using nlohmann::json;

ApiError invalid_field(const std::string& param, const std::string& message) {
  ApiError error;
  error.param = param;
  error.message = message;
  return error;
}

ApiError unsupported_field(const std::string& param, const std::string& what) {
  ApiError error = invalid_field(param, what + " is not supported by this server yet");
  error.code = "unsupported_parameter";
  return error;
}

namespace {

constexpr size_t kMaxBodyNesting = 256;

// JSON text nested past kMaxBodyNesting (the body, or JSON given as text inside it, which the
// template and the grammar are given parsed and write back recursively): a 400 naming `param`.
std::optional<ApiError> refuse_deep(std::string_view text, const std::string& param,
                                    const std::string& what) {
  if (model::json_text_depth(text) <= kMaxBodyNesting) return std::nullopt;
  return invalid_field(param,
                       what + " is nested more than " + std::to_string(kMaxBodyNesting) + " deep");
}

const char* type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

ApiError wrong_type(const std::string& param, const json& value, const char* want) {
  return invalid_field(param, "'" + param + "' must be " + want + ", not " + type_name(value));
}

// A field that is there and not null.
bool present(const json& body, const char* key) {
  return body.contains(key) && !body[key].is_null();
}

// Reads an optional field: absent or null leaves `out` as it is.
std::optional<ApiError> read_number(const json& body, const char* key, double low, double high,
                                    double& out) {
  if (!present(body, key)) return std::nullopt;
  const json& value = body[key];
  if (!value.is_number()) return wrong_type(key, value, "a number");
  const double x = value.get<double>();
  if (!(x >= low && x <= high))
    return invalid_field(key, "'" + std::string(key) + "' must be between " + std::to_string(low) +
                                  " and " + std::to_string(high) + ", got " + value.dump());
  out = x;
  return std::nullopt;
}

std::optional<ApiError> read_integer(const json& body, const char* key, int64_t low,
                                     std::optional<int64_t>& out) {
  if (!present(body, key)) return std::nullopt;
  const json& value = body[key];
  if (!value.is_number_integer()) return wrong_type(key, value, "an integer");
  if (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t{INT64_MAX})
    return invalid_field(key, "'" + std::string(key) + "' is too large");
  const int64_t x = value.get<int64_t>();
  if (x < low)
    return invalid_field(key, "'" + std::string(key) + "' must be at least " + std::to_string(low) +
                                  ", got " + std::to_string(x));
  out = x;
  return std::nullopt;
}

std::optional<ApiError> read_bool(const json& body, const char* key, bool& out) {
  if (!present(body, key)) return std::nullopt;
  if (!body[key].is_boolean()) return wrong_type(key, body[key], "a boolean");
  out = body[key].get<bool>();
  return std::nullopt;
}

// Chat content: a string, or a list of text parts (other part types are refused, not dropped).
std::optional<ApiError> read_content(const json& content, const std::string& param,
                                     std::string& out) {
  if (content.is_null()) return std::nullopt;
  if (content.is_string()) {
    out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) return wrong_type(param, content, "a string or an array of parts");
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string at = param + "[" + std::to_string(i) + "]";
    if (!part.is_object()) return wrong_type(at, part, "an object");
    if (!part.contains("type") || part["type"] != "text")
      return unsupported_field(at + ".type", "a content part other than text");
    if (!part.contains("text") || !part["text"].is_string())
      return invalid_field(at + ".text", "a text part needs 'text' (a string)");
    out += part["text"].get<std::string>();
  }
  return std::nullopt;
}

std::optional<ApiError> read_string(const json& object, const char* key, const std::string& at,
                                    std::string& out) {
  if (!present(object, key)) return std::nullopt;
  if (!object[key].is_string()) return wrong_type(at + "." + key, object[key], "a string");
  out = object[key].get<std::string>();
  return std::nullopt;
}

// OpenAI's {type: "function", function: {...}} around a tool or a tool call (`what`): the
// function object, or the error naming where the wrapper is wrong.
std::variant<const json*, ApiError> function_of(const json& item, const std::string& at,
                                                const std::string& what) {
  if (!item.is_object()) return wrong_type(at, item, "an object");
  if (item.contains("type") && item["type"] != "function")
    return unsupported_field(at + ".type", what + " other than a function");
  if (!item.contains("function") || !item["function"].is_object())
    return invalid_field(at + ".function", what + " needs 'function' (an object)");
  return &item["function"];
}

// An assistant turn's tool_calls ([{id, type: function, function: {name, arguments}}]) and a
// tool turn's tool_call_id and name, for the chat template.
std::optional<ApiError> read_tool_fields(const json& message, const std::string& at,
                                         tokenizer::ChatMessage& out) {
  if (auto error = read_string(message, "tool_call_id", at, out.tool_call_id)) return error;
  if (auto error = read_string(message, "name", at, out.name)) return error;
  if (!message.contains("tool_calls") || message["tool_calls"].is_null()) return std::nullopt;
  const json& calls = message["tool_calls"];
  if (!calls.is_array()) return wrong_type(at + ".tool_calls", calls, "an array");
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string call_at = at + ".tool_calls[" + std::to_string(i) + "]";
    const json& call = calls[i];
    auto wrapped = function_of(call, call_at, "a tool call");
    if (auto* error = std::get_if<ApiError>(&wrapped)) return *error;
    const json& function = *std::get<const json*>(wrapped);
    tokenizer::ToolCall parsed;
    if (auto error = read_string(call, "id", call_at, parsed.id)) return error;
    if (!function.contains("name") || !function["name"].is_string())
      return invalid_field(call_at + ".function.name", "a tool call needs the function's 'name'");
    parsed.name = function["name"].get<std::string>();
    if (function.contains("arguments") && !function["arguments"].is_null()) {
      const json& arguments = function["arguments"];
      parsed.arguments = arguments.is_string() ? arguments.get<std::string>() : arguments.dump();
      if (auto error =
              refuse_deep(parsed.arguments, call_at + ".function.arguments", "the arguments"))
        return error;
    } else {
      parsed.arguments = "{}";
    }
    out.tool_calls.push_back(std::move(parsed));
  }
  return std::nullopt;
}

std::optional<ApiError> read_messages(const json& body, std::vector<tokenizer::ChatMessage>& out) {
  if (!body.contains("messages")) return invalid_field("messages", "'messages' is required");
  const json& messages = body["messages"];
  if (!messages.is_array()) return wrong_type("messages", messages, "an array");
  if (messages.empty()) return invalid_field("messages", "'messages' must not be empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& message = messages[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!message.is_object()) return wrong_type(at, message, "an object");
    if (!message.contains("role") || !message["role"].is_string())
      return invalid_field(at + ".role", "each message needs a 'role' (a string)");
    std::string role = message["role"].get<std::string>();
    if (role == "developer") role = "system";  // OpenAI's newer name for the system role
    if (role == "function")
      return unsupported_field(at + ".role",
                               "the deprecated 'function' role (use 'tool' messages)");
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      return invalid_field(at + ".role", "unknown role '" + role + "'");
    // Content null or absent (an assistant turn that only calls tools) reaches the template as
    // "", as vLLM passes it: Qwen3's template tests `'</think>' in message.content`, which fails
    // on none (tried: jinja2 raises TypeError there, so transformers does too).
    tokenizer::ChatMessage parsed{role, {}};
    if (message.contains("content"))
      if (auto error = read_content(message["content"], at + ".content", parsed.content))
        return error;
    if (auto error = read_tool_fields(message, at, parsed)) return error;
    // An earlier answer's reasoning, as this server gave it out (`reasoning_content`; vLLM's
    // newer name `reasoning` too), for the templates that write it back.
    for (const char* key : {"reasoning_content", "reasoning"})
      if (parsed.reasoning_content.empty() && present(message, key))
        if (auto error = read_string(message, key, at, parsed.reasoning_content)) return error;
    out.push_back(std::move(parsed));
  }
  return std::nullopt;
}

std::optional<ApiError> read_prompt(const json& body, CompletionRequest& out) {
  if (!body.contains("prompt")) return invalid_field("prompt", "'prompt' is required");
  const json& prompt = body["prompt"];
  if (prompt.is_string()) {
    out.prompt = prompt.get<std::string>();
    return std::nullopt;
  }
  if (prompt.is_array() && !prompt.empty() && (prompt[0].is_string() || prompt[0].is_array())) {
    // A batch: strings, or token-id lists (one of them is the plain single prompt).
    if (prompt.size() > static_cast<size_t>(kMaxChoices))
      return invalid_field("prompt",
                           "at most " + std::to_string(kMaxChoices) + " prompts per request");
    for (const json& one : prompt) {
      if (one.is_string() && prompt[0].is_string()) {
        out.batch_prompts.push_back(one.get<std::string>());
        continue;
      }
      if (!one.is_array() || !prompt[0].is_array() || one.empty())
        return invalid_field(
            "prompt", "a list of prompts must be all strings or all non-empty lists of token ids");
      std::vector<int32_t>& ids = out.batch_prompt_tokens.emplace_back();
      for (const json& id : one) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
          return invalid_field("prompt", "a token id must be an integer in [0, 2^31)");
        ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
    }
    // One of them is the plain single prompt.
    if (out.batch_prompts.size() == 1) {
      out.prompt = std::move(out.batch_prompts[0]);
      out.batch_prompts.clear();
    }
    if (out.batch_prompt_tokens.size() == 1) {
      out.prompt_tokens = std::move(out.batch_prompt_tokens[0]);
      out.batch_prompt_tokens.clear();
    }
    return std::nullopt;
  }
  if (prompt.is_array() && !prompt.empty()) {
    for (const json& id : prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        return invalid_field("prompt",
                             "'prompt' must be a string, a list of one string or a list of "
                             "token ids");
      out.prompt_tokens.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    return std::nullopt;
  }
  return wrong_type("prompt", prompt, "a string or an array");
}

// vLLM's stop_token_ids: token ids (at most model::kMaxStopTokenIds) that end the answer.
std::optional<ApiError> read_stop_token_ids(const json& body, std::vector<int32_t>& out) {
  if (!present(body, "stop_token_ids")) return std::nullopt;
  const json& ids = body["stop_token_ids"];
  if (!ids.is_array()) return wrong_type("stop_token_ids", ids, "an array of token ids");
  if (ids.size() > model::kMaxStopTokenIds)
    return invalid_field("stop_token_ids", "'stop_token_ids' may name at most " +
                                               std::to_string(model::kMaxStopTokenIds) + " tokens");
  for (const json& id : ids) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      return invalid_field(
          "stop_token_ids",
          "'stop_token_ids' must hold token ids (integers >= 0), got " + id.dump());
    out.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return std::nullopt;
}

std::optional<ApiError> read_stop(const json& body, std::vector<std::string>& out) {
  if (!body.contains("stop") || body["stop"].is_null()) return std::nullopt;
  return read_stop_strings(body["stop"], "stop", out);
}

// n: 1 .. kMaxChoices choices (/generate answers one text: n > 1 is refused there).
std::optional<ApiError> read_choices(Endpoint endpoint, const json& body, int64_t& out) {
  std::optional<int64_t> n;
  if (auto error = read_integer(body, "n", 1, n)) return error;
  if (!n) return std::nullopt;
  if (*n > 1 && endpoint == Endpoint::kGenerate)
    return unsupported_field("n", "n > 1 on /generate");
  if (*n > kMaxChoices)
    return invalid_field(
        "n", "'n' must be at most " + std::to_string(kMaxChoices) + ", got " + std::to_string(*n));
  out = *n;
  return std::nullopt;
}

// What OpenAI's API can ask for and this server does not do: refused when it would change the
// answer (a client that sends the neutral value, `"tools": []`, `"suffix": ""`, is served), so
// that nobody gets an answer that silently ignores it.
std::optional<ApiError> refuse_unserved(const json& body, int64_t n) {
  if (present(body, "functions")) {
    if (!body["functions"].is_array())
      return wrong_type("functions", body["functions"], "an array");
    if (!body["functions"].empty()) return unsupported_field("functions", "functions (use tools)");
  }
  if (present(body, "suffix")) {
    if (!body["suffix"].is_string()) return wrong_type("suffix", body["suffix"], "a string");
    if (!body["suffix"].get<std::string>().empty()) return unsupported_field("suffix", "suffix");
  }
  std::optional<int64_t> best_of;
  if (auto error = read_integer(body, "best_of", 1, best_of)) return error;
  if (best_of && *best_of < n) return invalid_field("best_of", "'best_of' must be at least 'n'");
  if (best_of && *best_of > n) return unsupported_field("best_of", "best_of greater than n");
  return std::nullopt;
}

// Chat: the tools on offer ([{type: function, function: {name, description, parameters}}]) and
// tool_choice: "auto" (the default), "none" (the tools are then not shown to the model),
// "required" (a call to one of them) or {"type": "function", "function": {"name"}} (a call to
// that one), the forced ones decoded under the calls' grammar. The tools go to the chat template
// as the body wrote them (its key order kept).
std::optional<ApiError> read_tools(const json& body, const std::string& text,
                                   CompletionRequest& out) {
  using ToolChoice = CompletionRequest::ToolChoice;
  if (auto error = read_bool(body, "parallel_tool_calls", out.parallel_tool_calls)) return error;
  std::string choice = "auto";
  if (present(body, "tool_choice")) {
    const json& tool_choice = body["tool_choice"];
    if (tool_choice.is_object()) {
      const json* function = tool_choice.contains("function") ? &tool_choice["function"] : nullptr;
      if (tool_choice.value("type", json()) != "function" || function == nullptr ||
          !function->is_object() || !function->contains("name") || !(*function)["name"].is_string())
        return invalid_field(
            "tool_choice",
            "a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": "
            "NAME}}");
      out.tool_choice = ToolChoice::kFunction;
      out.tool_choice_function = (*function)["name"].get<std::string>();
    } else if (!tool_choice.is_string()) {
      return wrong_type("tool_choice", tool_choice,
                        "\"auto\", \"none\", \"required\" or an object");
    } else {
      choice = tool_choice.get<std::string>();
      if (choice != "auto" && choice != "none" && choice != "required")
        return invalid_field(
            "tool_choice",
            "'tool_choice' must be \"auto\", \"none\" or \"required\", got \"" + choice + "\"");
      if (choice == "none") out.tool_choice = ToolChoice::kNone;
      if (choice == "required") out.tool_choice = ToolChoice::kRequired;
    }
  }
  const bool forced =
      out.tool_choice == ToolChoice::kRequired || out.tool_choice == ToolChoice::kFunction;
  if (!present(body, "tools") || (body["tools"].is_array() && body["tools"].empty())) {
    if (forced)
      return invalid_field("tool_choice", "'tool_choice' forces a call, but there are no 'tools'");
    if (!present(body, "tools")) return std::nullopt;
  }
  const json& tools = body["tools"];
  if (!tools.is_array()) return wrong_type("tools", tools, "an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string at = "tools[" + std::to_string(i) + "]";
    auto wrapped = function_of(tools[i], at, "a tool");
    if (auto* error = std::get_if<ApiError>(&wrapped)) return *error;
    const json& function = *std::get<const json*>(wrapped);
    if (!function.contains("name") || !function["name"].is_string() ||
        function["name"].get<std::string>().empty())
      return invalid_field(at + ".function.name", "a tool's function needs a 'name'");
    if (function.contains("parameters") && !function["parameters"].is_null() &&
        !function["parameters"].is_object())
      return wrong_type(at + ".function.parameters", function["parameters"], "an object");
  }
  if (out.tool_choice == ToolChoice::kFunction &&
      std::none_of(tools.begin(), tools.end(), [&](const json& tool) {
        return tool["function"]["name"] == out.tool_choice_function;
      }))
    return invalid_field("tool_choice", "'tool_choice' names the function '" +
                                            out.tool_choice_function +
                                            "', which is not one of the 'tools'");
  if (tools.empty() || choice == "none") return std::nullopt;
  out.chat.tools_json =
      nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false)["tools"].dump();
  return std::nullopt;
}

// Chat: "logprobs" true/false and "top_logprobs" 0..20; completions: "logprobs" N, the number
// of alternatives (0: only the chosen token's).
std::optional<ApiError> read_logprobs(Endpoint endpoint, const json& body, CompletionRequest& out) {
  std::optional<int64_t> top;
  if (endpoint == Endpoint::kChat) {
    if (auto error = read_bool(body, "logprobs", out.logprobs)) return error;
    if (auto error = read_integer(body, "top_logprobs", 0, top)) return error;
    if (top && *top > 0 && !out.logprobs)
      return invalid_field("top_logprobs", "'top_logprobs' needs \"logprobs\": true");
  } else {
    if (auto error = read_integer(body, "logprobs", 0, top)) return error;
    out.logprobs = top.has_value();
  }
  if (top && *top > model::kMaxTopLogprobs)
    return invalid_field(
        endpoint == Endpoint::kChat ? "top_logprobs" : "logprobs",
        "at most " + std::to_string(model::kMaxTopLogprobs) + " log-probabilities");
  out.top_logprobs = top.value_or(0);
  return read_bool(body, "return_tokens_as_token_ids", out.return_tokens_as_token_ids);
}

// {"token id": bias in [-100, 100], ...}, as OpenAI takes it (the ids as the object's keys).
std::optional<ApiError> read_logit_bias(const json& body, CompletionRequest& out) {
  if (!present(body, "logit_bias")) return std::nullopt;
  const json& bias = body["logit_bias"];
  if (!bias.is_object()) return wrong_type("logit_bias", bias, "an object");
  if (bias.size() > model::kMaxLogitBias)
    return invalid_field("logit_bias", "'logit_bias' may bias at most " +
                                           std::to_string(model::kMaxLogitBias) + " tokens");
  for (const auto& [key, value] : bias.items()) {
    int64_t token = -1;
    const auto [end, error] = std::from_chars(key.data(), key.data() + key.size(), token);
    if (error != std::errc() || end != key.data() + key.size() || token < 0 || token > INT32_MAX)
      return invalid_field("logit_bias",
                           "'logit_bias' keys must be token ids, got \"" + key + "\"");
    if (!value.is_number()) return wrong_type("logit_bias", value, "a number");
    const double x = value.get<double>();
    if (!(x >= -model::kMaxBias && x <= model::kMaxBias))
      return invalid_field("logit_bias",
                           "'logit_bias' values must be between -100 and 100, got " + value.dump());
    out.logit_bias.emplace_back(static_cast<int32_t>(token), static_cast<float>(x));
  }
  return std::nullopt;
}

std::optional<ApiError> read_penalties(const json& body, CompletionRequest& out) {
  if (auto error = read_number(body, "presence_penalty", -2.0, 2.0, out.presence_penalty))
    return error;
  if (auto error = read_number(body, "frequency_penalty", -2.0, 2.0, out.frequency_penalty))
    return error;
  if (auto error = read_number(body, "repetition_penalty", 0.0, 1e9, out.repetition_penalty))
    return error;
  if (out.repetition_penalty <= 0)
    return invalid_field("repetition_penalty", "'repetition_penalty' must be greater than 0");
  return read_number(body, "min_p", 0.0, 1.0, out.min_p);
}

std::optional<ApiError> read_sampling(const json& body, CompletionRequest& out) {
  std::optional<int64_t> max_tokens;
  // 0 only with echo (checked once echo is read): the prompt scored, nothing generated.
  if (auto error = read_integer(body, "max_tokens", 0, max_tokens)) return error;
  if (auto error = read_integer(body, "max_completion_tokens", 0, out.max_tokens)) return error;
  if (max_tokens) out.max_tokens = max_tokens;
  std::optional<int64_t> min_tokens;
  if (auto error = read_integer(body, "min_tokens", 0, min_tokens)) return error;
  out.min_tokens = min_tokens.value_or(0);
  if (out.max_tokens && out.min_tokens > *out.max_tokens)
    return invalid_field("min_tokens", "'min_tokens' must be at most max_tokens (" +
                                           std::to_string(*out.max_tokens) + "), got " +
                                           std::to_string(out.min_tokens));
  if (auto error = read_number(body, "temperature", 0.0, 2.0, out.temperature)) return error;
  if (auto error = read_number(body, "top_p", 0.0, 1.0, out.top_p)) return error;
  std::optional<int64_t> top_k;
  if (auto error = read_integer(body, "top_k", -1, top_k)) return error;
  out.top_k = top_k && *top_k > 0 ? *top_k : 0;  // -1 and 0: no top-k (vLLM's convention)
  if (out.top_p <= 0) {  // OpenAI takes 0: the smallest nucleus, the most likely token alone
    out.top_p = 1.0;
    out.top_k = 1;
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) return wrong_type("seed", body["seed"], "an integer");
    out.seed = body["seed"].is_number_unsigned()
                   ? body["seed"].get<uint64_t>()
                   : static_cast<uint64_t>(body["seed"].get<int64_t>());
  }
  return read_stop(body, out.stop);
}

std::optional<ApiError> read_stream(const json& body, CompletionRequest& out) {
  if (auto error = read_bool(body, "stream", out.stream)) return error;
  if (!body.contains("stream_options") || body["stream_options"].is_null()) return std::nullopt;
  const json& options = body["stream_options"];
  if (!options.is_object()) return wrong_type("stream_options", options, "an object");
  if (!out.stream)
    return invalid_field("stream_options", "'stream_options' needs \"stream\": true");
  if (auto error = read_bool(options, "include_usage", out.include_usage)) return error;
  return read_bool(options, "continuous_usage_stats", out.continuous_usage);
}

std::optional<ApiError> read_chat_options(const json& body, CompletionRequest& out) {
  if (auto error = read_bool(body, "add_generation_prompt", out.chat.add_generation_prompt))
    return error;
  // vLLM's: the model continues the final message (an assistant's answer begun for it). Only
  // an explicit add_generation_prompt true conflicts with it, as vLLM checks.
  if (auto error = read_bool(body, "continue_final_message", out.chat.continue_final_message))
    return error;
  if (out.chat.continue_final_message) {
    if (present(body, "add_generation_prompt") && out.chat.add_generation_prompt)
      return invalid_field("continue_final_message",
                           "'continue_final_message' and 'add_generation_prompt' cannot both be "
                           "true");
    out.chat.add_generation_prompt = false;
  }
  if (!body.contains("chat_template_kwargs") || body["chat_template_kwargs"].is_null())
    return std::nullopt;
  const json& kwargs = body["chat_template_kwargs"];
  if (!kwargs.is_object()) return wrong_type("chat_template_kwargs", kwargs, "an object");
  if (kwargs.contains("enable_thinking")) {
    bool thinking = true;
    if (auto error = read_bool(kwargs, "enable_thinking", thinking)) return error;
    out.chat.enable_thinking = thinking;
  }
  // The others go to the template as they are (a Jinja template reads what it uses), except
  // the variables the renderer sets, which a request may not replace.
  json others = json::object();
  for (const auto& [name, value] : kwargs.items()) {
    if (name == "enable_thinking") continue;
    if (tokenizer::reserved_template_variable(name))
      return invalid_field("chat_template_kwargs." + name,
                           "'" + name + "' is set by the server, not by chat_template_kwargs");
    others[name] = value;
  }
  if (!others.empty()) out.chat.template_kwargs_json = others.dump();
  return std::nullopt;
}

// OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or {"type":
// "json_schema", "json_schema": {"name", "description", "schema", "strict"}}. The schema is read
// from the body's text so that its properties keep their order, and compiled here so that a
// schema outside the supported subset is a 400 that names the keyword.
std::optional<ApiError> read_response_format(const json& body, const std::string& text,
                                             CompletionRequest& out) {
  if (!present(body, "response_format")) return std::nullopt;
  const json& format = body["response_format"];
  if (!format.is_object()) return wrong_type("response_format", format, "an object");
  if (!format.contains("type") || !format["type"].is_string())
    return invalid_field(
        "response_format.type",
        "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
  const std::string type = format["type"].get<std::string>();
  if (type == "text") return std::nullopt;
  if (type == "json_object") {
    out.structured = sdk::StructuredOutput::kJsonObject;
    return std::nullopt;
  }
  if (type != "json_schema")
    return unsupported_field("response_format.type", "response_format " + format["type"].dump());
  if (!format.contains("json_schema") || !format["json_schema"].is_object())
    return invalid_field(
        "response_format.json_schema",
        "'response_format.json_schema' must be an object with the schema in 'schema'");
  const json& spec = format["json_schema"];
  if (!present(spec, "schema")) {  // optional in OpenAI's API: a JSON object, as json_object
    out.structured = sdk::StructuredOutput::kJsonObject;
    return std::nullopt;
  }
  if (!(spec["schema"].is_object() || spec["schema"].is_boolean()))
    return invalid_field("response_format.json_schema.schema",
                         "'response_format.json_schema.schema' must be a JSON Schema (an object)");
  const auto ordered = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  out.structured = sdk::StructuredOutput::kJsonSchema;
  out.json_schema = ordered["response_format"]["json_schema"]["schema"].dump();
  if (auto grammar = model::JsonGrammar::compile(out.json_schema); !grammar)
    return invalid_field("response_format.json_schema.schema", grammar.error().message);
  return std::nullopt;
}

// A schema as vLLM's guided decoding takes it: an object (or true/false), or its JSON text; its
// text in its own key order (the answer's property order) is written to out.json_schema.
std::optional<ApiError> read_guided_schema(const nlohmann::ordered_json& schema,
                                           const std::string& param, CompletionRequest& out) {
  nlohmann::ordered_json parsed = schema;
  if (schema.is_string()) {
    if (auto error = refuse_deep(schema.get_ref<const std::string&>(), param, "'" + param + "'"))
      return error;
    parsed = nlohmann::ordered_json::parse(schema.get<std::string>(), nullptr,
                                           /*allow_exceptions=*/false);
    if (parsed.is_discarded())
      return invalid_field(param, "'" + param + "' is a string that is not JSON");
  }
  if (!(parsed.is_object() || parsed.is_boolean()))
    return invalid_field(param, "'" + param + "' must be a JSON Schema (an object or its text)");
  out.structured = sdk::StructuredOutput::kJsonSchema;
  out.json_schema = parsed.dump();
  if (auto grammar = model::JsonGrammar::compile(out.json_schema); !grammar)
    return invalid_field(param, grammar.error().message);
  return std::nullopt;
}

// vLLM's guided decoding: its older fields (guided_json, guided_regex, guided_choice,
// guided_grammar, structural_tag) and its newer object (structured_outputs: json, json_object,
// regex, choice, grammar, structural_tag). A JSON schema or object is served as response_format
// is; the other kinds are refused rather than ignored (the answer would not be what was asked).
// One kind per request, response_format included, as vLLM requires. Backend and whitespace
// options (guided_decoding_backend, disable_any_whitespace, ...) change no answer's meaning and
// are ignored.
std::optional<ApiError> read_guided(const json& body, const std::string& text,
                                    CompletionRequest& out) {
  struct Kind {
    std::string param;
    const json* value;
  };
  std::vector<Kind> kinds;
  for (const char* key : {"guided_json", "guided_regex", "guided_choice", "guided_grammar"})
    if (present(body, key)) kinds.push_back({key, &body[key]});
  const json* outputs = present(body, "structured_outputs") ? &body["structured_outputs"] : nullptr;
  if (outputs) {
    if (!outputs->is_object()) return wrong_type("structured_outputs", *outputs, "an object");
    for (const char* key : {"json", "regex", "choice", "grammar", "structural_tag"})
      if (present(*outputs, key))
        kinds.push_back({std::string("structured_outputs.") + key, &(*outputs)[key]});
    if (present(*outputs, "json_object")) {
      const json& flag = (*outputs)["json_object"];
      if (!flag.is_boolean())
        return wrong_type("structured_outputs.json_object", flag, "a boolean");
      if (flag.get<bool>()) kinds.push_back({"structured_outputs.json_object", &flag});
    }
  }
  if (present(body, "structural_tag")) kinds.push_back({"structural_tag", &body["structural_tag"]});
  if (kinds.empty()) return std::nullopt;
  if (kinds.size() > 1 || out.structured != sdk::StructuredOutput::kNone)
    return invalid_field(kinds.back().param,
                         "only one kind of structured output per request: '" + kinds.back().param +
                             "' with " +
                             (kinds.size() > 1 ? "'" + kinds.front().param + "'"
                                               : std::string("'response_format'")));
  const Kind& kind = kinds.front();
  if (kind.param == "structured_outputs.json_object") {
    out.structured = sdk::StructuredOutput::kJsonObject;
    return std::nullopt;
  }
  if (kind.param != "guided_json" && kind.param != "structured_outputs.json")
    return unsupported_field(kind.param, kind.param +
                                             " (structured output here is JSON: guided_json, "
                                             "structured_outputs.json or response_format)");
  // The schema's own key order, from the body's text.
  const auto ordered = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  const nlohmann::ordered_json& schema =
      kind.param == "guided_json" ? ordered["guided_json"] : ordered["structured_outputs"]["json"];
  return read_guided_schema(schema, kind.param, out);
}

std::variant<json, ApiError> parse_object(const std::string& body) {
  // Parts of the body (tools, a schema) are written back as text, which recurses.
  if (auto error = refuse_deep(body, "", "the body")) return *error;
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return invalid_field("", "the body is not valid JSON");
  if (!parsed.is_object()) return invalid_field("", "the body must be a JSON object");
  return parsed;
}

std::optional<ApiError> read_model(const json& body, std::string& out) {
  if (!present(body, "model")) return std::nullopt;
  if (!body["model"].is_string()) return wrong_type("model", body["model"], "a string");
  out = body["model"].get<std::string>();
  return std::nullopt;
}

std::optional<ApiError> read_all(Endpoint endpoint, const json& body, const std::string& text,
                                 CompletionRequest& out) {
  if (auto error = read_model(body, out.model)) return error;
  if (body.contains("user") && !body["user"].is_null()) {
    if (!body["user"].is_string()) return wrong_type("user", body["user"], "a string");
    out.user = body["user"].get<std::string>();
  }
  if (endpoint == Endpoint::kChat) {
    if (auto error = read_messages(body, out.messages)) return error;
    if (auto error = read_tools(body, text, out)) return error;
    if (auto error = read_chat_options(body, out)) return error;
  } else if (auto error = read_prompt(body, out)) {
    return error;
  }
  if (auto error = read_choices(endpoint, body, out.n)) return error;
  if (endpoint == Endpoint::kGenerate && out.prompt_count() > 1)
    return unsupported_field("prompt", "more than one prompt on /generate");
  if (auto error = refuse_unserved(body, out.n)) return error;
  if (auto error = read_response_format(body, text, out)) return error;
  if (auto error = read_guided(body, text, out)) return error;
  if (auto error = read_sampling(body, out)) return error;
  if (out.min_tokens > 0 && out.structured != sdk::StructuredOutput::kNone)
    return invalid_field("min_tokens",
                         "'min_tokens' cannot be combined with structured output: the grammar "
                         "decides where the answer ends");
  if (auto error = read_penalties(body, out)) return error;
  if (auto error = read_logit_bias(body, out)) return error;
  if (endpoint != Endpoint::kGenerate)
    if (auto error = read_logprobs(endpoint, body, out)) return error;
  if (auto error = read_bool(body, "echo", out.echo)) return error;
  if (out.echo && endpoint != Endpoint::kCompletions)
    return unsupported_field("echo", "echo outside /v1/completions");
  if (out.max_tokens == 0 && !out.echo)
    return invalid_field(
        "max_tokens",
        "'max_tokens' must be at least 1, got 0 (0 only with echo: the prompt alone, "
        "scored with logprobs)");
  if (auto error = read_bool(body, "ignore_eos", out.ignore_eos)) return error;
  if (auto error = read_bool(body, "skip_special_tokens", out.skip_special_tokens)) return error;
  if (auto error = read_stop_token_ids(body, out.stop_token_ids)) return error;
  if (auto error = read_bool(body, "include_stop_str_in_output", out.include_stop_str_in_output))
    return error;
  if (endpoint == Endpoint::kGenerate) return std::nullopt;
  return read_stream(body, out);
}

}  // namespace

json ApiError::body() const {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

std::variant<CompletionRequest, ApiError> parse_request(Endpoint endpoint,
                                                        const std::string& body) {
  auto parsed = parse_object(body);
  if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
  CompletionRequest request;
  request.endpoint = endpoint;
  if (auto error = read_all(endpoint, std::get<json>(parsed), body, request)) return *error;
  return request;
}

std::variant<TokenizeRequest, ApiError> parse_tokenize(const std::string& body) {
  auto parsed = parse_object(body);
  if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
  const json& object = std::get<json>(parsed);
  TokenizeRequest out;
  if (auto error = read_model(object, out.text.model)) return *error;
  out.chat = present(object, "messages");
  if (out.chat) {
    out.text.endpoint = Endpoint::kChat;
    out.add_special_tokens = false;
    if (auto error = read_messages(object, out.text.messages)) return *error;
    if (auto error = read_tools(object, body, out.text)) return *error;
    if (auto error = read_chat_options(object, out.text)) return *error;
  } else {
    out.text.endpoint = Endpoint::kCompletions;
    if (!present(object, "prompt"))
      return invalid_field("prompt", "'prompt' or 'messages' is required");
    if (!object["prompt"].is_string()) return wrong_type("prompt", object["prompt"], "a string");
    out.text.prompt = object["prompt"].get<std::string>();
  }
  if (auto error = read_bool(object, "add_special_tokens", out.add_special_tokens)) return *error;
  if (auto error = read_bool(object, "return_token_strs", out.return_token_strs)) return *error;
  return out;
}

std::variant<DetokenizeRequest, ApiError> parse_detokenize(const std::string& body) {
  auto parsed = parse_object(body);
  if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
  const json& object = std::get<json>(parsed);
  DetokenizeRequest out;
  if (auto error = read_model(object, out.model)) return *error;
  if (!present(object, "tokens")) return invalid_field("tokens", "'tokens' is required");
  const json& tokens = object["tokens"];
  if (!tokens.is_array()) return wrong_type("tokens", tokens, "an array of token ids");
  for (const json& id : tokens) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max())
      return invalid_field("tokens",
                           "'tokens' must hold token ids (integers >= 0), got " + id.dump());
    out.tokens.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return out;
}

ApiError gateway_error(int code, const std::string& name, const std::string& message) {
  ApiError error;
  error.message = message.empty() ? name : message;
  error.code = name;
  switch (code) {
    case 1:
    case 2:
    case 3:  // InvalidRequest, PromptTooLong, InvalidSampling
      error.status = 400;
      if (code == 2) error.code = "context_length_exceeded";
      break;
    case 4:   // UnknownTenant
    case 16:  // Forbidden
      error.status = 403;
      error.type = "permission_error";
      break;
    case 15:  // Unauthenticated
      error.status = 401;
      error.type = "authentication_error";
      error.code = "invalid_api_key";
      break;
    case 10:  // Overloaded
      error.status = 429;
      error.type = "rate_limit_error";
      error.code = "overloaded";
      break;
    case 7:  // DeadlineExceeded
      error.status = 504;
      error.type = "timeout_error";
      break;
    case 8:
    case 9:
    case 17:  // Cancelled, StageFailed, Draining
      error.status = 503;
      error.type = "service_unavailable";
      break;
    default:
      error.status = 500;
      error.type = "server_error";
  }
  return error;
}

json usage_json(const sdk::Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", usage.reused_tokens}}}};
}

json extension_json(const Completion& completion) {
  const sdk::Usage& usage = completion.usage;
  const sdk::Timings& timings = completion.timings;
  json extension = {{"fallback", completion.fallback},
                    {"reuse_level", usage.reuse_level.empty() ? "none" : usage.reuse_level},
                    {"reused_tokens", usage.reused_tokens},
                    {"timings",
                     {{"queue_ms", timings.queue_ms},
                      {"prefill_ms", timings.prefill_ms},
                      {"ttft_ms", timings.ttft_ms},
                      {"total_ms", timings.total_ms}}}};
  if (!usage.approximate.empty()) {
    extension["approximate"] = usage.approximate;
    extension["similarity"] = usage.similarity;
  }
  return extension;
}

sdk::Usage combined_usage(std::span<const Completion> choices, int64_t n) {
  sdk::Usage usage = choices.front().usage;
  usage.prompt_tokens = usage.completion_tokens = usage.reused_tokens = 0;
  for (size_t i = 0; i < choices.size(); ++i) {
    const sdk::Usage& one = choices[i].usage;
    usage.completion_tokens += one.completion_tokens;
    if (static_cast<int64_t>(i) % std::max<int64_t>(1, n) != 0) continue;  // its prompt's again
    usage.prompt_tokens += one.prompt_tokens;
    usage.reused_tokens += one.reused_tokens;
  }
  return usage;
}

namespace {}  // namespace

json completion_response(Endpoint endpoint, std::span<const Completion> choices, int64_t n) {
  json listed = json::array();
  for (const Completion& completion : choices) {
    json choice = {{"index", completion.index},
                   {"logprobs", completion.logprobs},
                   {"finish_reason", completion.finish_reason},
                   {"stop_reason", completion.stop_reason}};
    if (endpoint == Endpoint::kChat) {
      choice["message"] = {{"role", "assistant"}, {"content", completion.text}};
      if (!completion.reasoning.empty())
        choice["message"]["reasoning_content"] = completion.reasoning;
      if (!completion.tool_calls.empty()) {
        // OpenAI's shape: content null where the turn is only calls.
        if (completion.text.empty()) choice["message"]["content"] = nullptr;
        json calls = json::array();
        for (const ToolCallOut& call : completion.tool_calls)
          calls.push_back({{"id", call.id},
                           {"type", "function"},
                           {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
        choice["message"]["tool_calls"] = std::move(calls);
      }
    } else {
      choice["text"] = completion.text;
    }
    listed.push_back(std::move(choice));
  }
  const Completion& first = choices.front();
  return {{"id", first.id},
          {"object", endpoint == Endpoint::kChat ? "chat.completion" : "text_completion"},
          {"created", first.created},
          {"model", first.model},
          {"choices", std::move(listed)},
          {"usage", usage_json(combined_usage(choices, n))},
          {"moeline", extension_json(first)}};
}

json stream_chunk(Endpoint endpoint, const Completion& completion, const std::string& text,
                  bool first, const std::string& finish_reason, const json& logprobs,
                  DeltaField field) {
  json choice = {{"index", completion.index},
                 {"logprobs", logprobs},
                 {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  if (!finish_reason.empty()) choice["stop_reason"] = completion.stop_reason;
  if (endpoint == Endpoint::kChat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (finish_reason.empty() || !text.empty())
      delta[field == DeltaField::kReasoning ? "reasoning_content" : "content"] = text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  return {{"id", completion.id},
          {"object", endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", completion.created},
          {"model", completion.model},
          {"choices", json::array({choice})}};
}

TokenEvents::TokenEvents(Endpoint endpoint, const Completion& completion, DeltaField field) {
  // stream_chunk's keys in nlohmann::json's (sorted) order, with the text cut out.
  const std::string marker = "\x01";
  const std::string whole =
      "data: " + to_text(stream_chunk(endpoint, completion, marker, false, "", nullptr, field)) +
      "\n\n";
  const std::string quoted = json(marker).dump();
  const size_t at = whole.find(quoted);
  prefix_ = whole.substr(0, at);
  suffix_ = whole.substr(at + quoted.size());
}

std::string TokenEvents::event(const std::string& text, const sdk::Usage* usage) const {
  std::string out = prefix_ + to_text(json(text)) + suffix_;
  if (usage == nullptr) return out;
  // "usage" sorts after the chunk's other keys: it goes before the closing brace ("}\n\n"),
  // written as usage_json's (sorted) keys.
  out.resize(out.size() - 3);
  const auto number = [](uint64_t n) { return std::to_string(n); };
  out += ",\"usage\":{\"completion_tokens\":" + number(usage->completion_tokens) +
         ",\"prompt_tokens\":" + number(usage->prompt_tokens) +
         ",\"prompt_tokens_details\":{\"cached_tokens\":" + number(usage->reused_tokens) +
         "},\"total_tokens\":" + number(uint64_t{usage->prompt_tokens} + usage->completion_tokens) +
         "}}\n\n";
  return out;
}

json tool_calls_chunk(const Completion& completion) {
  json calls = json::array();
  for (size_t i = 0; i < completion.tool_calls.size(); ++i) {
    const ToolCallOut& call = completion.tool_calls[i];
    calls.push_back({{"index", i},
                     {"id", call.id},
                     {"type", "function"},
                     {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
  }
  json choice = {{"index", completion.index},
                 {"logprobs", nullptr},
                 {"finish_reason", nullptr},
                 {"delta", {{"tool_calls", std::move(calls)}}}};
  return {{"id", completion.id},
          {"object", "chat.completion.chunk"},
          {"created", completion.created},
          {"model", completion.model},
          {"choices", json::array({choice})}};
}

json usage_chunk(Endpoint endpoint, const Completion& completion) {
  return {{"id", completion.id},
          {"object", endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", completion.created},
          {"model", completion.model},
          {"choices", json::array()},
          {"usage", usage_json(completion.usage)},
          {"moeline", extension_json(completion)}};
}

std::string to_text(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string random_id(const std::string& prefix, size_t length, std::string_view alphabet) {
  thread_local std::mt19937_64 random(std::random_device{}());
  std::string id = prefix;
  for (size_t i = 0; i < length; ++i) id += alphabet[random() % alphabet.size()];
  return id;
}

std::string new_completion_id(Endpoint endpoint) {
  return random_id(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-");
}

std::optional<ApiError> read_stop_strings(const json& value, const std::string& param,
                                          std::vector<std::string>& out) {
  if (value.is_string()) {
    out.push_back(value.get<std::string>());
  } else {
    if (!value.is_array()) return wrong_type(param, value, "a string or an array of strings");
    // vLLM takes more than OpenAI's 4 (evaluation harnesses send 5 or more).
    if (value.size() > kMaxStopStrings)
      return invalid_field(param, "at most " + std::to_string(kMaxStopStrings) + " stop sequences");
    for (const json& s : value) {
      if (!s.is_string()) return wrong_type(param, s, "a string");
      out.push_back(s.get<std::string>());
    }
  }
  for (const std::string& s : out)
    if (s.size() > kMaxStopStringBytes)
      return invalid_field(
          param, "a stop sequence is at most " + std::to_string(kMaxStopStringBytes) + " bytes");
  return std::nullopt;
}

}  // namespace moeline::stages::http
