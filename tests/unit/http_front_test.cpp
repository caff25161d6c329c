// The HTTP front's pure parts: stop strings over a stream of deltas, and OpenAI request parsing
// and response shapes (the whole stage runs against a real stack in
// tests/integration/test_http.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>

#include <atomic>
#include <cctype>
#include <chrono>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "model/json_grammar.h"
#include "stages/http/client_link.h"
#include "stages/http/connection_threads.h"
#include "stages/http/events.h"
#include "stages/http/openai.h"
#include "stages/http/reasoning.h"
#include "stages/http/responses.h"
#include "stages/http/stop_matcher.h"
#include "stages/http/token_stream.h"
#include "stages/http/tokenize.h"
#include "stages/http/tool_calls.h"

namespace moeline::stages::http {
namespace {

// Feeds the text in the given pieces; returns what the matcher let out (plus the flush when no
// stop string was found).
std::string run(std::vector<std::string> stops, const std::vector<std::string>& pieces,
                bool* stopped = nullptr) {
  StopMatcher matcher(std::move(stops));
  std::string out;
  for (const std::string& piece : pieces) out += matcher.feed(piece);
  if (stopped) *stopped = matcher.stopped();
  return out + matcher.flush();
}

TEST(StopMatcher, CutsWhereTheStopStringStartsAcrossAnySplit) {
  const std::string text = "of the genus Acanthus having spikes";
  const std::string want = "of the genus ";
  // Every way of cutting the text into two deltas finds the stop string and keeps what precedes it.
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    bool stopped = false;
    EXPECT_EQ(run({"Acanth"}, {text.substr(0, cut), text.substr(cut)}, &stopped), want) << cut;
    EXPECT_TRUE(stopped) << cut;
  }
  // One character at a time.
  std::vector<std::string> chars;
  for (char c : text) chars.emplace_back(1, c);
  EXPECT_EQ(run({"Acanth"}, chars), want);
}

TEST(StopMatcher, HoldsBackOnlyWhatCouldStillBeAStopString) {
  StopMatcher matcher({"END"});
  EXPECT_EQ(matcher.feed("abc E"), "abc ");  // "E" may begin END
  EXPECT_EQ(matcher.feed("N"), "");          // "EN" too
  EXPECT_EQ(matcher.feed("x"), "ENx");       // not END after all: released
  EXPECT_FALSE(matcher.stopped());
  EXPECT_EQ(matcher.flush(), "");
}

TEST(StopMatcher, TheEarliestOfSeveralStopStringsWinsAndNothingFollows) {
  bool stopped = false;
  EXPECT_EQ(run({"world", "lo w"}, {"hello wor", "ld and more"}, &stopped), "hel");
  EXPECT_TRUE(stopped);
  StopMatcher matcher({"!"});
  EXPECT_EQ(matcher.feed("hi! there"), "hi");
  EXPECT_EQ(matcher.feed("more"), "");
  EXPECT_EQ(matcher.flush(), "");
}

// What a completion with `stops` returns when its whole text is `text`: generation ends as soon
// as any stop string is complete, so the text is cut where the first one to complete starts (of
// several completing at the same character, the longest), and whether one did. No stop string
// may end within the first `shielded` bytes (min_tokens' text).
std::pair<std::string, bool> cut_at_first_stop(const std::string& text,
                                               const std::vector<std::string>& stops,
                                               size_t shielded = 0) {
  for (size_t end = shielded + 1; end <= text.size(); ++end) {
    size_t start = std::string::npos;
    for (const std::string& stop : stops)
      if (!stop.empty() && stop.size() <= end &&
          text.compare(end - stop.size(), stop.size(), stop) == 0)
        start = std::min(start, end - stop.size());
    if (start != std::string::npos) return {text.substr(0, start), true};
  }
  return {text, false};
}

TEST(StopMatcher, SeveralStopStringsAgreeWithTheWholeTextUnderEverySplit) {
  // Stop strings that overlap one another's starts and ends, so that what one holds back is
  // longer or shorter than what another would, and stop strings inside others: every split into
  // three deltas gives what cutting the whole text at the first stop string to complete gives.
  const std::vector<std::vector<std::string>> stop_sets = {
      {"abc", "bz"}, {"bz", "abc"},  {"abx", "bcq", "cy"}, {"ca", "ab"},
      {"aab", "bb"}, {"abcy", "bc"}, {"bc", "zabc"},       {"aba", "bab", "b"}};
  const std::vector<std::string> texts = {"xabc",   "xxabzq", "aaab",    "xabcyz",
                                          "abcabq", "zzabcq", "abababx", "no stop here"};
  for (const auto& stops : stop_sets)
    for (const std::string& text : texts) {
      const auto [want, want_stopped] = cut_at_first_stop(text, stops);
      for (size_t i = 0; i <= text.size(); ++i)
        for (size_t j = i; j <= text.size(); ++j) {
          bool stopped = false;
          EXPECT_EQ(
              run(stops, {text.substr(0, i), text.substr(i, j - i), text.substr(j)}, &stopped),
              want)
              << text << " split at " << i << ", " << j << " stops " << stops[0] << "...";
          EXPECT_EQ(stopped, want_stopped) << text << " split at " << i << ", " << j;
        }
    }
}

// vLLM's min_tokens: a stop string counts only where it ends past the text of the first
// min_tokens tokens (it may begin inside it), for every min_tokens and stop set, the text fed a
// token at a time as the events bring it.
TEST(StopMatcher, MinTokensShieldsTheFirstTokensText) {
  const std::vector<std::string> tokens = {"a", "b", "END", "c", "EN", "D", "bE", "ND"};
  const std::vector<std::vector<std::string>> stop_sets = {{"END"}, {"bE", "D"}, {"Dc"}, {"x"}};
  std::string whole;
  for (const std::string& token : tokens) whole += token;
  for (const auto& stops : stop_sets) {
    for (int64_t min_tokens = 0; min_tokens <= static_cast<int64_t>(tokens.size()); ++min_tokens) {
      SCOPED_TRACE(stops[0] + " min_tokens " + std::to_string(min_tokens));
      size_t shielded = 0;
      for (int64_t i = 0; i < min_tokens; ++i) shielded += tokens[static_cast<size_t>(i)].size();
      StopMatcher matcher(stops, {}, false, min_tokens);
      std::string out;
      for (size_t i = 0; i < tokens.size(); ++i)
        out += matcher.feed(tokens[i], static_cast<int64_t>(i + 1));
      out += matcher.flush();
      const auto [want, stopped] = cut_at_first_stop(whole, stops, shielded);
      EXPECT_EQ(out, want);
      EXPECT_EQ(matcher.stopped(), stopped);
    }
  }
  // "END" in the first three tokens' text is passed over; the one that ends in token 6 stops it.
  StopMatcher matcher({"END"}, {}, false, 3);
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i)
    out += matcher.feed(tokens[i], static_cast<int64_t>(i + 1));
  EXPECT_EQ(out, "abENDc");
  EXPECT_EQ(matcher.matched(), "END");
}

TEST(StopMatcher, NoStopStringsPassEverythingThrough) {
  EXPECT_EQ(run({}, {"a", "b", ""}), "ab");
  EXPECT_EQ(run({""}, {"a", "b"}), "ab");  // an empty stop string never matches
}

TEST(StopMatcher, KeepsMultibyteCharactersWhole) {
  // The held-back tail is a prefix of a stop string, so the text let out never ends inside a
  // UTF-8 character that the stop string begins with.
  bool stopped = false;
  EXPECT_EQ(run({"🤷x"}, {"ab\xF0\x9F", "\xA4\xB7", "x"}, &stopped), "ab");
  EXPECT_TRUE(stopped);
}

ApiError error_of(Endpoint endpoint, const std::string& body) {
  auto parsed = parse_request(endpoint, body);
  EXPECT_TRUE(std::holds_alternative<ApiError>(parsed)) << body;
  return std::holds_alternative<ApiError>(parsed) ? std::get<ApiError>(parsed) : ApiError{};
}

CompletionRequest request_of(Endpoint endpoint, const std::string& body) {
  auto parsed = parse_request(endpoint, body);
  EXPECT_TRUE(std::holds_alternative<CompletionRequest>(parsed))
      << body << ": "
      << (std::holds_alternative<ApiError>(parsed) ? std::get<ApiError>(parsed).message : "");
  return std::holds_alternative<CompletionRequest>(parsed) ? std::get<CompletionRequest>(parsed)
                                                           : CompletionRequest{};
}

TEST(OpenAiRequest, ReadsEveryField) {
  const CompletionRequest r = request_of(Endpoint::kChat, R"({
    "model": "m", "messages": [{"role": "system", "content": "s"},
                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]},
                               {"role": "assistant", "content": null},
                               {"role": "developer", "content": "d"},
                               {"role": "assistant", "content": "c", "reasoning_content": "r"},
                               {"role": "assistant", "content": "c", "reasoning": "vllm's"}],
    "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": -3,
    "stop": ["x", "y"], "stream": true, "stream_options": {"include_usage": true},
    "user": "u", "chat_template_kwargs": {"enable_thinking": false}, "unknown": [1, {"x": 2}],
    "min_p": 0.05, "presence_penalty": -1.5, "frequency_penalty": 2, "repetition_penalty": 1.1,
    "logprobs": true, "top_logprobs": 4, "stop_token_ids": [7, 0],
    "include_stop_str_in_output": true, "min_tokens": 7})");
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{7, 0}));
  EXPECT_EQ(r.min_tokens, 7);
  EXPECT_TRUE(r.include_stop_str_in_output);
  ASSERT_EQ(r.messages.size(), 6u);
  EXPECT_EQ(r.messages[1].content, "ab");
  EXPECT_EQ(r.messages[4].reasoning_content, "r");
  EXPECT_EQ(r.messages[5].reasoning_content, "vllm's");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.messages[3].role, "system");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_DOUBLE_EQ(r.temperature, 0.5);
  EXPECT_DOUBLE_EQ(r.top_p, 0.9);
  EXPECT_EQ(r.top_k, 5);
  EXPECT_EQ(r.seed, static_cast<uint64_t>(-3));
  EXPECT_EQ(r.stop, (std::vector<std::string>{"x", "y"}));
  // More than OpenAI's four stop strings, as vLLM takes them (evaluation harnesses send five).
  EXPECT_EQ(request_of(Endpoint::kCompletions, R"({"prompt": "p", "stop": ["a","b","c","d","e"]})")
                .stop.size(),
            5u);
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(r.user, "u");
  EXPECT_EQ(r.chat.enable_thinking, false);
  EXPECT_TRUE(r.chat.template_kwargs_json.empty());
  // The other chat_template_kwargs go to the template; the renderer's own variables are refused.
  const CompletionRequest kwargs = request_of(Endpoint::kChat, R"({"messages": [{"role": "user",
      "content": "x"}], "chat_template_kwargs": {"thinking": true, "reasoning_effort": "low",
      "enable_thinking": true}})");
  EXPECT_EQ(nlohmann::json::parse(kwargs.chat.template_kwargs_json),
            nlohmann::json::parse(R"({"thinking": true, "reasoning_effort": "low"})"));
  EXPECT_EQ(kwargs.chat.enable_thinking, true);
  // vLLM's continue_final_message: no generation prompt then, unless it is asked for too (a 400).
  const CompletionRequest continued = request_of(Endpoint::kChat, R"({"messages": [{"role":
      "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "continue_final_message": true})");
  EXPECT_TRUE(continued.chat.continue_final_message);
  EXPECT_FALSE(continued.chat.add_generation_prompt);
  EXPECT_FALSE(r.chat.continue_final_message);
  EXPECT_TRUE(r.chat.add_generation_prompt);
  EXPECT_EQ(error_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "continue_final_message": true, "add_generation_prompt": true})")
                .param,
            "continue_final_message");
  EXPECT_DOUBLE_EQ(r.min_p, 0.05);
  EXPECT_DOUBLE_EQ(r.presence_penalty, -1.5);
  EXPECT_DOUBLE_EQ(r.frequency_penalty, 2);
  EXPECT_DOUBLE_EQ(r.repetition_penalty, 1.1);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 4);
  // Completions take logprobs as the number of alternatives; 0 still asks for the chosen token's.
  const CompletionRequest legacy =
      request_of(Endpoint::kCompletions, R"({"prompt": "p", "logprobs": 0})");
  EXPECT_TRUE(legacy.logprobs);
  EXPECT_EQ(legacy.top_logprobs, 0);
  EXPECT_EQ(request_of(Endpoint::kCompletions, R"({"prompt": "p", "logprobs": 5})").top_logprobs,
            5);
  EXPECT_FALSE(request_of(Endpoint::kCompletions, R"({"prompt": "p", "logprobs": null})").logprobs);
}

TEST(OpenAiRequest, DefaultsAreOpenAis) {
  const CompletionRequest r = request_of(Endpoint::kCompletions, R"({"prompt": "p"})");
  EXPECT_EQ(r.prompt, "p");
  EXPECT_FALSE(r.max_tokens.has_value());  // up to the context
  EXPECT_DOUBLE_EQ(r.temperature, 1.0);
  EXPECT_DOUBLE_EQ(r.top_p, 1.0);
  EXPECT_FALSE(r.stream);
  // top_p 0, which OpenAI takes: the most likely token alone.
  const CompletionRequest nucleus_of_one =
      request_of(Endpoint::kCompletions, R"({"prompt": "p", "top_p": 0, "top_k": 7})");
  EXPECT_EQ(nucleus_of_one.top_k, 1);
  EXPECT_DOUBLE_EQ(nucleus_of_one.top_p, 1.0);
  // json_schema without its (optional) schema: a JSON object, as json_object.
  EXPECT_EQ(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}})")
                .structured,
            sdk::StructuredOutput::kJsonObject);
  EXPECT_EQ(request_of(Endpoint::kCompletions, R"({"prompt": [1, 2, 3]})").prompt_tokens,
            (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(request_of(Endpoint::kCompletions, R"({"prompt": ["one"]})").prompt, "one");
  // max_tokens wins over max_completion_tokens where both are given; -1 top_k is "no top-k".
  const CompletionRequest both =
      request_of(Endpoint::kCompletions,
                 R"({"prompt": "p", "max_tokens": 3, "max_completion_tokens": 9, "top_k": -1})");
  EXPECT_EQ(both.max_tokens, 3);
  EXPECT_EQ(both.top_k, 0);
  EXPECT_EQ(r.n, 1);
  // A batch of prompts: strings, or token-id lists; a list of one is the plain prompt.
  const CompletionRequest batch =
      request_of(Endpoint::kCompletions, R"({"prompt": ["a", "b", "c"], "n": 2})");
  EXPECT_EQ(batch.batch_prompts, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(batch.prompt_count(), 3);
  const CompletionRequest ids = request_of(Endpoint::kCompletions, R"({"prompt": [[1, 2], [3]]})");
  EXPECT_EQ(ids.batch_prompt_tokens, (std::vector<std::vector<int32_t>>{{1, 2}, {3}}));
  EXPECT_EQ(request_of(Endpoint::kCompletions, R"({"prompt": [[4, 5]]})").prompt_tokens,
            (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(request_of(Endpoint::kCompletions, R"({"prompt": ["one"]})").prompt_count(), 1);
  EXPECT_EQ(request_of(Endpoint::kCompletions,
                       R"({"prompt": "p", "logit_bias": {"50256": -100, "7": 2.5}})")
                .logit_bias,
            (std::vector<std::pair<int32_t, float>>{{50256, -100.0f}, {7, 2.5f}}));
  // The neutral values of what the server does not do are served.
  EXPECT_EQ(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [], "logit_bias": {}, "response_format": {"type": "text"}})")
                .messages.size(),
            1u);
  EXPECT_EQ(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})")
                .messages.size(),
            1u);
  EXPECT_EQ(request_of(Endpoint::kCompletions,
                       R"({"prompt": "p", "echo": false, "suffix": "", "n": 2, "best_of": 2})")
                .n,
            2);
  // Forced tool calls: "required", and a named function among the tools.
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f"}},
      {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}])";
  EXPECT_EQ(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "tool_choice": "required", )" + tools +
                                            "}")
                .tool_choice,
            CompletionRequest::ToolChoice::kRequired);
  const CompletionRequest named =
      request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}, )" +
                                      tools + "}");
  EXPECT_EQ(named.tool_choice, CompletionRequest::ToolChoice::kFunction);
  EXPECT_EQ(named.tool_choice_function, "g");
  // The grammar of a forced call: {"name", "arguments"} for each tool, or only the named one.
  EXPECT_EQ(forced_call_schema(named.chat.tools_json, "g"),
            R"({"type":"object","properties":{"name":{"const":"g"},"arguments":{"type":"object"}},)"
            R"("required":["name","arguments"]})");
  EXPECT_EQ(
      forced_call_schema(named.chat.tools_json, "").rfind(R"({"anyOf":[{"type":"object",)", 0), 0u);
  // A tool whose parameters refer to their own definitions (Pydantic's nested models) and to
  // themselves: the references follow the definitions into the call's schema.
  const std::string nested = forced_call_schema(
      R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"a": {"$ref": "#/$defs/A"}, "more": {"anyOf": [{"$ref": "#"},
          {"type": "null"}]}}, "required": ["a"], "$defs": {"A": {"type": "object",
          "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}}}])",
      "");
  auto grammar = model::JsonGrammar::compile(nested);
  ASSERT_TRUE(grammar) << grammar.error().message << "\n" << nested;
  model::JsonMatcher call(*grammar);
  EXPECT_TRUE(call.advance(R"({"name": "f", "arguments": {"a": {"n": 1}, "more": {"a": {"n": 2},)"
                           R"( "more": null}}})") &&
              call.can_end())
      << nested;
  model::JsonMatcher wrapper(*grammar);
  EXPECT_FALSE(wrapper.advance(R"({"name": "f", "arguments": {"a": {"n": 1}, "more": {"name")"))
      << "'#' is the tool's parameters, not the call";
  // A body nested past 256 is refused before it is parsed (parts of it are written back).
  const ApiError deep =
      error_of(Endpoint::kCompletions,
               R"({"prompt": "p", "x": )" + std::string(300, '[') + std::string(300, ']') + "}");
  EXPECT_EQ(deep.status, 400);
  // Structured output: json_object, and json_schema with the schema's text in its own key order.
  EXPECT_EQ(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_object"}})")
                .structured,
            sdk::StructuredOutput::kJsonObject);
  const CompletionRequest schema = request_of(Endpoint::kChat, R"({"messages": [{"role": "user",
      "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "p",
      "strict": true, "schema": {"type": "object", "properties": {"z": {"type": "integer"},
      "a": {"type": "string"}}, "required": ["z", "a"]}}}})");
  EXPECT_EQ(schema.structured, sdk::StructuredOutput::kJsonSchema);
  EXPECT_EQ(schema.json_schema,
            R"({"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"string"}},)"
            R"("required":["z","a"]})");
  // vLLM's guided decoding: guided_json (an object or its text) and structured_outputs.json as
  // json_schema, in the schema's own key order; structured_outputs.json_object as json_object.
  const std::string schema_text =
      R"({"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"string"}},)"
      R"("required":["z","a"]})";
  for (const std::string& field :
       {R"("guided_json": )" + schema_text,
        R"("guided_json": )" + nlohmann::json(schema_text).dump(),
        R"("structured_outputs": {"json": )" + schema_text + "}",
        R"("structured_outputs": {"json": )" + nlohmann::json(schema_text).dump() +
            R"(, "disable_any_whitespace": true})",
        R"("guided_json": )" + schema_text + R"(, "guided_decoding_backend": "xgrammar")"}) {
    const CompletionRequest guided =
        request_of(Endpoint::kCompletions, R"({"prompt": "p", )" + field + "}");
    EXPECT_EQ(guided.structured, sdk::StructuredOutput::kJsonSchema) << field;
    EXPECT_EQ(guided.json_schema, schema_text) << field;
  }
  EXPECT_EQ(request_of(Endpoint::kCompletions,
                       R"({"prompt": "p", "structured_outputs": {"json_object": true}})")
                .structured,
            sdk::StructuredOutput::kJsonObject);
  EXPECT_EQ(request_of(Endpoint::kCompletions,
                       R"({"prompt": "p", "structured_outputs": {"json_object": false}})")
                .structured,
            sdk::StructuredOutput::kNone);
  // Echo (completions): the prompt before the completion, with logprobs N its tokens' too.
  const CompletionRequest echoed =
      request_of(Endpoint::kCompletions, R"({"prompt": "p", "echo": true, "logprobs": 2})");
  EXPECT_TRUE(echoed.echo);
  EXPECT_TRUE(echoed.logprobs);
  EXPECT_EQ(echoed.top_logprobs, 2);
  EXPECT_FALSE(request_of(Endpoint::kCompletions, R"({"prompt": "p"})").echo);
  EXPECT_FALSE(echoed.score_only());
  // max_tokens 0 with echo: the prompt scored, nothing generated (OpenAI's legacy scoring).
  EXPECT_TRUE(request_of(Endpoint::kCompletions,
                         R"({"prompt": "p", "echo": true, "logprobs": 0, "max_tokens": 0})")
                  .score_only());
  EXPECT_EQ(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
                                             "n": 16})")
                .n,
            16);
}

TEST(OpenAiRequest, WrongTypesAndValuesNameTheirParameter) {
  struct Case {
    Endpoint endpoint;
    std::string body;
    const char* param;
  };
  const Case cases[] = {
      {Endpoint::kChat, R"({"messages": "hi"})", "messages"},
      {Endpoint::kChat, R"({})", "messages"},
      {Endpoint::kChat, R"({"messages": [7]})", "messages[0]"},
      {Endpoint::kChat, R"({"messages": [{"content": "x"}]})", "messages[0].role"},
      {Endpoint::kChat, R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})",
       "chat_template_kwargs.messages"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user", "content": "x", "reasoning_content": 1}]})",
       "messages[0].reasoning_content"},
      {Endpoint::kChat, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content[0].type"},
      {Endpoint::kCompletions, R"({"prompt": "p", "stop_token_ids": 5})", "stop_token_ids"},
      {Endpoint::kCompletions, R"({"prompt": "p", "stop_token_ids": [-5]})", "stop_token_ids"},
      {Endpoint::kCompletions, R"({"prompt": "p", "stop_token_ids": ["5"]})", "stop_token_ids"},
      {Endpoint::kCompletions, R"({"prompt": "p", "include_stop_str_in_output": 1})",
       "include_stop_str_in_output"},
      {Endpoint::kCompletions, R"({"prompt": "p", "min_tokens": -1})", "min_tokens"},
      {Endpoint::kCompletions, R"({"prompt": "p", "min_tokens": 2.5})", "min_tokens"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "min_tokens": 2, "response_format": {"type": "json_object"}})",
       "min_tokens"},
      {Endpoint::kCompletions, R"({"prompt": "p", "max_tokens": 4, "min_tokens": 5})",
       "min_tokens"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "min_tokens": 3})",
       "min_tokens"},
      {Endpoint::kCompletions, R"({"prompt": 5})", "prompt"},
      {Endpoint::kCompletions,
       R"({"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]})",
       "prompt"},
      {Endpoint::kCompletions, R"({"prompt": [1, -2]})", "prompt"},
      {Endpoint::kCompletions, R"({"prompt": "p", "max_tokens": "10"})", "max_tokens"},
      {Endpoint::kCompletions, R"({"prompt": "p", "max_tokens": 0})", "max_tokens"},
      {Endpoint::kCompletions, R"({"prompt": "p", "max_tokens": -1, "echo": true})", "max_tokens"},
      {Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})",
       "max_tokens"},
      {Endpoint::kCompletions, R"({"prompt": "p", "max_tokens": 1.5})", "max_tokens"},
      {Endpoint::kCompletions, R"({"prompt": "p", "max_tokens": 18446744073709551615})",
       "max_tokens"},
      {Endpoint::kCompletions, R"({"prompt": "p", "temperature": -1})", "temperature"},
      {Endpoint::kCompletions, R"({"prompt": "p", "temperature": "hot"})", "temperature"},
      {Endpoint::kCompletions, R"({"prompt": "p", "top_p": -0.1})", "top_p"},
      {Endpoint::kCompletions, R"({"prompt": "p", "seed": "s"})", "seed"},
      {Endpoint::kCompletions, R"({"prompt": "p", "stop": [1]})", "stop"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "stop": )" +
           nlohmann::json(std::vector<std::string>(kMaxStopStrings + 1, "s")).dump() + "}",
       "stop"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "stop": ")" + std::string(kMaxStopStringBytes + 1, 's') + R"("})",
       "stop"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "stop": ["a", ")" + std::string(kMaxStopStringBytes + 1, 's') + R"("]})",
       "stop"},
      {Endpoint::kCompletions, R"({"prompt": "p", "stream": 1})", "stream"},
      {Endpoint::kCompletions, R"({"prompt": "p", "stream_options": {"include_usage": true}})",
       "stream_options"},
      {Endpoint::kCompletions, R"({"prompt": "p", "n": 0})", "n"},
      {Endpoint::kCompletions, R"({"prompt": "p", "n": 17})", "n"},
      {Endpoint::kCompletions, R"({"prompt": "p", "n": 2.5})", "n"},
      {Endpoint::kGenerate, R"({"prompt": "p", "n": 2})", "n"},
      {Endpoint::kCompletions, R"({"prompt": ["a", [1]]})", "prompt"},
      {Endpoint::kCompletions, R"({"prompt": [[1], "a"]})", "prompt"},
      {Endpoint::kCompletions, R"({"prompt": [[1], []]})", "prompt"},
      {Endpoint::kCompletions, R"({"prompt": [[1, -2]]})", "prompt"},
      {Endpoint::kGenerate, R"({"prompt": ["a", "b"]})", "prompt"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "tools": [{"type": "function"}]})",
       "tools[0].function"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "tools": {}})", "tools"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "tools": [{"type": "function", "function": {}}]})",
       "tools[0].function.name"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "tools": [{"type": "retrieval"}]})",
       "tools[0].type"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "tool_choice": "required"})",
       "tool_choice"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "tool_choice": "required", "tools": []})",
       "tool_choice"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "tool_choice": {"type": "function",
           "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]})",
       "tool_choice"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "tool_choice": {"type": "function"},
           "tools": [{"type": "function", "function": {"name": "f"}}]})",
       "tool_choice"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "tool_choice": "sometimes"})",
       "tool_choice"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "tool_choice": {"type": "function", "function": {"name": "f"}}})",
       "tool_choice"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]})",
       "messages[0].tool_calls[0].function"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]})",
       "messages[0].tool_calls[0].function.name"},
      {Endpoint::kChat, R"({"messages": [{"role": "tool", "tool_call_id": 5}]})",
       "messages[0].tool_call_id"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "functions": [{"name": "f"}]})",
       "functions"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "response_format": "json"})",
       "response_format"},
      {Endpoint::kCompletions, R"({"prompt": "p", "guided_regex": "a+"})", "guided_regex"},
      {Endpoint::kCompletions, R"({"prompt": "p", "guided_choice": ["a", "b"]})", "guided_choice"},
      {Endpoint::kCompletions, R"({"prompt": "p", "guided_grammar": "root ::= x"})",
       "guided_grammar"},
      {Endpoint::kCompletions, R"({"prompt": "p", "structured_outputs": {"choice": ["a"]}})",
       "structured_outputs.choice"},
      {Endpoint::kCompletions, R"({"prompt": "p", "structured_outputs": 3})", "structured_outputs"},
      {Endpoint::kCompletions, R"({"prompt": "p", "structured_outputs": {"json_object": 1}})",
       "structured_outputs.json_object"},
      {Endpoint::kCompletions, R"({"prompt": "p", "guided_json": 5})", "guided_json"},
      {Endpoint::kCompletions, R"({"prompt": "p", "guided_json": "{not json"})", "guided_json"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "guided_json": ")" + std::string(100000, '[') + R"("})", "guided_json"},
      // Arguments given as text are parsed for the template, which writes them back recursively.
      {Endpoint::kChat,
       R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
           "arguments": ")" +
           std::string(100000, '[') + R"("}}]}]})",
       "messages[0].tool_calls[0].function.arguments"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "guided_json": {"type": "string", "pattern": "a+"}})", "guided_json"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "guided_json": {"type": "object"}, "guided_choice": ["a"]})",
       "guided_choice"},
      {Endpoint::kCompletions,
       R"({"prompt": "p", "guided_json": {}, "response_format": {"type": "json_object"}})",
       "guided_json"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "response_format": {}})",
       "response_format.type"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "response_format": {"type": "regex"}})",
       "response_format.type"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "response_format": {"type": "json_schema"}})",
       "response_format.json_schema"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "response_format": {"type": "json_schema",
           "json_schema": {"name": "n", "schema": 3}}})",
       "response_format.json_schema.schema"},
      {Endpoint::kChat,
       R"({"messages": [{"role": "user"}], "response_format": {"type": "json_schema",
           "json_schema": {"schema": {"type": "string", "pattern": "a+"}}}})",
       "response_format.json_schema.schema"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "logit_bias": [1]})", "logit_bias"},
      {Endpoint::kCompletions, R"({"prompt": "p", "logit_bias": {"x": 1}})", "logit_bias"},
      {Endpoint::kCompletions, R"({"prompt": "p", "logit_bias": {"-3": 1}})", "logit_bias"},
      {Endpoint::kCompletions, R"({"prompt": "p", "logit_bias": {"5": 101}})", "logit_bias"},
      {Endpoint::kCompletions, R"({"prompt": "p", "logit_bias": {"5": "up"}})", "logit_bias"},
      {Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}], "echo": true})",
       "echo"},
      {Endpoint::kCompletions, R"({"prompt": "p", "echo": "yes"})", "echo"},
      {Endpoint::kCompletions, R"({"prompt": "p", "suffix": "end"})", "suffix"},
      {Endpoint::kCompletions, R"({"prompt": "p", "best_of": 3})", "best_of"},
      {Endpoint::kCompletions, R"({"prompt": "p", "n": 2, "best_of": 1})", "best_of"},
      {Endpoint::kCompletions, R"({"prompt": "p", "logprobs": 21})", "logprobs"},
      {Endpoint::kCompletions, R"({"prompt": "p", "logprobs": true})", "logprobs"},
      {Endpoint::kChat, R"({"messages": [], "logprobs": true})", "messages"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "logprobs": 3})", "logprobs"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "top_logprobs": 2})", "top_logprobs"},
      {Endpoint::kChat, R"({"messages": [{"role": "user"}], "logprobs": true, "top_logprobs": 30})",
       "top_logprobs"},
      {Endpoint::kCompletions, R"({"prompt": "p", "frequency_penalty": 3})", "frequency_penalty"},
      {Endpoint::kCompletions, R"({"prompt": "p", "presence_penalty": "x"})", "presence_penalty"},
      {Endpoint::kCompletions, R"({"prompt": "p", "repetition_penalty": 0})", "repetition_penalty"},
      {Endpoint::kCompletions, R"({"prompt": "p", "min_p": 1.5})", "min_p"},
      {Endpoint::kCompletions, R"({"prompt": "p", "model": 4})", "model"},
  };
  for (const Case& c : cases) {
    const ApiError error = error_of(c.endpoint, c.body);
    EXPECT_EQ(error.status, 400) << c.body;
    EXPECT_EQ(error.param, c.param) << c.body << ": " << error.message;
    EXPECT_FALSE(error.message.empty());
  }
  // Not JSON, or not an object: no parameter to name.
  for (const char* body : {"", "{", "[1]", "\"text\"", "{\"prompt\": \"p\"} trailing"}) {
    const ApiError error = error_of(Endpoint::kCompletions, body);
    EXPECT_EQ(error.status, 400) << body;
    EXPECT_TRUE(error.param.empty()) << body;
  }
}

TEST(OpenAiRequest, TokenizeAndDetokenizeBodiesAsVllmTakesThem) {
  auto prompt = parse_tokenize(R"({"prompt": "a b", "return_token_strs": true})");
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(prompt));
  const TokenizeRequest& text = std::get<TokenizeRequest>(prompt);
  EXPECT_FALSE(text.chat);
  EXPECT_EQ(text.text.prompt, "a b");
  EXPECT_TRUE(text.add_special_tokens);  // vLLM's default for a prompt
  EXPECT_TRUE(text.return_token_strs);
  auto chat = parse_tokenize(
      R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
          "add_generation_prompt": false})");
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(chat));
  const TokenizeRequest& messages = std::get<TokenizeRequest>(chat);
  EXPECT_TRUE(messages.chat);
  EXPECT_EQ(messages.text.model, "m");
  EXPECT_EQ(messages.text.messages.size(), 1u);
  EXPECT_FALSE(messages.add_special_tokens);  // the template carries them
  EXPECT_FALSE(messages.text.chat.add_generation_prompt);
  auto ids = parse_detokenize(R"({"tokens": [1, 2, 3]})");
  ASSERT_TRUE(std::holds_alternative<DetokenizeRequest>(ids));
  EXPECT_EQ(std::get<DetokenizeRequest>(ids).tokens, (std::vector<int32_t>{1, 2, 3}));
  struct Case {
    const char* body;
    const char* param;
    bool detokenize;
  };
  for (const Case& c :
       {Case{R"({})", "prompt", false}, Case{R"({"prompt": 1})", "prompt", false},
        Case{R"({"prompt": "x", "model": 3})", "model", false},
        Case{R"({"messages": "x"})", "messages", false},
        Case{R"({"prompt": "x", "add_special_tokens": 1})", "add_special_tokens", false},
        Case{R"({})", "tokens", true}, Case{R"({"tokens": [-1]})", "tokens", true},
        Case{R"({"tokens": [1.5]})", "tokens", true},
        Case{R"({"tokens": [4294967296]})", "tokens", true},
        Case{R"({"tokens": {}})", "tokens", true}}) {
    const ApiError error = c.detokenize ? std::get<ApiError>(parse_detokenize(c.body))
                                        : std::get<ApiError>(parse_tokenize(c.body));
    EXPECT_EQ(error.status, 400) << c.body;
    EXPECT_EQ(error.param, c.param) << c.body << ": " << error.message;
  }
  EXPECT_TRUE(std::holds_alternative<ApiError>(parse_tokenize("not json")));
}

TEST(OpenAiError, HasOpenAisShapeAndGatewayCodesMapToStatuses) {
  ApiError error;
  error.message = "m";
  const nlohmann::json body = error.body();
  ASSERT_TRUE(body.contains("error"));
  EXPECT_EQ(body["error"]["message"], "m");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_TRUE(body["error"]["code"].is_null());
  EXPECT_EQ(gateway_error(1, "InvalidRequest", "x").status, 400);
  EXPECT_EQ(gateway_error(2, "PromptTooLong", "x").code, "context_length_exceeded");
  EXPECT_EQ(gateway_error(15, "Unauthenticated", "x").status, 401);
  EXPECT_EQ(gateway_error(16, "Forbidden", "x").status, 403);
  EXPECT_EQ(gateway_error(10, "Overloaded", "x").status, 429);
  EXPECT_EQ(gateway_error(7, "DeadlineExceeded", "x").status, 504);
  EXPECT_EQ(gateway_error(9, "StageFailed", "x").status, 503);
  EXPECT_EQ(gateway_error(11, "Internal", "x").status, 500);
}

TEST(OpenAiResponse, ChatAndCompletionShapes) {
  Completion c;
  c.id = "chatcmpl-1";
  c.created = 5;
  c.model = "m";
  c.text = "hi";
  c.finish_reason = "stop";
  c.usage.prompt_tokens = 3;
  c.usage.completion_tokens = 2;
  c.usage.reused_tokens = 1;
  const nlohmann::json chat = completion_response(Endpoint::kChat, {&c, 1});
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"],
            (nlohmann::json{{"role", "assistant"}, {"content", "hi"}}));
  EXPECT_EQ(chat["usage"]["total_tokens"], 5);
  EXPECT_EQ(chat["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
  const nlohmann::json text = completion_response(Endpoint::kCompletions, {&c, 1});
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "hi");
  const nlohmann::json first = stream_chunk(Endpoint::kChat, c, "h", true, "");
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"],
            (nlohmann::json{{"role", "assistant"}, {"content", "h"}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  const nlohmann::json last = stream_chunk(Endpoint::kChat, c, "", false, "length");
  EXPECT_EQ(last["choices"][0]["delta"], nlohmann::json::object());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  const nlohmann::json usage = usage_chunk(Endpoint::kChat, c);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);
  // The per-token fast path writes exactly what the generic builder would.
  for (Endpoint endpoint : {Endpoint::kChat, Endpoint::kCompletions}) {
    const TokenEvents events(endpoint, c);
    for (const std::string piece : {"a", "", "quote \" and \\ and \n", "ünï 🤷", "\x01"}) {
      EXPECT_EQ(events.event(piece),
                "data: " + stream_chunk(endpoint, c, piece, false, "").dump() + "\n\n")
          << piece;
      // With continuous usage: the chunk's usage as usage_json writes it.
      nlohmann::json with_usage = stream_chunk(endpoint, c, piece, false, "");
      with_usage["usage"] = usage_json(c.usage);
      EXPECT_EQ(events.event(piece, &c.usage), "data: " + with_usage.dump() + "\n\n") << piece;
    }
  }
  // n choices: one entry each with its index, the prompt counted once, every choice's tokens.
  Completion second = c;
  second.index = 1;
  second.text = "ho";
  second.finish_reason = "length";
  second.usage.completion_tokens = 4;
  const Completion both[] = {c, second};
  const nlohmann::json two = completion_response(Endpoint::kChat, both, 2);
  ASSERT_EQ(two["choices"].size(), 2u);
  EXPECT_EQ(two["choices"][1]["index"], 1);
  EXPECT_EQ(two["choices"][1]["message"]["content"], "ho");
  EXPECT_EQ(two["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(two["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(two["usage"]["completion_tokens"], 6);
  EXPECT_EQ(two["usage"]["total_tokens"], 9);
  // The prompt's cached tokens are counted once too, never more than the prompt.
  EXPECT_EQ(two["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
  EXPECT_EQ(stream_chunk(Endpoint::kCompletions, second, "x", false, "")["choices"][0]["index"], 1);
  EXPECT_EQ(TokenEvents(Endpoint::kChat, second).event("x"),
            "data: " + stream_chunk(Endpoint::kChat, second, "x", false, "").dump() + "\n\n");
  EXPECT_EQ(new_completion_id(Endpoint::kChat).rfind("chatcmpl-", 0), 0u);
  EXPECT_NE(new_completion_id(Endpoint::kChat), new_completion_id(Endpoint::kChat));
}

// /tokenize adds the tokenizer's special tokens (Mixtral's <s>) unless the request says
// add_special_tokens false, as vLLM's does.
TEST(Tokenize, AddsTheSpecialTokensUnlessAskedNotTo) {
  auto loaded =
      tokenizer::Tokenizer::load(std::string(MOELINE_TEST_MODELS) + "/mixtral-f32/tokenizer.json");
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  Backend backend;
  backend.name = "mixtral-f32";
  backend.tokenizer = std::make_unique<tokenizer::Tokenizer>(std::move(*loaded));
  TokenizeRequest request;
  request.text.prompt = "hello world";
  const auto with = tokenize(backend, request);
  request.add_special_tokens = false;
  const auto without = tokenize(backend, request);
  ASSERT_TRUE(std::holds_alternative<nlohmann::json>(with));
  ASSERT_TRUE(std::holds_alternative<nlohmann::json>(without));
  const auto& a = std::get<nlohmann::json>(with);
  const auto& b = std::get<nlohmann::json>(without);
  EXPECT_EQ(a["tokens"][0], 1) << a;
  EXPECT_EQ(a["count"].get<int64_t>(), b["count"].get<int64_t>() + 1) << a << b;
  EXPECT_NE(b["tokens"][0], 1) << b;
}

// GLM-4.5 writes each argument as <arg_key>/<arg_value> (its chat template's format); a value is
// text unless JSON, and text whatever it looks like where the tool's schema says string.
TEST(ToolCalls, Glm45BlocksAreReadAsCallsWithTheSchemasTypes) {
  const std::string tools = R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
      "days": {"type": "integer"}, "zip": {"type": "string"}}}}}])";
  // A value that is not valid UTF-8 (a model's byte token alone, found by fuzz_openai): its bad
  // byte replaced, as everywhere else in a response, not thrown on (which, streamed, took down
  // the gateway bridge and every other stream with it).
  const auto bad_bytes = parse_glm45_tool_calls(
      "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Par\xd4is</arg_value></tool_call>",
      tools);
  ASSERT_TRUE(bad_bytes.has_value());
  EXPECT_EQ(bad_bytes->calls.at(0).arguments, "{\"city\":\"Par\xef\xbf\xbdis\"}");
  const auto one = parse_glm45_tool_calls(
      "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
      "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>zip</arg_key>\n"
      "<arg_value>75001</arg_value>\n</tool_call>",
      tools);
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(one->content, "Checking.");
  ASSERT_EQ(one->calls.size(), 1u);
  EXPECT_EQ(one->calls[0].name, "get_weather");
  // days is JSON (an integer); zip stays the string its schema says, though it reads as a number.
  EXPECT_EQ(one->calls[0].arguments, R"({"city":"Paris","days":2,"zip":"75001"})");
  EXPECT_EQ(one->calls[0].id.rfind("call_", 0), 0u);
  // Two calls; an unknown tool's values read as JSON where they are (and trimmed, as vLLM's);
  // a call without arguments.
  const auto two = parse_glm45_tool_calls(
      "<tool_call>lookup<arg_key>q</arg_key><arg_value>[1, 2]</arg_value><arg_key>s</arg_key>"
      "<arg_value>\nfree text\n</arg_value></tool_call>\n<tool_call>now\n</tool_call>",
      tools);
  ASSERT_TRUE(two.has_value());
  ASSERT_EQ(two->calls.size(), 2u);
  EXPECT_EQ(two->calls[0].arguments, R"({"q":[1,2],"s":"free text"})");
  EXPECT_EQ(two->calls[1].name, "now");
  EXPECT_EQ(two->calls[1].arguments, "{}");
  // A call cut off before its closing tag may have lost arguments or part of its name: text.
  EXPECT_FALSE(parse_glm45_tool_calls("<tool_call>get_wea", tools).has_value());
  EXPECT_FALSE(
      parse_glm45_tool_calls(
          "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>\n", tools)
          .has_value());
  // Values nested deeper than any tool's arguments stay text (writing them back would recurse).
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  const auto nested = parse_glm45_tool_calls(
      "<tool_call>f<arg_key>a</arg_key><arg_value>" + deep + "</arg_value></tool_call>", tools);
  ASSERT_TRUE(nested.has_value());
  EXPECT_EQ(nested->calls[0].arguments, nlohmann::json({{"a", deep}}).dump());
  EXPECT_FALSE(parse_hermes_tool_calls(
                   "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": " + deep + "}}</tool_call>")
                   .has_value());
  // Not calls: no name, a key without its value, text between the arguments or after the call.
  EXPECT_FALSE(parse_glm45_tool_calls("<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value>"
                                      "</tool_call>",
                                      tools)
                   .has_value());
  EXPECT_FALSE(
      parse_glm45_tool_calls("<tool_call>f<arg_key>a</arg_key></tool_call>", tools).has_value());
  EXPECT_FALSE(parse_glm45_tool_calls(
                   "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>so</tool_call>", tools)
                   .has_value());
  EXPECT_FALSE(parse_glm45_tool_calls("<tool_call>f</tool_call> and more", tools).has_value());
  // Without the request's tools (no schema), every value that is JSON reads as JSON.
  EXPECT_EQ(parse_glm45_tool_calls(
                "<tool_call>f<arg_key>n</arg_key><arg_value>7</arg_value></tool_call>", "")
                ->calls[0]
                .arguments,
            R"({"n":7})");
  // The template's format chooses the reader.
  EXPECT_TRUE(parse_tool_calls("<tool_call>f\n</tool_call>", tokenizer::ToolCallFormat::kGlm45, "")
                  .has_value());
  EXPECT_FALSE(
      parse_tool_calls("<tool_call>f\n</tool_call>", tokenizer::ToolCallFormat::kHermes, "")
          .has_value());
  EXPECT_FALSE(parse_tool_calls("<tool_call>{\"name\": \"f\"}</tool_call>",
                                tokenizer::ToolCallFormat::kNone, "")
                   .has_value());
}

TEST(ToolCalls, HermesBlocksAreReadAsCallsAndAnythingElseStaysText) {
  const auto one = parse_hermes_tool_calls(
      "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\", \"days\": 2}}\n</tool_call>");
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(one->content, "Let me look.");
  ASSERT_EQ(one->calls.size(), 1u);
  EXPECT_EQ(one->calls[0].name, "get_weather");
  EXPECT_EQ(one->calls[0].arguments, R"({"city":"Paris","days":2})");  // key order kept
  EXPECT_EQ(one->calls[0].id.rfind("call_", 0), 0u);
  // Two calls, whitespace between; arguments given as a string; a last call without its
  // closing tag (generation ended first) whose JSON is whole.
  const auto two = parse_hermes_tool_calls(
      "<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>\n\n"
      "<tool_call>{\"name\": \"b\"}");
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->content, "");
  ASSERT_EQ(two->calls.size(), 2u);
  EXPECT_EQ(two->calls[0].arguments, R"({"x": 1})");
  EXPECT_EQ(two->calls[1].name, "b");
  EXPECT_EQ(two->calls[1].arguments, "{}");
  EXPECT_NE(two->calls[0].id, two->calls[1].id);
  // Not calls: no block, JSON that is not an object with a name, text after a call.
  EXPECT_FALSE(parse_hermes_tool_calls("plain text").has_value());
  EXPECT_FALSE(parse_hermes_tool_calls("<tool_call>{\"name\": 3}</tool_call>").has_value());
  EXPECT_FALSE(parse_hermes_tool_calls("<tool_call>{\"na</tool_call>").has_value());
  EXPECT_FALSE(
      parse_hermes_tool_calls("<tool_call>{\"name\": \"a\"}</tool_call> and more").has_value());
}

TEST(ToolCalls, WithoutParallelCallsOnlyTheFirstIsGiven) {
  const std::string text =
      "<tool_call>{\"name\": \"a\"}</tool_call>\n<tool_call>{\"name\": \"b\"}</tool_call>";
  const auto all = parse_tool_calls(text, tokenizer::ToolCallFormat::kHermes, "");
  ASSERT_TRUE(all.has_value());
  EXPECT_EQ(all->calls.size(), 2u);
  const auto first = parse_tool_calls(text, tokenizer::ToolCallFormat::kHermes, "", false);
  ASSERT_TRUE(first.has_value());
  ASSERT_EQ(first->calls.size(), 1u);
  EXPECT_EQ(first->calls[0].name, "a");
  EXPECT_FALSE(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": false})")
                   .parallel_tool_calls);
  EXPECT_TRUE(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}]})")
                  .parallel_tool_calls);
}

// DeepSeek V3 and R1 write TYPE<sep>NAME and the arguments in a ```json fence; V3.1 NAME<sep>
// ARGUMENTS (the formats vLLM's deepseek_v3 and deepseek_v31 parsers read).
TEST(ToolCalls, DeepSeekCallsAreReadInBothVersions) {
  const auto v3 = parse_deepseek_tool_calls(
      "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
      "```json\n{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜>\n"
      "<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>");
  ASSERT_TRUE(v3.has_value());
  EXPECT_EQ(v3->content, "Checking.");
  ASSERT_EQ(v3->calls.size(), 2u);
  EXPECT_EQ(v3->calls[0].name, "get_weather");
  EXPECT_EQ(v3->calls[0].arguments, R"({"city":"Paris","days":2})");  // key order kept
  EXPECT_EQ(v3->calls[0].id.rfind("call_", 0), 0u);
  EXPECT_EQ(v3->calls[1].name, "now");
  EXPECT_EQ(v3->calls[1].arguments, "{}");
  EXPECT_NE(v3->calls[0].id, v3->calls[1].id);
  // V3.1, without the closing marker (the end of sequence came first).
  const auto v31 = parse_deepseek_tool_calls(
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}"
      "<｜tool▁call▁end｜>");
  ASSERT_TRUE(v31.has_value());
  EXPECT_EQ(v31->content, "");
  ASSERT_EQ(v31->calls.size(), 1u);
  EXPECT_EQ(v31->calls[0].name, "get_weather");
  EXPECT_EQ(v31->calls[0].arguments, R"({"city":"Oslo"})");
  EXPECT_TRUE(parse_tool_calls("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}"
                               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                               tokenizer::ToolCallFormat::kDeepSeek, "")
                  .has_value());
  // Not calls: a call cut off before its end, no separator, arguments that are not an object,
  // no call inside the markers, text after them, a name that is markup.
  for (const char* text :
       {"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f {}<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜> and more",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><b>\n```json\n{}\n```"
        "<｜tool▁call▁end｜>",
        "no call at all"})
    EXPECT_FALSE(parse_deepseek_tool_calls(text).has_value()) << text;
}

// Mistral: a JSON list after [TOOL_CALLS] (v3 tokenizers, Mixtral 8x22B), or [TOOL_CALLS]NAME
// [ARGS]{...} once per call (v11 and later); call ids of nine letters and digits, the only ids
// Mistral's templates take back in the next turn.
TEST(ToolCalls, MistralCallsAreReadInBothForms) {
  auto nine_alphanumerics = [](const std::string& id) {
    return id.size() == 9 &&
           std::all_of(id.begin(), id.end(), [](unsigned char c) { return std::isalnum(c) != 0; });
  };
  const auto list = parse_mistral_tool_calls(
      "Let me see. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}, {\"name\": \"now\", \"arguments\": \"{\\\"tz\\\": 1}\"}]");
  ASSERT_TRUE(list.has_value());
  EXPECT_EQ(list->content, "Let me see.");
  ASSERT_EQ(list->calls.size(), 2u);
  EXPECT_EQ(list->calls[0].name, "get_weather");
  EXPECT_EQ(list->calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(list->calls[1].name, "now");
  EXPECT_EQ(list->calls[1].arguments, R"({"tz":1})");
  EXPECT_TRUE(nine_alphanumerics(list->calls[0].id)) << list->calls[0].id;
  EXPECT_NE(list->calls[0].id, list->calls[1].id);
  const auto single = parse_mistral_tool_calls("[TOOL_CALLS]{\"name\": \"now\"}");
  ASSERT_TRUE(single.has_value());
  ASSERT_EQ(single->calls.size(), 1u);
  EXPECT_EQ(single->calls[0].arguments, "{}");
  const auto v11 = parse_mistral_tool_calls(
      "[TOOL_CALLS]get_weather[ARGS]{\"city\": "
      "\"Paris\"}[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}");
  ASSERT_TRUE(v11.has_value());
  EXPECT_EQ(v11->content, "");
  ASSERT_EQ(v11->calls.size(), 2u);
  EXPECT_EQ(v11->calls[0].name, "get_weather");
  EXPECT_EQ(v11->calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(v11->calls[1].name, "now");
  EXPECT_TRUE(nine_alphanumerics(v11->calls[1].id)) << v11->calls[1].id;
  EXPECT_EQ(parse_tool_calls("[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}",
                             tokenizer::ToolCallFormat::kMistral, "", false)
                ->calls.size(),
            1u);
  // Not calls: JSON cut off, a call without a name, arguments that are not an object, a name
  // without [ARGS], an empty list.
  for (const char* text :
       {"[TOOL_CALLS] [{\"name\": \"f\", \"argu", "[TOOL_CALLS] [{\"arguments\": {}}]",
        "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": 3}]", "[TOOL_CALLS]f{}",
        "[TOOL_CALLS]f[ARGS]not json", "[TOOL_CALLS] []", "plain text"})
    EXPECT_FALSE(parse_mistral_tool_calls(text).has_value()) << text;
}

// --chat-template FILE (vLLM's): a template that writes the tools, where the checkpoint's own
// does not (DeepSeek-V3's), replaces it, with the checkpoint's BOS and EOS; the calls are read in
// the format it writes. A file that cannot be read or parsed stops the stage with its name.
TEST(ChatTemplateFile, ReplacesTheCheckpointsTemplate) {
  namespace fs = std::filesystem;
  const fs::path model = fs::path(MOELINE_TEST_MODELS) / "mixtral-f32";
  const fs::path file =
      fs::temp_directory_path() / ("moeline-template-" + std::to_string(::getpid()) + ".jinja");
  std::ofstream(file) << "{{ bos_token }}{% for t in tools %}<tools>{{ t.function.name }}</tools>"
                         "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if false %}<｜tool▁calls▁begin｜>{% endif %}";
  runtime::Logger log("http", "http-test");
  const auto backend = make_backend(model, "", "tcp://127.0.0.1:9", "", log, file);
  ASSERT_NE(backend->chat, nullptr);
  EXPECT_EQ(backend->chat->tool_call_format(), tokenizer::ToolCallFormat::kDeepSeek);
  EXPECT_EQ(*backend->chat->render({{"user", "hi"}}, {.tools_json = R"([{"type": "function",
      "function": {"name": "get_weather"}}])"}),
            "<s><tools>get_weather</tools>hi");
  std::ofstream(file) << "{% if %}";
  EXPECT_THROW(make_backend(model, "", "tcp://127.0.0.1:9", "", log, file), runtime::ConfigError);
  fs::remove(file);
  EXPECT_THROW(make_backend(model, "", "tcp://127.0.0.1:9", "", log, file), runtime::ConfigError);
}

// A call forced on a template whose calls are not Hermes blocks is decoded as the bare document
// {"name", "arguments"} (as vLLM decodes forced calls), and read back as that, its id as the
// template's calls have them.
TEST(ToolCalls, AForcedCallsBareDocumentIsReadAsTheCall) {
  const std::string document =
      "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}} ";
  const auto deepseek =
      parse_tool_calls(document, tokenizer::ToolCallFormat::kDeepSeek, "", true, true);
  ASSERT_TRUE(deepseek.has_value());
  EXPECT_EQ(deepseek->content, "");
  ASSERT_EQ(deepseek->calls.size(), 1u);
  EXPECT_EQ(deepseek->calls[0].name, "get_weather");
  EXPECT_EQ(deepseek->calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(deepseek->calls[0].id.rfind("call_", 0), 0u);
  const auto mistral = parse_forced_call(document, tokenizer::ToolCallFormat::kMistral);
  ASSERT_TRUE(mistral.has_value());
  EXPECT_EQ(mistral->calls[0].id.size(), 9u);
  // Without bare_json the same text is no call of the format's; other text is no forced call.
  EXPECT_FALSE(parse_tool_calls(document, tokenizer::ToolCallFormat::kDeepSeek, "").has_value());
  for (const char* text :
       {"", "{\"name\": 1}", "{\"name\": \"f\", \"arguments\": [1]}", "{\"name\": \"f\"} and more"})
    EXPECT_FALSE(parse_forced_call(text, tokenizer::ToolCallFormat::kGlm45).has_value()) << text;
  // The front decodes it so for every format but Hermes.
  Backend backend;
  backend.chat = std::make_unique<tokenizer::ChatTemplate>(
      *tokenizer::ChatTemplate::from_template("<｜tool▁calls▁begin｜>", "", ""));
  CompletionRequest request = request_of(Endpoint::kChat, R"({"messages": [{"role": "user",
      "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"})");
  EXPECT_TRUE(forces_bare_json_call(request, backend));
  request.tool_choice = CompletionRequest::ToolChoice::kAuto;
  EXPECT_FALSE(forces_bare_json_call(request, backend));
  request.tool_choice = CompletionRequest::ToolChoice::kRequired;
  backend.chat = std::make_unique<tokenizer::ChatTemplate>(
      *tokenizer::ChatTemplate::from_template("<tool_call>", "", ""));
  EXPECT_FALSE(forces_bare_json_call(request, backend));
}

// A Responses request as the chat request that serves it: the instructions a system message,
// developer a system role, text parts joined, calls one after another one assistant turn, a call's
// output a tool message, flat function tools nested as chat's.
TEST(ResponsesApi, InputItemsBecomeTheChatMessages) {
  const auto parsed = parse_responses_request(R"({"model": "m", "instructions": "Be brief.",
      "input": [{"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                             {"type": "input_text", "text": "in Paris?"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
      "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
      "tool_choice": {"type": "function", "name": "f"}, "max_output_tokens": 9,
      "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}})");
  ASSERT_TRUE(std::holds_alternative<ResponsesRequest>(parsed));
  const auto& request = std::get<ResponsesRequest>(parsed);
  EXPECT_EQ(request.id.rfind("resp_", 0), 0u);
  const auto chat = nlohmann::json::parse(request.chat_body);
  const auto& messages = chat["messages"];
  ASSERT_EQ(messages.size(), 5u) << chat;
  EXPECT_EQ(messages[0], (nlohmann::json{{"role", "system"}, {"content", "Be brief."}}));
  EXPECT_EQ(messages[1]["role"], "system");
  EXPECT_EQ(messages[2]["content"], "Weather in Paris?");
  EXPECT_EQ(messages[3]["role"], "assistant");
  ASSERT_EQ(messages[3]["tool_calls"].size(), 2u);
  EXPECT_EQ(messages[3]["tool_calls"][1]["function"]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(messages[4],
            (nlohmann::json{{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}}));
  EXPECT_EQ(chat["tools"][0]["function"]["name"], "f");
  EXPECT_EQ(chat["tool_choice"]["function"]["name"], "f");
  EXPECT_EQ(chat["max_tokens"], 9);
  EXPECT_EQ(chat["response_format"]["json_schema"]["name"], "w");
  // The chat request it becomes is one the chat parser takes.
  EXPECT_TRUE(
      std::holds_alternative<CompletionRequest>(parse_request(Endpoint::kChat, request.chat_body)));
  // Refused by name: stored responses, hosted tools, images, a field of the wrong type.
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"input": "x", "previous_response_id": "resp_1"})", "previous_response_id"},
           {R"({"input": "x", "tools": [{"type": "file_search"}]})", "tools[0]"},
           {R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})",
            "input[0].content"},
           {R"({"input": [{"role": 7, "content": "x"}]})", ""},
           {R"({"input": "x", "stream": "yes"})", ""},
           {R"({"model": "m"})", "input"}}) {
    const auto refused = parse_responses_request(body);
    ASSERT_TRUE(std::holds_alternative<ApiError>(refused)) << body;
    EXPECT_EQ(std::get<ApiError>(refused).param, param) << body;
    EXPECT_EQ(std::get<ApiError>(refused).status, 400) << body;
  }
}

// A streamed chat answer (cut anywhere) as the Responses events: created, the reasoning and the
// message as items with their deltas, a call as a function_call item, completed with the usage;
// every event named by its type and numbered.
TEST(ResponsesApi, AChatStreamBecomesTheResponsesEvents) {
  const auto parsed = parse_responses_request(R"({"input": "x", "stream": true})");
  ResponsesStream translated(std::get<ResponsesRequest>(parsed));
  std::string written;
  httplib::DataSink sink;
  sink.write = [&written](const char* data, size_t size) {
    written.append(data, size);
    return true;
  };
  const std::string chat =
      R"(data: {"id":"c","model":"m","created":5,"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"hm"},"finish_reason":null}]})"
      "\n\n: keep-alive\n\n"
      R"(data: {"choices":[{"index":0,"delta":{"content":"It is "},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{"content":"sunny."},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]})"
      "\n\n"
      R"(data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}})"
      "\n\ndata: [DONE]\n\n";
  for (size_t at = 0; at < chat.size(); at += 7)
    ASSERT_TRUE(translated.feed(chat.data() + at, std::min<size_t>(7, chat.size() - at), sink));
  std::vector<std::string> types;
  std::vector<nlohmann::json> events;
  size_t at = 0;
  while ((at = written.find("event: ", at)) != std::string::npos) {
    const size_t line = written.find('\n', at);
    types.push_back(written.substr(at + 7, line - at - 7));
    const size_t data = line + 1 + 6;  // "data: "
    events.push_back(nlohmann::json::parse(written.substr(data, written.find('\n', data) - data)));
    EXPECT_EQ(events.back()["type"], types.back());
    EXPECT_EQ(events.back()["sequence_number"], static_cast<int64_t>(events.size() - 1));
    at = line;
  }
  EXPECT_NE(written.find(": keep-alive\n\n"), std::string::npos);
  const std::vector<std::string> want = {"response.created",
                                         "response.in_progress",
                                         "response.output_item.added",
                                         "response.reasoning_text.delta",
                                         "response.reasoning_text.done",
                                         "response.output_item.done",
                                         "response.output_item.added",
                                         "response.content_part.added",
                                         "response.output_text.delta",
                                         "response.output_text.delta",
                                         "response.output_text.done",
                                         "response.content_part.done",
                                         "response.output_item.done",
                                         "response.output_item.added",
                                         "response.function_call_arguments.delta",
                                         "response.function_call_arguments.done",
                                         "response.output_item.done",
                                         "response.completed"};
  ASSERT_EQ(types, want);
  const auto& done = events.back()["response"];
  EXPECT_EQ(done["status"], "completed");
  EXPECT_EQ(done["model"], "m");
  ASSERT_EQ(done["output"].size(), 3u);
  EXPECT_EQ(done["output"][0]["content"][0]["text"], "hm");
  EXPECT_EQ(done["output"][1]["content"][0]["text"], "It is sunny.");
  EXPECT_EQ(done["output"][2]["call_id"], "call_1");
  EXPECT_EQ(done["usage"]["total_tokens"], 7);
  // An answer of no text (the first chunk's empty delta, then the end) still has its message, as
  // the whole response has, and no reasoning item.
  ResponsesStream empty(std::get<ResponsesRequest>(parsed));
  written.clear();
  const std::string nothing =
      R"(data: {"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]})"
      "\n\n"
      R"(data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]})"
      "\n\ndata: [DONE]\n\n";
  ASSERT_TRUE(empty.feed(nothing.data(), nothing.size(), sink));
  const size_t last = written.rfind("data: ") + 6;
  const auto incomplete =
      nlohmann::json::parse(written.substr(last, written.find('\n', last) - last));
  EXPECT_EQ(incomplete["type"], "response.incomplete");
  ASSERT_EQ(incomplete["response"]["output"].size(), 1u) << incomplete;
  EXPECT_EQ(incomplete["response"]["output"][0]["type"], "message");
  EXPECT_EQ(incomplete["response"]["output"][0]["status"], "incomplete");
  EXPECT_EQ(incomplete["response"]["incomplete_details"]["reason"], "max_output_tokens");
}

TEST(ToolCalls, AStreamHoldsBackFromWhereACallMayBegin) {
  ToolCallHold hold;
  std::string content;
  for (const char* delta :
       {"Sure", ", <", "to", "ol_c", "all>\n{\"name\"", ": \"f\"}", "</tool_call>"})
    content += hold.feed(delta);
  EXPECT_EQ(content, "Sure, ");
  EXPECT_EQ(hold.held(), "<tool_call>\n{\"name\": \"f\"}</tool_call>");
  // A "<" that does not become the marker is released when the text shows it.
  ToolCallHold plain;
  EXPECT_EQ(plain.feed("a <"), "a ");
  EXPECT_EQ(plain.feed("b> c"), "<b> c");
  EXPECT_EQ(plain.feed("<tool"), "");
  EXPECT_EQ(plain.held(), "<tool");
  // The format's own marker: DeepSeek's, split inside a multi-byte character.
  const std::string marker(tool_call_marker(tokenizer::ToolCallFormat::kDeepSeek));
  ToolCallHold deepseek(marker);
  std::string said = deepseek.feed("Sure <" + marker.substr(0, 2));
  said += deepseek.feed(marker.substr(2, 8));
  said += deepseek.feed(marker.substr(10) + "<｜tool▁call▁begin｜>f");
  EXPECT_EQ(said, "Sure <");
  EXPECT_EQ(deepseek.held(), marker + "<｜tool▁call▁begin｜>f");
  ToolCallHold mistral(tool_call_marker(tokenizer::ToolCallFormat::kMistral));
  EXPECT_EQ(mistral.feed("a <tool_call> [TOOL"), "a <tool_call> ");
  EXPECT_EQ(mistral.feed("_CALLS] [{"), "");
  EXPECT_EQ(mistral.held(), "[TOOL_CALLS] [{");
}

// A model whose vocabulary marks its tool-call marker special would lose the marker from the
// text it streams (the gateway drops special tokens by default), and with it every call: with
// tools on offer its answers keep their special tokens, as vLLM's parsers ask for them.
TEST(ToolCalls, AMarkerTheVocabularyMarksSpecialIsKeptInTheText) {
  std::ifstream file(std::string(MOELINE_TEST_MODELS) + "/mixtral-f32/tokenizer.json");
  ASSERT_TRUE(file.good());
  nlohmann::json vocabulary = nlohmann::json::parse(file);
  auto backend_with = [&](bool special) {
    nlohmann::json copy = vocabulary;
    copy["added_tokens"].push_back({{"id", 32000},
                                    {"content", "[TOOL_CALLS]"},
                                    {"single_word", false},
                                    {"lstrip", false},
                                    {"rstrip", false},
                                    {"normalized", false},
                                    {"special", special}});
    auto loaded = tokenizer::Tokenizer::from_json(copy.dump(), "test");
    EXPECT_TRUE(loaded.ok()) << loaded.error().message;
    auto chat = tokenizer::ChatTemplate::from_template(
        "{% for m in messages %}[INST]{{ m.content }}[/INST]{% if m.tool_calls %}[TOOL_CALLS] "
        "{{ m.tool_calls | tojson }}{% endif %}{% endfor %}",
        "<s>", "</s>");
    EXPECT_TRUE(chat.ok());
    auto backend = std::make_unique<Backend>();
    backend->name = "mistral";
    backend->context = 4096;
    backend->tokenizer = std::make_unique<tokenizer::Tokenizer>(std::move(*loaded));
    backend->chat = std::make_unique<tokenizer::ChatTemplate>(std::move(*chat));
    return backend;
  };
  auto skips = [](const Backend& backend, const std::string& body) {
    const auto options = to_options(request_of(Endpoint::kChat, body), "", backend);
    EXPECT_TRUE(std::holds_alternative<sdk::GenerateOptions>(options));
    return std::get<sdk::GenerateOptions>(options).skip_special_tokens;
  };
  const std::string with_tools = R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]})";
  const std::string without_tools = R"({"messages": [{"role": "user", "content": "x"}]})";
  const auto special = backend_with(true);
  EXPECT_EQ(special->chat->tool_call_format(), tokenizer::ToolCallFormat::kMistral);
  EXPECT_FALSE(skips(*special, with_tools));
  EXPECT_TRUE(skips(*special, without_tools));
  EXPECT_TRUE(skips(*backend_with(false), with_tools));
  // vLLM's skip_special_tokens, asked for by the request.
  EXPECT_FALSE(skips(*special, R"({"messages": [{"role": "user", "content": "x"}],
      "skip_special_tokens": false})"));
}

sdk::Event event_of(sdk::EventKind kind, const std::string& text, int32_t token) {
  sdk::Event event;
  event.kind = kind;
  event.text = text;
  event.token_ids = {token};
  if (kind == sdk::EventKind::kFinished) {
    event.finish_reason = "stop";
    event.usage.prompt_tokens = 3;  // the gateway's count, on the last event
  }
  return event;
}

sdk::Event finished_by(const std::string& text, const std::string& reason) {
  sdk::Event event = event_of(sdk::EventKind::kFinished, text, 8);
  event.finish_reason = reason;
  return event;
}

TEST(Absorb, TextHeldForAStopStringIsReleasedWhenTheStreamFinishesWithoutOne) {
  // The answer ends on the first characters of a stop string: held back while it could still
  // become one, then part of the answer when the stream finishes.
  StopMatcher stops({"\n\n", "END"});
  Outcome outcome;
  std::string emitted;
  EXPECT_FALSE(absorb(event_of(sdk::EventKind::kDelta, "one line\n", 7), stops, outcome, emitted));
  EXPECT_EQ(emitted, "one line");
  EXPECT_TRUE(absorb(finished_by("the E", "length"), stops, outcome, emitted));
  EXPECT_EQ(emitted, "one line\nthe E");
  EXPECT_EQ(outcome.finish_reason, "length");
  EXPECT_EQ(outcome.ids, (std::vector<int32_t>{7, 8}));
  // Found in the last delta: cut there, and the request ends by it.
  StopMatcher found({"END"});
  Outcome cut;
  std::string kept;
  EXPECT_TRUE(absorb(finished_by("doneEND more", "eos"), found, cut, kept));
  EXPECT_EQ(kept, "done");
  EXPECT_EQ(cut.finish_reason, "stop");
}

// What ended an answer, as vLLM's stop_reason: a stop token (the last the pipeline gave, when
// it is among stop_token_ids), the stop string (kept in the text with include_stop_str_in_output),
// or nothing (the model's end of sequence).
TEST(Absorb, TheStopTokenOrStringThatEndedTheAnswerIsNamed) {
  StopMatcher tokens({}, {9, 8});
  Outcome by_token;
  std::string text;
  EXPECT_TRUE(absorb(event_of(sdk::EventKind::kFinished, "end.", 8), tokens, by_token, text));
  EXPECT_EQ(by_token.stop_reason, 8);
  EXPECT_EQ(text, "end.");
  // The stop token in a delta, the end in an event of its own.
  Outcome apart;
  EXPECT_FALSE(absorb(event_of(sdk::EventKind::kDelta, "a", 9), tokens, apart, text));
  sdk::Event end = event_of(sdk::EventKind::kFinished, "", 0);
  end.token_ids.clear();
  EXPECT_TRUE(absorb(end, tokens, apart, text));
  EXPECT_EQ(apart.stop_reason, 9);
  Outcome by_eos;
  EXPECT_TRUE(absorb(event_of(sdk::EventKind::kFinished, "", 2), tokens, by_eos, text));
  EXPECT_TRUE(by_eos.stop_reason.is_null());
  Outcome cut_short;
  EXPECT_TRUE(absorb(finished_by("x", "length"), tokens, cut_short, text));  // token 8, length
  EXPECT_TRUE(cut_short.stop_reason.is_null());
  StopMatcher kept({"END"}, {}, /*include_stop=*/true);
  Outcome by_string;
  std::string shown;
  EXPECT_FALSE(absorb(event_of(sdk::EventKind::kDelta, "done E", 1), kept, by_string, shown));
  EXPECT_TRUE(absorb(event_of(sdk::EventKind::kDelta, "ND more", 2), kept, by_string, shown));
  EXPECT_EQ(shown, "done END");
  EXPECT_EQ(by_string.stop_reason, "END");
}

TEST(TokenStream, AStreamAStopStringEndsIsStillRunningInThePipeline) {
  // Cut by a stop string, the stream is over for its client but not for the gateway, which goes
  // on decoding unless the front cancels it: pipeline_ended() must say so.
  CompletionRequest request;
  request.endpoint = Endpoint::kCompletions;
  request.stream = true;
  request.stop = {"END"};
  Backend backend;
  runtime::Histogram delay({1.0});
  runtime::Counter failures;
  auto completion = std::make_shared<Completion>();
  httplib::DataSink sink;
  sink.write = [](const char*, size_t) { return true; };
  TokenStream cut(Endpoint::kCompletions, request, backend, completion, 3, &delay, &failures);
  EXPECT_TRUE(cut.on_event(event_of(sdk::EventKind::kDelta, "some", 1), {}, sink));
  EXPECT_FALSE(cut.on_event(event_of(sdk::EventKind::kDelta, " textEND", 2), {}, sink));
  EXPECT_FALSE(cut.pipeline_ended());
  TokenStream finished(Endpoint::kCompletions, request, backend, completion, 3, &delay, &failures);
  EXPECT_FALSE(finished.on_event(event_of(sdk::EventKind::kFinished, "all", 1), {}, sink));
  EXPECT_TRUE(finished.pipeline_ended());
}

// The data of each server-sent event `response` writes, in order ("[DONE]" last).
std::vector<std::string> written_events(StreamedResponse& response) {
  std::string written;
  httplib::DataSink sink;
  sink.write = [&written](const char* data, size_t size) {
    written.append(data, size);
    return true;
  };
  ClientLink no_socket("", -1, "", -1);
  EXPECT_TRUE(response.write(sink, std::chrono::seconds(5), no_socket));
  std::vector<std::string> data;
  for (size_t at = 0; (at = written.find("data: ", at)) != std::string::npos;) {
    const size_t end = written.find("\n\n", at);
    data.push_back(written.substr(at + 6, end - at - 6));
    at = end;
  }
  return data;
}

// A streamed response of two choices (n = 2) with tools on offer: choice 1 writes text and then
// a call split over two events, choice 0 plain text. Each choice's chunks carry its index; choice
// 1 gets its text up to the call, the call whole in one chunk (its index among the choice's
// calls: 0, not the choice's), and finish_reason tool_calls; the usage counts both choices'
// tokens; [DONE] ends it.
TEST(StreamedResponse, ChoicesInterleaveAndACallComesWholeWithItsFinishReason) {
  CompletionRequest request;
  request.endpoint = Endpoint::kChat;
  request.stream = true;
  request.include_usage = true;
  request.chat.tools_json = R"([{"type": "function", "function": {"name": "f"}}])";
  Backend backend;
  // A template that writes Hermes <tool_call> blocks: the format the calls are read back in.
  backend.chat = std::make_unique<tokenizer::ChatTemplate>(
      *tokenizer::ChatTemplate::from_template("<tool_call>{{ messages[0].content }}", "", ""));
  runtime::Histogram delay({1.0});
  runtime::Counter failures;
  Completion base;
  base.id = "chatcmpl-1";
  base.model = "m";
  std::vector<StreamedResponse::Choice> choices;
  for (int64_t i = 0; i < 2; ++i) {
    auto completion = std::make_shared<Completion>(base);
    completion->index = i;
    choices.push_back({std::make_shared<RequestChannel>(),
                       event_of(sdk::EventKind::kDelta, i == 1 ? "Sure, <tool" : "plain", 1),
                       std::make_unique<TokenStream>(Endpoint::kChat, request, backend, completion,
                                                     3, &delay, &failures)});
  }
  choices[1].channel->push(event_of(sdk::EventKind::kDelta,
                                    "_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n", 2));
  choices[1].channel->push(event_of(sdk::EventKind::kFinished, "</tool_call>", 3));
  choices[0].channel->push(event_of(sdk::EventKind::kFinished, " text", 4));
  StreamedResponse response(Endpoint::kChat, std::move(choices), true, 2);
  std::vector<std::string> data = written_events(response);
  std::string content[2], finish[2];
  std::vector<nlohmann::json> calls;
  nlohmann::json usage;
  ASSERT_FALSE(data.empty());
  EXPECT_EQ(data.back(), "[DONE]");
  data.pop_back();
  for (const std::string& text : data) {
    const auto chunk = nlohmann::json::parse(text);
    if (chunk["choices"].empty()) {
      usage = chunk["usage"];
      continue;
    }
    const auto& choice = chunk["choices"][0];
    const int64_t index = choice["index"];
    ASSERT_TRUE(index == 0 || index == 1) << text;
    EXPECT_TRUE(finish[index].empty()) << "a chunk after the finish: " << text;
    if (choice["delta"].contains("content")) content[index] += choice["delta"]["content"];
    if (choice["delta"].contains("tool_calls"))
      for (const auto& call : choice["delta"]["tool_calls"]) calls.push_back(call);
    if (!choice["finish_reason"].is_null()) finish[index] = choice["finish_reason"];
  }
  EXPECT_EQ(content[1], "Sure, ");
  EXPECT_EQ(content[0], "plain text");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["function"]["name"], "f");
  EXPECT_EQ(calls[0]["function"]["arguments"], R"({"a":1})");
  EXPECT_EQ(finish[1], "tool_calls");
  EXPECT_EQ(finish[0], "stop");
  EXPECT_EQ(usage["completion_tokens"], 5);
  EXPECT_EQ(usage["prompt_tokens"], 3);
}

// Answers of models that think, and how they split: a block only at the start (after
// whitespace), the whitespace around the reasoning and before the content dropped, an answer cut
// off inside the block all reasoning, a prompt that opened the block (kOpen) read from the first
// character, and anything that is not a block left exactly as generated.
struct ReasoningCase {
  const char* text;
  ReasoningStart start;
  const char* reasoning;
  const char* content;
};
const ReasoningCase kReasoningCases[] = {
    {"<think>\nWhy 42?\n</think>\n\nThe answer is 42.", ReasoningStart::kAtStart, "Why 42?",
     "The answer is 42."},
    {"  \n<think>a\n\nb</think>c", ReasoningStart::kAtStart, "a\n\nb", "c"},
    {"<think>\n\n</think>\n\nHi", ReasoningStart::kAtStart, "", "Hi"},
    {"<think>cut off in the middle \n", ReasoningStart::kAtStart, "cut off in the middle", ""},
    {"<think>ends on </thi", ReasoningStart::kAtStart, "ends on </thi", ""},
    {"<think>a </thinking> b</think> c", ReasoningStart::kAtStart, "a </thinking> b", "c"},
    {"Hi <think>not a block</think>", ReasoningStart::kAtStart, "",
     "Hi <think>not a block</think>"},
    {"  <thin", ReasoningStart::kAtStart, "", "  <thin"},
    {"  plain\n", ReasoningStart::kAtStart, "", "  plain\n"},
    {"", ReasoningStart::kAtStart, "", ""},
    {"\nOpened by the prompt.\n</think>\n\nAnswer <think>x</think>", ReasoningStart::kOpen,
     "Opened by the prompt.", "Answer <think>x</think>"},
    {"<think>x</think>y", ReasoningStart::kOpen, "<think>x", "y"},
    {"never closed", ReasoningStart::kOpen, "never closed", ""},
    {"<think>x</think>y", ReasoningStart::kOff, "", "<think>x</think>y"},
};

TEST(Reasoning, ABlockAtTheStartIsReasoningAndTheRestIsContent) {
  for (const ReasoningCase& c : kReasoningCases) {
    const ReasoningParts parts = split_reasoning(c.text, c.start);
    EXPECT_EQ(parts.reasoning, c.reasoning) << c.text;
    EXPECT_EQ(parts.content, c.content) << c.text;
  }
}

TEST(Reasoning, AStreamAgreesWithTheWholeTextUnderEverySplit) {
  // Every split of each answer into three deltas gives out the same reasoning and content as
  // the whole text, and never gives out reasoning after content.
  for (const ReasoningCase& c : kReasoningCases) {
    const std::string text = c.text;
    for (size_t i = 0; i <= text.size(); ++i)
      for (size_t j = i; j <= text.size(); ++j) {
        ReasoningStream stream(c.start);
        std::string reasoning, content;
        for (const std::string& delta :
             {text.substr(0, i), text.substr(i, j - i), text.substr(j), std::string()}) {
          const ReasoningParts parts = stream.feed(delta);
          if (!content.empty()) {
            EXPECT_TRUE(parts.reasoning.empty()) << text << " split " << i << "," << j;
          }
          reasoning += parts.reasoning;
          content += parts.content;
        }
        const ReasoningParts rest = stream.finish();
        if (!content.empty()) {
          EXPECT_TRUE(rest.reasoning.empty()) << text;
        }
        EXPECT_EQ(reasoning + rest.reasoning, c.reasoning) << text << " split " << i << "," << j;
        EXPECT_EQ(content + rest.content, c.content) << text << " split " << i << "," << j;
      }
  }
}

TEST(Reasoning, APromptThatEndsInAnOpenBlockStartsTheAnswerInside) {
  EXPECT_TRUE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_TRUE(prompt_opens_reasoning("<｜Assistant｜><think>"));
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n"));
  EXPECT_FALSE(prompt_opens_reasoning(""));
}

TEST(Reasoning, OnlyChatAnswersOfAThinkingTemplateAreRead) {
  Backend backend;
  backend.chat = std::make_unique<tokenizer::ChatTemplate>(
      tokenizer::ChatTemplate::builtin(tokenizer::ChatTemplate::Format::kQwen3, "", "<|im_end|>"));
  CompletionRequest chat;
  sdk::GenerateOptions options;
  options.prompt = "<|im_start|>assistant\n";
  EXPECT_EQ(reasoning_start(chat, backend, options), ReasoningStart::kAtStart);
  options.prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n";  // enable_thinking false
  EXPECT_EQ(reasoning_start(chat, backend, options), ReasoningStart::kOff);
  options.prompt = "<|im_start|>assistant\n<think>\n";
  EXPECT_EQ(reasoning_start(chat, backend, options), ReasoningStart::kOpen);
  sdk::GenerateOptions structured = options;  // its grammar then begins after the block
  structured.structured = sdk::StructuredOutput::kJsonObject;
  EXPECT_EQ(reasoning_start(chat, backend, structured), ReasoningStart::kOpen);
  CompletionRequest completions;
  completions.endpoint = Endpoint::kCompletions;
  EXPECT_EQ(reasoning_start(completions, backend, options), ReasoningStart::kOff);
  backend.reads_reasoning = false;  // --reasoning-parser none
  EXPECT_EQ(reasoning_start(chat, backend, options), ReasoningStart::kOff);
  // A template that does not think: only a prompt that opens a block makes one.
  Backend plain;
  plain.chat = std::make_unique<tokenizer::ChatTemplate>(
      *tokenizer::ChatTemplate::from_template("{{ messages[0].content }}", "", ""));
  EXPECT_EQ(reasoning_start(chat, plain, options), ReasoningStart::kOpen);
  options.prompt = "<|im_start|>assistant\n";
  EXPECT_EQ(reasoning_start(chat, plain, options), ReasoningStart::kOff);
}

// A streamed chat answer that thinks, split mid-marker across events, with tools on offer: the
// reasoning comes as reasoning_content deltas (the role on the first chunk), the text after the
// block as content, and the call after it read from the content; log-probabilities go with
// each token's chunk.
TEST(StreamedResponse, ReasoningComesAsReasoningContentBeforeTheContent) {
  CompletionRequest request;
  request.endpoint = Endpoint::kChat;
  request.stream = true;
  request.chat.tools_json = R"([{"type": "function", "function": {"name": "f"}}])";
  Backend backend;
  backend.chat = std::make_unique<tokenizer::ChatTemplate>(
      *tokenizer::ChatTemplate::from_template("<tool_call>{{ messages[0].content }}", "", ""));
  runtime::Histogram delay({1.0});
  runtime::Counter failures;
  Completion base;
  base.id = "chatcmpl-1";
  auto completion = std::make_shared<Completion>(base);
  std::vector<StreamedResponse::Choice> choices;
  choices.push_back({std::make_shared<RequestChannel>(),
                     event_of(sdk::EventKind::kDelta, "<think>\nLet me", 1),
                     std::make_unique<TokenStream>(Endpoint::kChat, request, backend, completion, 3,
                                                   &delay, &failures, ReasoningStart::kAtStart)});
  for (const char* text : {" think. \n</thi", "nk>\n\nCalling", " it.<tool_call>\n",
                           "{\"name\": \"f\", \"arguments\": {}}\n"})
    choices[0].channel->push(event_of(sdk::EventKind::kDelta, text, 2));
  choices[0].channel->push(event_of(sdk::EventKind::kFinished, "</tool_call>", 3));
  StreamedResponse response(Endpoint::kChat, std::move(choices), false);
  const std::vector<std::string> events = written_events(response);
  ASSERT_FALSE(events.empty());
  std::string reasoning, content, finish;
  std::vector<nlohmann::json> calls;
  bool role_first = false, content_seen = false;
  size_t chunks = 0;
  for (const std::string& data : events) {
    if (data == "[DONE]") break;
    const auto delta = nlohmann::json::parse(data)["choices"][0]["delta"];
    if (chunks++ == 0) role_first = delta.value("role", "") == "assistant";
    if (delta.contains("reasoning_content")) {
      EXPECT_FALSE(content_seen) << "reasoning after the content: " << data;
      reasoning += delta["reasoning_content"];
    }
    if (delta.contains("content")) {
      content += delta["content"];
      content_seen = content_seen || !delta["content"].get<std::string>().empty();
    }
    if (delta.contains("tool_calls"))
      for (const auto& call : delta["tool_calls"]) calls.push_back(call);
    const auto reason = nlohmann::json::parse(data)["choices"][0]["finish_reason"];
    if (!reason.is_null()) finish = reason;
  }
  EXPECT_TRUE(role_first) << events.front();
  EXPECT_EQ(reasoning, "Let me think.");
  EXPECT_EQ(content, "Calling it.");
  ASSERT_EQ(calls.size(), 1u) << events.size() << " events";
  EXPECT_EQ(calls[0]["function"]["name"], "f");
  EXPECT_EQ(finish, "tool_calls");
}

TEST(OpenAiResponse, ReasoningContentBesideTheContent) {
  Completion c;
  c.id = "chatcmpl-1";
  c.finish_reason = "stop";
  c.text = "42.";
  EXPECT_FALSE(completion_response(Endpoint::kChat, {&c, 1})["choices"][0]["message"].contains(
      "reasoning_content"));
  c.reasoning = "Six times seven.";
  const auto message = completion_response(Endpoint::kChat, {&c, 1})["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "Six times seven.");
  EXPECT_EQ(message["content"], "42.");
}

TEST(OpenAiResponse, ToolCallsInOpenAisMessageShape) {
  Completion c;
  c.id = "chatcmpl-1";
  c.finish_reason = "tool_calls";
  c.tool_calls = {{"call_1", "get_weather", R"({"city":"Paris"})"}};
  const nlohmann::json only_calls = completion_response(Endpoint::kChat, {&c, 1});
  const auto& message = only_calls["choices"][0]["message"];
  EXPECT_TRUE(message["content"].is_null());
  EXPECT_EQ(message["tool_calls"],
            nlohmann::json::parse(R"([{"id": "call_1", "type": "function", "function":
                {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}])"));
  EXPECT_EQ(only_calls["choices"][0]["finish_reason"], "tool_calls");
  c.text = "Let me look.";
  EXPECT_EQ(completion_response(Endpoint::kChat, {&c, 1})["choices"][0]["message"]["content"],
            "Let me look.");
}

TEST(OpenAiRequest, ToolsAndToolTurnsAreReadForTheTemplate) {
  const CompletionRequest r = request_of(Endpoint::kChat, R"({
    "messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "tools": [{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})");
  ASSERT_EQ(r.messages.size(), 3u);
  ASSERT_EQ(r.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r.messages[1].tool_calls[0].id, "call_1");
  EXPECT_EQ(r.messages[1].tool_calls[0].name, "get_weather");
  EXPECT_EQ(r.messages[1].tool_calls[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(r.messages[2].tool_call_id, "call_1");
  // The tools as the body wrote them: "type" before "function", "parameters" in its order.
  EXPECT_EQ(r.chat.tools_json,
            R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":)"
            R"("object","properties":{"city":{"type":"string"}}}}}])");
  // tool_choice "none": the tools are not shown to the model.
  EXPECT_TRUE(request_of(Endpoint::kChat, R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})")
                  .chat.tools_json.empty());
}

// A loopback TCP connection: the server's side (accepted) and the client's, with the addresses a
// server's handler is told (the client's address and port, the server's port).
struct Loopback {
  int server = -1, client = -1;
  std::string client_address;
  int client_port = -1, server_port = -1;
  Loopback() {
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(::listen(listener, 1), 0);
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
    server_port = ntohs(address.sin_port);
    client = ::socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    server = ::accept(listener, nullptr, nullptr);
    ::close(listener);
    sockaddr_in mine{};
    length = sizeof(mine);
    ::getsockname(client, reinterpret_cast<sockaddr*>(&mine), &length);
    client_port = ntohs(mine.sin_port);
    client_address = "127.0.0.1";
  }
  ~Loopback() {
    if (client >= 0) ::close(client);
    if (server >= 0) ::close(server);
  }
  ClientLink link() const {
    return ClientLink(client_address, client_port, "127.0.0.1", server_port);
  }
};

TEST(ClientLink, FindsTheConnectionByItsAddressesAndSeesItsClientLeave) {
  Loopback connection;
  ClientLink link = connection.link();
  EXPECT_FALSE(link.gone());
  // A pipelined request waiting to be read is a client still there.
  ASSERT_EQ(::write(connection.client, "GET", 3), 3);
  EXPECT_FALSE(link.gone());
  char read_back[3];
  ASSERT_EQ(::recv(connection.server, read_back, 3, MSG_WAITALL), 3);
  ::close(connection.client);
  connection.client = -1;
  EXPECT_TRUE(link.gone());
  EXPECT_TRUE(link.gone());  // and it stays gone
  // A client that resets the connection (the kernel no longer has it; its socket says so).
  Loopback reset;
  ClientLink reset_link = reset.link();
  EXPECT_FALSE(reset_link.gone());
  const linger abort_on_close{1, 0};
  ::setsockopt(reset.client, SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof(abort_on_close));
  ::close(reset.client);
  reset.client = -1;
  EXPECT_TRUE(reset_link.gone());
  // Another connection's addresses, or none (not TCP): never taken for gone.
  Loopback other;
  ClientLink wrong(other.client_address, other.client_port + 1, "127.0.0.1", other.server_port);
  ::close(other.client);
  other.client = -1;
  EXPECT_FALSE(wrong.gone());
  ClientLink none("", -1, "", -1);
  EXPECT_FALSE(none.gone());
}

// A streamed completion of one choice: its first event, then what comes on its channel.
struct OneChoiceStream {
  OneChoiceStream() {
    request.endpoint = Endpoint::kCompletions;
    request.stream = true;
  }
  std::unique_ptr<StreamedResponse> response(std::shared_ptr<RequestChannel> channel,
                                             sdk::Event first) {
    std::vector<StreamedResponse::Choice> choices;
    choices.push_back(
        {std::move(channel), std::move(first),
         std::make_unique<TokenStream>(Endpoint::kCompletions, request, backend,
                                       std::make_shared<Completion>(), 3, &delay, &failures)});
    return std::make_unique<StreamedResponse>(Endpoint::kCompletions, std::move(choices), false);
  }
  CompletionRequest request;
  Backend backend;
  runtime::Histogram delay{{1.0}};
  runtime::Counter failures;
};

// A stream between two tokens (nothing to write, so no write can fail) ends once its client is
// seen gone, well before its timeout.
TEST(StreamedResponse, AClientThatLeavesWhileNothingIsWrittenEndsTheStream) {
  OneChoiceStream stream;
  auto response = stream.response(std::make_shared<RequestChannel>(),
                                  event_of(sdk::EventKind::kDelta, "first", 1));
  Loopback connection;
  ClientLink link = connection.link();
  httplib::DataSink sink;
  sink.write = [](const char*, size_t) { return true; };
  std::thread leave([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ::shutdown(connection.client, SHUT_RDWR);
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(response->write(sink, std::chrono::seconds(60), link));
  leave.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_TRUE(link.gone());
  EXPECT_EQ(stream.failures.value(), 0);  // seen, not a failed write
}

// --request-timeout-s bounds each wait for an event, not the stream: a stream whose events keep
// coming (every 50 ms, 600 ms in all) outlives a 400 ms timeout; one that falls silent for longer
// ends with a timeout error. (Margins of 8x: a loaded machine stretches the gaps, not past them.)
TEST(StreamedResponse, TheTimeoutBoundsEachWaitNotTheStream) {
  OneChoiceStream stream;
  ClientLink no_socket("", -1, "", -1);
  for (const bool falls_silent : {false, true}) {
    auto channel = std::make_shared<RequestChannel>();
    auto response = stream.response(channel, event_of(sdk::EventKind::kDelta, "0", 1));
    std::thread producer([&] {
      for (int i = 1; i <= 12; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        channel->push(event_of(sdk::EventKind::kDelta, std::to_string(i), i + 1));
      }
      if (!falls_silent) channel->push(event_of(sdk::EventKind::kFinished, "", 14));
    });
    std::string written;
    httplib::DataSink sink;
    sink.write = [&written](const char* data, size_t size) {
      written.append(data, size);
      return true;
    };
    const auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(response->write(sink, std::chrono::milliseconds(400), no_socket));
    const auto took = std::chrono::steady_clock::now() - start;
    producer.join();
    EXPECT_NE(written.find("data: [DONE]"), std::string::npos);
    if (falls_silent) {
      EXPECT_NE(written.find("timeout_error"), std::string::npos) << written;
    } else {
      EXPECT_GE(took, std::chrono::milliseconds(600));
      EXPECT_EQ(written.find("timeout_error"), std::string::npos) << written;
      EXPECT_NE(written.find("\"text\":\"12\""), std::string::npos) << written;
    }
  }
}

TEST(ConnectionThreads, HoldsAConnectionPerThreadUpToTheLimitThenQueues) {
  // Each job holds its thread (as a streaming response does) until released.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> running{0}, done{0};
  {
    ConnectionThreads threads(4, 1);
    for (int i = 0; i < 6; ++i)
      threads.enqueue([&] {
        ++running;
        released.wait();
        ++done;
      });
    // Four run at once (threads started on demand past the one ready); two wait their turn.
    for (int i = 0; i < 5000 && running.load() < 4; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(running.load(), 4);
    EXPECT_EQ(threads.started(), 4u);
    release.set_value();
    for (int i = 0; i < 5000 && done.load() < 6; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_EQ(done.load(), 6);
    // An idle thread takes the next connection: no new thread.
    std::atomic<bool> ran{false};
    threads.enqueue([&] { ran = true; });
    for (int i = 0; i < 5000 && !ran.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_TRUE(ran.load());
    EXPECT_EQ(threads.started(), 4u);
  }  // shutdown joins every thread
}

}  // namespace
}  // namespace moeline::stages::http
