// Anthropic's Messages API over the chat front (stages/http/messages.h), and what it reads of
// the chat stream: vLLM's stop_reason and continuous usage.

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "stages/http/messages.h"
#include "stages/http/openai.h"
#include "stages/http/stop_matcher.h"
#include "stages/http/token_stream.h"

namespace moeline::stages::http {
namespace {

using nlohmann::json;

json chat_of(const std::string& body, MessagesUse use = MessagesUse::kGenerate) {
  const auto parsed = parse_messages_request(body, use);
  if (const auto* error = std::get_if<ApiError>(&parsed)) {
    ADD_FAILURE() << body << ": " << error->message;
    return json();
  }
  return json::parse(std::get<MessagesRequest>(parsed).chat_body);
}

// A conversation with every kind of block: the system blocks joined into a system message, a
// user's text blocks into one message, an assistant's thinking, text and tool_use into one turn
// (the call's input as its arguments' JSON), each tool_result a tool message in the order given
// (an error's result said to be one), and the tools, tool_choice, thinking, stop_sequences,
// metadata and stream as chat's fields.
TEST(MessagesApi, ContentBlocksBecomeTheChatMessages) {
  const json chat = chat_of(R"({"model": "m", "max_tokens": 64,
      "system": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools.",
                  "cache_control": {"type": "ephemeral"}}],
      "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                     {"type": "text", "text": "in Paris and Rome?"}]},
        {"role": "assistant", "content": [
          {"type": "thinking", "thinking": "Two calls.", "signature": "s"},
          {"type": "text", "text": "Checking."},
          {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
          {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
          {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
          {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
           "content": [{"type": "text", "text": "no data"}]},
          {"type": "text", "text": "And tomorrow?"}]},
        {"role": "assistant", "content": "Let me see."}],
      "tools": [{"name": "weather", "description": "A city's weather",
                 "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
      "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
      "thinking": {"type": "enabled", "budget_tokens": 1024},
      "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5,
      "metadata": {"user_id": "u1"}, "stream": true})");
  const json& messages = chat["messages"];
  ASSERT_EQ(messages.size(), 7u) << chat;
  EXPECT_EQ(messages[0], (json{{"role", "system"}, {"content", "Be brief. Use tools."}}));
  EXPECT_EQ(messages[1], (json{{"role", "user"}, {"content", "Weather in Paris and Rome?"}}));
  EXPECT_EQ(messages[2]["content"], "Checking.");
  EXPECT_EQ(messages[2]["reasoning_content"], "Two calls.");
  ASSERT_EQ(messages[2]["tool_calls"].size(), 2u);
  EXPECT_EQ(messages[2]["tool_calls"][1]["id"], "toolu_2");
  EXPECT_EQ(json::parse(messages[2]["tool_calls"][1]["function"]["arguments"].get<std::string>()),
            (json{{"city", "Rome"}}));
  EXPECT_EQ(messages[3],
            (json{{"role", "tool"}, {"tool_call_id", "toolu_1"}, {"content", "sunny"}}));
  EXPECT_EQ(messages[4]["content"], "Error: no data");
  EXPECT_EQ(messages[5], (json{{"role", "user"}, {"content", "And tomorrow?"}}));
  EXPECT_EQ(messages[6], (json{{"role", "assistant"}, {"content", "Let me see."}}));
  EXPECT_EQ(chat["tools"][0]["function"]["parameters"]["properties"]["city"]["type"], "string");
  EXPECT_EQ(chat["tools"][0]["function"]["description"], "A city's weather");
  EXPECT_EQ(chat["tool_choice"], "required");
  EXPECT_EQ(chat["parallel_tool_calls"], false);
  EXPECT_EQ(chat["chat_template_kwargs"]["enable_thinking"], true);
  EXPECT_EQ(chat["stop"], json::array({"END"}));
  EXPECT_EQ(chat["max_tokens"], 64);
  EXPECT_EQ(chat["top_k"], 5);
  EXPECT_EQ(chat["user"], "u1");
  EXPECT_EQ(chat["stream_options"]["continuous_usage_stats"], true);
  // The final assistant turn is the answer's start, which the model continues (the prefill).
  EXPECT_EQ(chat["continue_final_message"], true);
  EXPECT_FALSE(chat_of(R"({"model": "m", "max_tokens": 1, "messages": [{"role": "user",
      "content": "x"}]})")
                   .contains("continue_final_message"));
  // The chat request it becomes is one the chat parser takes.
  EXPECT_TRUE(
      std::holds_alternative<CompletionRequest>(parse_request(Endpoint::kChat, chat.dump())));
  // tool_choice and thinking's other forms.
  EXPECT_EQ(chat_of(R"({"model": "m", "max_tokens": 1, "messages": [{"role": "user",
      "content": "x"}], "tool_choice": {"type": "tool", "name": "f"},
      "thinking": {"type": "disabled"}})")["tool_choice"]["function"]["name"],
            "f");
  EXPECT_EQ(chat_of(R"({"model": "m", "max_tokens": 1, "messages": [{"role": "user",
      "content": "x"}], "tool_choice": {"type": "none"}})")["tool_choice"],
            "none");
  // Counting tokens needs no max_tokens.
  EXPECT_EQ(chat_of(R"({"model": "m", "messages": [{"role": "user", "content": "x"}]})",
                    MessagesUse::kCountTokens)["messages"]
                .size(),
            1u);
}

// What cannot be served is refused with a 400 naming the field, never dropped.
TEST(MessagesApi, WhatCannotBeServedIsRefusedByName) {
  const std::string user = R"("messages": [{"role": "user", "content": "x"}])";
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"model": "m", )" + user + "}", "max_tokens"},
           {R"({"model": "m", "max_tokens": 0, )" + user + "}", "max_tokens"},
           {R"({"max_tokens": 5, )" + user + "}", "model"},
           {R"({"model": "m", "max_tokens": 5, "messages": []})", "messages"},
           {R"({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]})",
            "messages[0].role"},
           {R"({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content":
               [{"type": "image", "source": {}}]}]})",
            "messages[0].content[0].type"},
           {R"({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content":
               [{"type": "tool_result"}]}]})",
            "messages[0].content[0].tool_use_id"},
           {R"({"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content":
               [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]})",
            "messages[0].content[0].input"},
           {R"({"model": "m", "max_tokens": 5, "tools": [{"type": "bash_20250124", "name":
               "bash"}], )" +
                user + "}",
            "tools[0].type"},
           {R"({"model": "m", "max_tokens": 5, "tools": [{"name": "f"}], )" + user + "}",
            "tools[0].input_schema"},
           {R"({"model": "m", "max_tokens": 5, "tool_choice": {"type": "some"}, )" + user + "}",
            "tool_choice.type"},
           {R"({"model": "m", "max_tokens": 5, "thinking": {"type": "on"}, )" + user + "}",
            "thinking.type"},
           {R"({"model": "m", "max_tokens": 5, "stop_sequences": )" +
                json(std::vector<std::string>(kMaxStopStrings + 1, "s")).dump() + ", " + user + "}",
            "stop_sequences"},
           {R"({"model": "m", "max_tokens": 5, "stop_sequences": [")" +
                std::string(kMaxStopStringBytes + 1, 's') + R"("], )" + user + "}",
            "stop_sequences"},
           {R"({"model": "m", "max_tokens": 5, "stop_sequences": [5], )" + user + "}",
            "stop_sequences"},
           {R"({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"},
               {"role": "assistant", "content": "Sure, "}]})",
            "messages"},
           {R"({"model": "m", "max_tokens": 5, "mcp_servers": [{"url": "u"}], )" + user + "}",
            "mcp_servers"},
           {R"({"model": "m", "max_tokens": 5, "stream": "yes", )" + user + "}", ""},
           {"[1]", ""},
           {"{", ""}}) {
    const auto refused = parse_messages_request(body, MessagesUse::kGenerate);
    ASSERT_TRUE(std::holds_alternative<ApiError>(refused)) << body;
    EXPECT_EQ(std::get<ApiError>(refused).param, param) << body;
    EXPECT_EQ(std::get<ApiError>(refused).status, 400) << body;
  }
}

json chat_answer(const json& message, const std::string& finish_reason, const json& stop_reason) {
  return {{"model", "m"},
          {"choices", json::array({{{"index", 0},
                                    {"message", message},
                                    {"finish_reason", finish_reason},
                                    {"stop_reason", stop_reason}}})},
          {"usage",
           {{"prompt_tokens", 10},
            {"completion_tokens", 4},
            {"prompt_tokens_details", {{"cached_tokens", 6}}}}}};
}

// A chat answer as a message: reasoning a thinking block, the text, each call a tool_use block
// with its arguments as the input object; the finish reason Anthropic's stop_reason (a stop
// string named in stop_sequence); the prompt's cached tokens counted apart.
TEST(MessagesApi, AChatAnswerBecomesAMessage) {
  const MessagesRequest request = std::get<MessagesRequest>(parse_messages_request(
      R"({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})",
      MessagesUse::kGenerate));
  const json calls = json::array({{{"id", "call_1"},
                                   {"type", "function"},
                                   {"function", {{"name", "f"}, {"arguments", "{\"a\": 1}"}}}}});
  const json message = message_from_chat(request, chat_answer({{"role", "assistant"},
                                                               {"content", "Sure."},
                                                               {"reasoning_content", "hm"},
                                                               {"tool_calls", calls}},
                                                              "tool_calls", nullptr));
  EXPECT_EQ(message["id"], request.id);
  EXPECT_EQ(message["id"].get<std::string>().rfind("msg_", 0), 0u);
  EXPECT_EQ(message["type"], "message");
  EXPECT_EQ(message["role"], "assistant");
  EXPECT_EQ(message["model"], "m");
  ASSERT_EQ(message["content"].size(), 3u) << message;
  EXPECT_EQ(message["content"][0],
            (json{{"type", "thinking"}, {"thinking", "hm"}, {"signature", ""}}));
  EXPECT_EQ(message["content"][1], (json{{"type", "text"}, {"text", "Sure."}}));
  EXPECT_EQ(message["content"][2],
            (json{{"type", "tool_use"}, {"id", "call_1"}, {"name", "f"}, {"input", {{"a", 1}}}}));
  EXPECT_EQ(message["stop_reason"], "tool_use");
  EXPECT_EQ(message["stop_sequence"], nullptr);
  EXPECT_EQ(message["usage"], (json{{"input_tokens", 4},
                                    {"cache_creation_input_tokens", 0},
                                    {"cache_read_input_tokens", 6},
                                    {"output_tokens", 4}}));
  const json text = {{"role", "assistant"}, {"content", "a"}};
  for (const auto& [finish, stop, want, sequence] :
       std::vector<std::tuple<std::string, json, std::string, json>>{
           {"stop", nullptr, "end_turn", nullptr},
           {"stop", "END", "stop_sequence", "END"},
           {"length", nullptr, "max_tokens", nullptr}}) {
    const json answered = message_from_chat(request, chat_answer(text, finish, stop));
    EXPECT_EQ(answered["stop_reason"], want) << finish << stop;
    EXPECT_EQ(answered["stop_sequence"], sequence) << finish << stop;
  }
  // An empty answer is an empty content list (an empty text block is not valid input to send
  // back in the next turn).
  EXPECT_TRUE(message_from_chat(request, chat_answer({{"role", "assistant"}, {"content", ""}},
                                                     "stop", nullptr))["content"]
                  .empty());
}

TEST(MessagesApi, ErrorsTakeAnthropicsShape) {
  const json openai = ApiError{404, "no such model", "invalid_request_error", "model", ""}.body();
  EXPECT_EQ(anthropic_error_from(404, openai),
            (json{{"type", "error"},
                  {"error", {{"type", "not_found_error"}, {"message", "no such model"}}}}));
  for (const auto& [status, type] :
       std::vector<std::pair<int, std::string>>{{400, "invalid_request_error"},
                                                {401, "authentication_error"},
                                                {403, "permission_error"},
                                                {413, "request_too_large"},
                                                {429, "rate_limit_error"},
                                                {500, "api_error"},
                                                {503, "overloaded_error"},
                                                {504, "timeout_error"}})
    EXPECT_EQ(anthropic_error(status, "x")["error"]["type"], type) << status;
  // A body that is no OpenAI error still gives an error with a message.
  EXPECT_FALSE(anthropic_error_from(500, json())["error"]["message"].get<std::string>().empty());
}

struct Events {
  std::vector<std::string> types;
  std::vector<json> data;
};

Events events_in(const std::string& written) {
  Events out;
  for (size_t at = 0; (at = written.find("event: ", at)) != std::string::npos;) {
    const size_t line = written.find('\n', at);
    out.types.push_back(written.substr(at + 7, line - at - 7));
    const size_t data = line + 1 + 6;  // "data: "
    out.data.push_back(json::parse(written.substr(data, written.find('\n', data) - data)));
    EXPECT_EQ(out.data.back()["type"], out.types.back());
    at = line;
  }
  return out;
}

// A streamed chat answer (cut anywhere) as Anthropic's events: message_start with the prompt's
// tokens, a thinking block, a text block, a tool_use block with its input as one
// input_json_delta, each block stopped before the next starts and numbered in order, a
// keep-alive a ping, then message_delta with the stop reason and the whole usage, and
// message_stop.
TEST(MessagesApi, AChatStreamBecomesTheMessageEvents) {
  const auto parsed = parse_messages_request(R"({"model": "m", "max_tokens": 5, "stream": true,
      "messages": [{"role": "user", "content": "x"}]})",
                                             MessagesUse::kGenerate);
  MessagesStream translated(std::get<MessagesRequest>(parsed));
  std::string written;
  httplib::DataSink sink;
  sink.write = [&written](const char* data, size_t size) {
    written.append(data, size);
    return true;
  };
  const std::string chat =
      R"(data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"hm"},"finish_reason":null}],"usage":{"prompt_tokens":9,"completion_tokens":1}})"
      "\n\n: keep-alive\n\n"
      R"(data: {"choices":[{"index":0,"delta":{"content":"It is "},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{"content":"sunny."},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}]},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls","stop_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7}})"
      "\n\ndata: [DONE]\n\n";
  for (size_t at = 0; at < chat.size(); at += 7)
    ASSERT_TRUE(translated.feed(chat.data() + at, std::min<size_t>(7, chat.size() - at), sink));
  const Events events = events_in(written);
  const std::vector<std::string> want = {
      "message_start",      "content_block_start", "content_block_delta", "ping",
      "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
      "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
      "message_delta",      "message_stop"};
  ASSERT_EQ(events.types, want) << written;
  EXPECT_EQ(events.data[0]["message"]["usage"]["input_tokens"], 9);
  EXPECT_EQ(events.data[0]["message"]["content"], json::array());
  EXPECT_EQ(events.data[1]["content_block"]["type"], "thinking");
  EXPECT_EQ(events.data[2]["delta"], (json{{"type", "thinking_delta"}, {"thinking", "hm"}}));
  EXPECT_EQ(events.data[5]["index"], 1);
  EXPECT_EQ(events.data[7]["delta"], (json{{"type", "text_delta"}, {"text", "sunny."}}));
  EXPECT_EQ(
      events.data[9]["content_block"],
      (json{{"type", "tool_use"}, {"id", "call_1"}, {"name", "f"}, {"input", json::object()}}));
  EXPECT_EQ(events.data[10]["index"], 2);
  EXPECT_EQ(json::parse(events.data[10]["delta"]["partial_json"].get<std::string>()),
            (json{{"a", 1}}));
  EXPECT_EQ(events.data[11]["index"], 2);
  EXPECT_EQ(events.data[12]["delta"]["stop_reason"], "tool_use");
  EXPECT_EQ(events.data[12]["usage"]["output_tokens"], 7);
  EXPECT_EQ(events.data[12]["usage"]["input_tokens"], 9);
  // A stop string names itself; an error in the stream is Anthropic's error event, and the end.
  MessagesStream stopped(std::get<MessagesRequest>(parsed));
  written.clear();
  const std::string cut =
      R"(data: {"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"a"},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":"END"}]})"
      "\n\ndata: [DONE]\n\n";
  ASSERT_TRUE(stopped.feed(cut.data(), cut.size(), sink));
  const Events ended = events_in(written);
  ASSERT_EQ(ended.types.size(), 6u) << written;
  EXPECT_EQ(ended.data[4]["delta"],
            (json{{"stop_reason", "stop_sequence"}, {"stop_sequence", "END"}}));
  MessagesStream failed(std::get<MessagesRequest>(parsed));
  written.clear();
  const std::string error =
      R"(data: {"error":{"message":"too busy","type":"rate_limit_error","param":null,"code":null}})"
      "\n\ndata: [DONE]\n\n";
  ASSERT_TRUE(failed.feed(error.data(), error.size(), sink));
  const Events refused = events_in(written);
  ASSERT_EQ(refused.types, std::vector<std::string>{"error"}) << written;
  EXPECT_EQ(refused.data[0]["error"],
            (json{{"type", "rate_limit_error"}, {"message", "too busy"}}));
}

TEST(StopMatcher, TheStopStringThatEndedTheTextIsNamed) {
  StopMatcher stops({"END", "\n\n", "ab"});
  EXPECT_EQ(stops.feed("one\n"), "one");
  EXPECT_EQ(stops.matched(), "");
  // "\n\n" begins before "END": it ended the text.
  EXPECT_EQ(stops.feed("\nEND"), "");
  EXPECT_TRUE(stops.stopped());
  EXPECT_EQ(stops.matched(), "\n\n");
}

sdk::Event token(sdk::EventKind kind, const std::string& text, int32_t id) {
  sdk::Event event;
  event.kind = kind;
  event.text = text;
  event.token_ids = {id};
  if (kind == sdk::EventKind::kFinished) {
    event.finish_reason = "stop";
    event.usage.prompt_tokens = 5;
  }
  return event;
}

// vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (the
// prompt's count from the gateway's Accepted, where the stream began before it); the finish
// chunk of a stream cut by a stop string names it in stop_reason.
TEST(TokenStream, ContinuousUsageAndTheStopReasonAreInTheChunks) {
  CompletionRequest request;
  request.endpoint = Endpoint::kChat;
  request.stream = true;
  request.continuous_usage = true;
  request.stop = {"END"};
  Backend backend;
  runtime::Histogram delay({1.0});
  runtime::Counter failures;
  auto completion = std::make_shared<Completion>();
  std::string written;
  httplib::DataSink sink;
  sink.write = [&written](const char* data, size_t size) {
    written.append(data, size);
    return true;
  };
  TokenStream stream(Endpoint::kChat, request, backend, completion, 0, &delay, &failures);
  sdk::Event accepted;
  accepted.kind = sdk::EventKind::kAccepted;
  accepted.usage.prompt_tokens = 5;
  EXPECT_TRUE(stream.on_event(accepted, {}, sink));
  EXPECT_TRUE(stream.on_event(token(sdk::EventKind::kDelta, "one", 1), {}, sink));
  EXPECT_TRUE(stream.on_event(token(sdk::EventKind::kDelta, " two", 2), {}, sink));
  EXPECT_FALSE(stream.on_event(token(sdk::EventKind::kDelta, " END three", 3), {}, sink));
  stream.finish_choice(sink);
  std::vector<json> chunks;
  for (size_t at = 0; (at = written.find("data: ", at)) != std::string::npos;) {
    const size_t end = written.find("\n\n", at);
    chunks.push_back(json::parse(written.substr(at + 6, end - at - 6)));
    at = end;
  }
  ASSERT_EQ(chunks.size(), 4u) << written;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(chunks[i]["usage"]["prompt_tokens"], 5) << chunks[i];
    EXPECT_EQ(chunks[i]["usage"]["completion_tokens"], i + 1) << chunks[i];
  }
  EXPECT_EQ(chunks[2]["choices"][0]["delta"]["content"], " ");
  EXPECT_EQ(chunks[3]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(chunks[3]["choices"][0]["stop_reason"], "END");
  EXPECT_EQ(chunks[3]["usage"]["completion_tokens"], 3);
}

}  // namespace
}  // namespace moeline::stages::http
