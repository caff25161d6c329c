#pragma once
// A request as the gateway tracks it, from intake to its last event: who asked, what it may
// reuse, which replica holds it, the tokens the client already has, and the transfers (prefill's
// job from the probe, the hand-over to decode) whose credits the gateway holds for it.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/sampling.h"
#include "schemas/vocabulary.h"
#include "schemas/wire.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages {

using Clock = std::chrono::steady_clock;

// Seconds on the steady clock, as the rollback controller and the tenant limiter count them.
inline double seconds_now() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

inline double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

struct Request {
  uint64_t id = 0;
  std::string client;
  std::string tenant;  // admitted by the tenant limiter until erased
  uint64_t client_request_id = 0;
  bool batch_events = false;  // the client reads StreamEventBatch (GenerateRequest.batch_events)
  bool keep_special_tokens = false;  // !GenerateRequest.skip_special_tokens
  std::vector<int32_t> prompt;
  model::SamplingParams sampling;
  std::string cache_namespace;
  uint32_t attempt = 1;
  uint32_t free_attempts = 0;     // attempts begun by a probe bypass, not by a failure
  std::string owner;              // the replica holding it; empty while queued in the gateway
  bool at_probe = false;          // waiting for a probe's plan (queued, or held by a probe)
  Clock::time_point probe_since;  // since when
  Clock::time_point received, deadline, prefill_dispatched, first_token;
  bool has_first_token = false;
  std::vector<int32_t> sent;  // tokens the client has
  size_t position = 0;        // tokens of the current attempt received so far
  std::unique_ptr<tokenizer::DecodeStream> text;
  wire::ReuseLevel reuse_level = wire::ReuseLevel::None;
  uint32_t reused_tokens = 0;
  uint32_t allowed_levels = 0;        // reuse levels this request may use (policy at intake)
  bool client_deterministic = false;  // greedy or a seed the client chose: result reuse applies
  uint64_t prompt_key = 0;            // reuse key of the whole prompt
  std::optional<wire::Message> prefix_plan;  // a prefix plan's KV, until dispatched to prefill
  uint64_t prefix_key = 0;
  double prefill_ms = 0;
  // Approximate reuse: the namespace's levels (what prefill stores signatures for), the outcome
  // (Usage.outcome; NotAsked when the request did not ask), and a pending shadow check.
  uint32_t namespace_levels = 0;
  uint32_t probe_us = 0;  // the probe's lookup time (signature and index search included)
  wire::ApproximateOutcome approximate = wire::ApproximateOutcome::NotAsked;
  float similarity = 0;
  uint64_t donor = 0;
  int32_t cell = 0;
  bool blend_plan = false, blend_shadow = false;
  bool shadow_sampled = false;  // the shadow check is of a hit the rule would have served
  // Response: compare the finished tokens with donor_completion.
  wire::ShadowMode shadow_mode = wire::ShadowMode::None;
  std::vector<int32_t> donor_completion;
  // The hand-over (prefill sends the KV straight to decode): the decode replica picked at prefill
  // dispatch, whose credit the gateway holds until that replica confirms (HandoverAccepted); the
  // prefill replica that sends it; waiting for the confirmation since when.
  std::string decode_target, handed_by;
  bool decode_reserved = false;
  // The prefill replica named in the ProbeJob, whose credit the gateway holds until the probe's
  // notice says it sent the job there (or the probe answered without prefill).
  bool prefill_reserved = false;
  bool handover_pending = false;
  bool handover_confirmed = false;  // HandoverAccepted came before prefill's PrefillDone
  // Decode's tokens that overtook prefill's PrefillDone (they travel on different connections),
  // each kept as a one-update TokenBatch and streamed after the first token.
  std::vector<std::string> early_updates;
  Clock::time_point handover_since;
};

struct Handoff {
  uint64_t id;
  uint32_t attempt;
  wire::Message message;
};

// A request's attempt: results of any other attempt are ignored.
using JobKey = std::pair<uint64_t, uint32_t>;

}  // namespace moeline::stages
