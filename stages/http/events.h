#pragma once
// A request's events as the HTTP front reads them: waiting for the next one, and folding each
// into what the response will say (text through the stop strings, finish reason, usage, error).

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sdk/client.h"
#include "stages/http/bridge.h"
#include "stages/http/client_link.h"
#include "stages/http/openai.h"
#include "stages/http/stop_matcher.h"

namespace moeline::stages::http {

// What one request's events added up to (non-streaming), or where a stream stands.
struct Outcome {
  std::string text;
  std::string finish_reason;
  // What ended it, as vLLM's stop_reason: the stop string, the stop token's id, or null (the
  // model's end of sequence, max_tokens).
  nlohmann::json stop_reason;
  sdk::Usage usage;
  sdk::Timings timings;
  uint32_t completion_tokens = 0;
  // Every token and, where the request asked, its log-probabilities.
  std::vector<int32_t> ids;
  std::vector<sdk::TokenLogprob> logprobs;
  // Where the request asked for the prompt's (echo with logprobs): its ids and one entry per id
  // after the first.
  std::vector<int32_t> prompt_ids;
  std::vector<sdk::TokenLogprob> prompt_logprobs;
  std::optional<ApiError> error;
};

// The next event that is not the gateway's Accepted (whose prompt token count goes to
// `prompt_tokens`); nullopt at the deadline, or as soon as `client` (where given) is seen gone.
std::optional<sdk::Event> next_event(RequestChannel& channel,
                                     std::chrono::steady_clock::time_point deadline,
                                     uint32_t& prompt_tokens, ClientLink* client = nullptr);

// Folds one event into the outcome, appending the text now certain to `emitted`; true when the
// request is over (finished, failed, or ended by a stop string).
bool absorb(const sdk::Event& event, StopMatcher& stops, Outcome& outcome, std::string& emitted);

}  // namespace moeline::stages::http
