#include "stages/http/events.h"

#include <algorithm>

namespace moeline::stages::http {

std::optional<sdk::Event> next_event(RequestChannel& channel,
                                     std::chrono::steady_clock::time_point deadline,
                                     uint32_t& prompt_tokens, ClientLink* client) {
  using Clock = std::chrono::steady_clock;
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return std::nullopt;
    std::optional<sdk::Event> event =
        channel.next(client ? std::min(left, ClientLink::kCheckInterval) : left);
    if (!event) {
      if (client && client->gone()) return std::nullopt;
      continue;  // the deadline is looked at again above
    }
    if (event->kind != sdk::EventKind::kAccepted) return event;
    prompt_tokens = event->usage.prompt_tokens;
  }
}

bool absorb(const sdk::Event& event, StopMatcher& stops, Outcome& outcome, std::string& emitted) {
  if (event.kind == sdk::EventKind::kError) {
    outcome.error = gateway_error(event.error_code, event.error_name, event.error_message);
    return true;
  }
  if (!event.prompt_token_ids.empty()) {
    outcome.prompt_ids = event.prompt_token_ids;
    outcome.prompt_logprobs = event.prompt_logprobs;
  }
  outcome.completion_tokens += static_cast<uint32_t>(event.token_ids.size());
  outcome.ids.insert(outcome.ids.end(), event.token_ids.begin(), event.token_ids.end());
  outcome.logprobs.insert(outcome.logprobs.end(), event.logprobs.begin(), event.logprobs.end());
  emitted += stops.feed(event.text, outcome.completion_tokens);
  if (stops.stopped()) {
    outcome.finish_reason = "stop";
    outcome.stop_reason = stops.matched();
    return true;
  }
  if (event.kind == sdk::EventKind::kFinished) {
    emitted += stops.flush();
    outcome.finish_reason = event.finish_reason == "length" ? "length" : "stop";
    // (The last token may have come with an earlier event than the end.)
    if (outcome.finish_reason == "stop" && !outcome.ids.empty() &&
        stops.stop_token(outcome.ids.back()))
      outcome.stop_reason = outcome.ids.back();
    outcome.usage = event.usage;
    outcome.timings = event.timings;
    return true;
  }
  return false;
}

}  // namespace moeline::stages::http
