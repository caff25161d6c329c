// What the HTTP front reads from the network and from a model: any request body parses to a
// request or an OpenAI error object, and any answer, in any pieces, splits into reasoning,
// content, stop strings and tool calls, without a crash, an endless loop or a deep recursion.
// The input: a flags byte (bits 0-1: the endpoint, 3 for vLLM's /tokenize and /detokenize; bits 2
// and 5: the call format, Hermes, GLM-4.5, DeepSeek or Mistral; bit 3: a prompt that opened the
// reasoning block; bit 4: at most one call; bit 6: the body to the Responses API's parser too, and
// the pieces as a chat stream to its translation; bit 7: the same for Anthropic's Messages API),
// then frames (fuzz.h): the body, then pieces of an answer.
#include <string>
#include <variant>
#include <vector>

#include "fuzz.h"
#include "stages/http/messages.h"
#include "stages/http/openai.h"
#include "stages/http/reasoning.h"
#include "stages/http/responses.h"
#include "stages/http/stop_matcher.h"
#include "stages/http/tool_calls.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeline::stages::http;
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  const auto parts = moeline::fuzz::frames(data + 1, size - 1);
  if (parts.empty()) return 0;
  const std::string body(parts[0]);
  std::string tools_json;
  std::vector<std::string> stops = {"</s>", "\n\n"};
  int64_t min_tokens = 0;
  if ((flags & 3) == 3) {
    (void)parse_tokenize(body);
    (void)parse_detokenize(body);
  } else {
    const auto endpoint = static_cast<Endpoint>(flags & 3);
    auto parsed = parse_request(endpoint, body);
    if (auto* request = std::get_if<CompletionRequest>(&parsed)) {
      tools_json = request->chat.tools_json;
      if (!request->stop.empty()) stops = request->stop;
      min_tokens = request->min_tokens;
    } else {
      (void)std::get<ApiError>(parsed).body();
    }
  }
  using moeline::tokenizer::ToolCallFormat;
  static constexpr ToolCallFormat kFormats[] = {ToolCallFormat::kHermes, ToolCallFormat::kGlm45,
                                                ToolCallFormat::kDeepSeek,
                                                ToolCallFormat::kMistral};
  const auto format = kFormats[((flags >> 2) & 1) | (((flags >> 5) & 1) << 1)];
  if ((flags & 64) != 0) {
    auto asked = parse_responses_request(body);
    if (auto* request = std::get_if<ResponsesRequest>(&asked)) {
      ResponsesStream translated(*request);
      httplib::DataSink sink;
      sink.write = [](const char*, size_t) { return true; };
      for (size_t i = 1; i < parts.size(); ++i)
        (void)translated.feed(parts[i].data(), parts[i].size(), sink);
    }
  }
  if ((flags & 128) != 0) {
    (void)parse_messages_request(body, MessagesUse::kCountTokens);
    auto asked = parse_messages_request(body, MessagesUse::kGenerate);
    if (auto* request = std::get_if<MessagesRequest>(&asked)) {
      MessagesStream translated(*request);
      httplib::DataSink sink;
      sink.write = [](const char*, size_t) { return true; };
      for (size_t i = 1; i < parts.size(); ++i)
        (void)translated.feed(parts[i].data(), parts[i].size(), sink);
    } else {
      (void)anthropic_error_from(400, std::get<ApiError>(asked).body());
    }
  }
  const auto start = (flags & 8) != 0 ? ReasoningStart::kOpen : ReasoningStart::kAtStart;
  // The answer as a stream would deliver it, and whole.
  std::string whole;
  ReasoningStream reasoning(start);
  ToolCallHold held(tool_call_marker(format));
  // A piece is one token's text here (min_tokens counts them).
  StopMatcher matcher(stops, {}, (flags & 16) != 0, min_tokens);
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string piece(parts[i]);
    whole += piece;
    (void)held.feed(reasoning.feed(piece).content);
    if (!matcher.stopped()) (void)matcher.feed(piece, static_cast<int64_t>(i));
  }
  (void)held.feed(reasoning.finish().content);
  (void)matcher.flush();
  (void)parse_tool_calls(held.held(), format, tools_json, (flags & 16) == 0);
  const ReasoningParts split = split_reasoning(whole, start);
  (void)parse_tool_calls(split.content, format, tools_json, (flags & 16) == 0);
  return 0;
}
