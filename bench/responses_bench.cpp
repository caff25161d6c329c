// What the Responses API adds to a streamed token (stages/http/responses.h): a chat chunk as the
// front writes it for one token (a few characters of text) turned into the Responses event it
// means, on the gateway bridge's thread. Median of 9 rounds of 20,000 tokens; one JSON line with
// the time per token and the bytes the client gets per token.
//
//   moeline_responses_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <httplib.h>

#include "stages/http/responses.h"

namespace {

using Clock = std::chrono::steady_clock;
using moeline::stages::http::ResponsesRequest;
using moeline::stages::http::ResponsesStream;

constexpr int kTokens = 20000;

std::string chunk(int i) {
  return R"(data: {"choices":[{"delta":{"content":" word)" + std::to_string(i % 97) +
         R"("},"finish_reason":null,"index":0,"logprobs":null}],"created":1765000000,)"
         R"("id":"chatcmpl-0123456789abcdef01234567","model":"demo-qwen3-moe",)"
         R"("object":"chat.completion.chunk"})"
         "\n\n";
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main() {
  std::vector<std::string> chunks;
  for (int i = 0; i < kTokens; ++i) chunks.push_back(chunk(i));
  size_t written = 0;
  httplib::DataSink sink;
  sink.write = [&written](const char*, size_t size) {
    written += size;
    return true;
  };
  std::vector<double> responses_ns;
  size_t chat_bytes = 0;
  for (const std::string& c : chunks) chat_bytes += c.size();
  for (int round = 0; round < 9; ++round) {
    written = 0;
    ResponsesRequest request;
    request.id = "resp_0";
    request.stream = true;
    ResponsesStream translated(request);
    const auto start = Clock::now();
    for (const std::string& c : chunks) translated.feed(c.data(), c.size(), sink);
    responses_ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() /
                           kTokens);
  }
  std::printf(
      "{\"tokens\": %d, \"translation_ns_per_token\": %.0f, \"chat_bytes_per_token\": %.0f, "
      "\"responses_bytes_per_token\": %.0f}\n",
      kTokens, median(responses_ns), static_cast<double>(chat_bytes) / kTokens,
      static_cast<double>(written) / kTokens);
  return 0;
}
