// What a streamed token costs the HTTP front in each API, on the gateway bridge's thread (the one
// that writes every stream): the chat chunk written for one token (a few characters of text) by
// the front's TokenStream, plain and with vLLM's continuous usage (which the Messages API asks
// for: the usage in every chunk), and that chunk translated into the Responses event
// (stages/http/responses.h) and into Anthropic's Messages event (stages/http/messages.h); and the
// stop strings' matcher (stages/http/stop_matcher.h) over one token's text, with four ordinary
// stop strings and at the request's bound, 64 stop strings of 4096 bytes that the text keeps
// nearly matching (the matcher's worst case: every one holds back its longest partial match).
// Median of 9 rounds of 20,000 tokens; one JSON line with the time per token and the bytes the
// client gets per token.
//
//   moeline_responses_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <httplib.h>

#include "stages/http/messages.h"
#include "stages/http/responses.h"
#include "stages/http/stop_matcher.h"
#include "stages/http/token_stream.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace http = moeline::stages::http;

constexpr int kTokens = 20000;

std::string chunk(int i, bool with_usage) {
  const std::string usage =
      with_usage ? R"(,"usage":{"completion_tokens":)" + std::to_string(i + 1) +
                       R"(,"prompt_tokens":32,"total_tokens":)" + std::to_string(i + 33) + "}"
                 : "";
  return R"(data: {"choices":[{"delta":{"content":" word)" + std::to_string(i % 97) +
         R"("},"finish_reason":null,"index":0,"logprobs":null}],"created":1765000000,)"
         R"("id":"chatcmpl-0123456789abcdef01234567","model":"demo-qwen3-moe",)"
         R"("object":"chat.completion.chunk")" +
         usage + "}\n\n";
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

struct Measured {
  double ns_per_token = 0;
  double bytes_per_token = 0;
};

// `round(sink)` once per round over the kTokens tokens.
Measured measure(const std::function<void(httplib::DataSink&)>& round) {
  size_t written = 0;
  httplib::DataSink sink;
  sink.write = [&written](const char*, size_t size) {
    written += size;
    return true;
  };
  std::vector<double> ns;
  for (int i = 0; i < 9; ++i) {
    written = 0;
    const auto start = Clock::now();
    round(sink);
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() / kTokens);
  }
  return {median(ns), static_cast<double>(written) / kTokens};
}

// The front's own chunks for kTokens one-token events.
Measured chat_chunks(bool continuous_usage) {
  http::CompletionRequest request;
  request.endpoint = http::Endpoint::kChat;
  request.stream = true;
  request.continuous_usage = continuous_usage;
  http::Backend backend;
  moeline::runtime::Histogram delay({1.0});
  moeline::runtime::Counter failures;
  std::vector<moeline::sdk::Event> events(kTokens);
  for (int i = 0; i < kTokens; ++i) {
    events[i].kind = moeline::sdk::EventKind::kDelta;
    events[i].text = " word" + std::to_string(i % 97);
    events[i].token_ids = {i};
  }
  return measure([&](httplib::DataSink& sink) {
    auto completion = std::make_shared<http::Completion>();
    completion->id = "chatcmpl-0123456789abcdef01234567";
    completion->model = "demo-qwen3-moe";
    http::TokenStream stream(http::Endpoint::kChat, request, backend, completion, 32, &delay,
                             &failures);
    const auto now = Clock::now();
    for (const auto& event : events) stream.on_event(event, now, sink);
  });
}

template <class Translator, class Request>
Measured translated(const Request& request, bool with_usage) {
  std::vector<std::string> chunks;
  for (int i = 0; i < kTokens; ++i) chunks.push_back(chunk(i, with_usage));
  return measure([&](httplib::DataSink& sink) {
    Translator translator(request);
    for (const std::string& c : chunks) translator.feed(c.data(), c.size(), sink);
  });
}

// The matcher this one replaced (session 49's, before the automata), for the comparison: each
// stop string searched for in the text held back, and the held-back tail found by comparing
// every length; OpenAI's limit of four stop strings, of any length.
class SearchingStopMatcher {
 public:
  explicit SearchingStopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string feed(const std::string& delta) {
    pending_ += delta;
    for (const std::string& stop : stops_)
      if (pending_.find(stop) != std::string::npos) return {};  // (never, in this bench)
    size_t hold = 0;
    for (const std::string& stop : stops_) {
      const size_t longest = std::min(stop.size() - 1, pending_.size());
      for (size_t n = longest; n > hold; --n)
        if (pending_.compare(pending_.size() - n, n, stop, 0, n) == 0) {
          hold = n;
          break;
        }
    }
    std::string out = pending_.substr(0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
    return out;
  }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
};

// Nanoseconds per token of `tokens` deltas of `text` through a fresh `Matcher` (median of 5).
template <class Matcher>
double per_token(const std::vector<std::string>& stops, const std::string& text, int tokens) {
  std::vector<double> ns;
  for (int round = 0; round < 5; ++round) {
    Matcher matcher(stops);
    size_t out = 0;
    const auto start = Clock::now();
    for (int i = 0; i < tokens; ++i) out += matcher.feed(text).size();
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() / tokens);
    if (out == SIZE_MAX) std::printf("%zu", out);  // keeps the loop
  }
  return median(ns);
}

// kTokens deltas through a StopMatcher with `stops`: token i's text is texts[i % size].
Measured stop_matching(const std::vector<std::string>& stops,
                       const std::vector<std::string>& texts) {
  return measure([&](httplib::DataSink& sink) {
    http::StopMatcher matcher(stops);
    for (int i = 0; i < kTokens; ++i) {
      const std::string out = matcher.feed(texts[static_cast<size_t>(i) % texts.size()]);
      sink.write(out.data(), out.size());
    }
  });
}

}  // namespace

int main() {
  const Measured plain = chat_chunks(false);
  const Measured usage = chat_chunks(true);
  http::ResponsesRequest responses;
  responses.id = "resp_0";
  responses.stream = true;
  const Measured as_responses = translated<http::ResponsesStream>(responses, false);
  http::MessagesRequest messages;
  messages.id = "msg_0";
  messages.stream = true;
  const Measured as_messages = translated<http::MessagesStream>(messages, true);
  std::vector<std::string> words;
  for (int i = 0; i < 97; ++i) words.push_back(" word" + std::to_string(i));
  const Measured ordinary_stops = stop_matching({"\n\nUser:", "</s>", "Question:", "###"}, words);
  // 4093 'a's and "#" with two letters: each is one byte from matching, all through the text.
  std::vector<std::string> longest;
  for (size_t i = 0; i < http::kMaxStopStrings; ++i)
    longest.push_back(std::string(http::kMaxStopStringBytes - 3, 'a') + "#" +
                      static_cast<char>('A' + i / 26) + static_cast<char>('A' + i % 26));
  const Measured bound_stops = stop_matching(longest, {"aaaaaa"});
  // Four such stop strings, the old matcher beside the new, over 2,000 tokens (683 to fill the
  // held-back text, then the steady state).
  const std::vector<std::string> four(longest.begin(), longest.begin() + 4);
  const double searching_four = per_token<SearchingStopMatcher>(four, "aaaaaa", 2000);
  const double automata_four = per_token<http::StopMatcher>(four, "aaaaaa", 2000);
  std::printf(
      "{\"tokens\": %d, \"chat_chunk_ns\": %.0f, \"chat_chunk_bytes\": %.0f, "
      "\"chat_chunk_with_usage_ns\": %.0f, \"chat_chunk_with_usage_bytes\": %.0f, "
      "\"responses_translation_ns\": %.0f, \"responses_event_bytes\": %.0f, "
      "\"messages_translation_ns\": %.0f, \"messages_event_bytes\": %.0f, "
      "\"stop_strings_4_ns\": %.0f, \"stop_strings_64x4096_ns\": %.0f, "
      "\"stop_strings_4x4096_searching_ns\": %.0f, \"stop_strings_4x4096_automata_ns\": %.0f}\n",
      kTokens, plain.ns_per_token, plain.bytes_per_token, usage.ns_per_token, usage.bytes_per_token,
      as_responses.ns_per_token, as_responses.bytes_per_token, as_messages.ns_per_token,
      as_messages.bytes_per_token, ordinary_stops.ns_per_token, bound_stops.ns_per_token,
      searching_four, automata_four);
  return 0;
}
