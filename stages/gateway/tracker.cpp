#include "stages/gateway/tracker.h"

#include "reuse/records.h"

namespace moeline::stages {

RequestTracker::RequestTracker(TrackerSettings settings, const Parts& parts)
    : settings_(settings),
      hub_(parts.hub),
      broker_(parts.broker),
      client_(parts.client),
      reuse_(parts.reuse),
      limiter_(parts.limiter),
      tokenizer_(parts.tokenizer),
      metrics_(parts.metrics),
      log_(parts.log) {}

Request& RequestTracker::add(Request request) {
  by_client_[{request.client, request.client_request_id}] = request.id;
  const uint64_t id = request.id;
  Request& r = requests_.emplace(id, std::move(request)).first->second;
  queue_for_probe(r);
  return r;
}

Request* RequestTracker::of_client(const std::string& client, uint64_t client_request_id) {
  auto it = by_client_.find({client, client_request_id});
  return it == by_client_.end() ? nullptr : &requests_.at(it->second);
}

void RequestTracker::fail_all(wire::ErrorCode code, const std::string& outcome,
                              const std::string& text) {
  std::vector<uint64_t> left;
  for (const auto& [id, r] : requests_) left.push_back(id);
  for (uint64_t id : left) fail(requests_.at(id), code, outcome, text);
}

Request* RequestTracker::find(uint64_t id, uint32_t attempt) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second.attempt != attempt) return nullptr;
  return &it->second;
}

Request* RequestTracker::owned(uint64_t id, uint32_t attempt, const std::string& from,
                               wire::MessageType type) {
  Request* r = find(id, attempt);
  if (r == nullptr) return nullptr;
  if (r->owner == from) return r;
  broker_.refuse(from, type, "not_owner");
  return nullptr;
}

Request* RequestTracker::from_prefill(uint64_t id, uint32_t attempt, const std::string& from,
                                      wire::MessageType type) {
  Request* r = find(id, attempt);
  if (r == nullptr) {
    broker_.settle_stale_prefill(id, attempt, from);
    return nullptr;
  }
  if (r->at_probe && r->prefill_reserved && r->handed_by == from) took_job_from_probe(*r);
  return owned(id, attempt, from, type);
}

void RequestTracker::took_job_from_probe(Request& r) {
  r.owner = r.handed_by;
  r.at_probe = false;
  r.prefill_reserved = false;  // the replica returns it when the job is done
  if (r.prefill_dispatched == Clock::time_point{}) {
    r.prefill_dispatched = Clock::now();
    metrics_.queue_time->observe(
        std::chrono::duration<double>(r.prefill_dispatched - r.received).count());
  }
}

void RequestTracker::erase(Request& r) {
  limiter_.release(r.tenant);
  by_client_.erase({r.client, r.client_request_id});
  requests_.erase(r.id);  // queue entries for it are skipped when they come up
}

void RequestTracker::finish(Request& r, wire::FinishReason reason) {
  broker_.cancel_at_owner(r);
  const bool approximate_answer =
      r.reuse_level == wire::ReuseLevel::Response || r.reuse_level == wire::ReuseLevel::Blend;
  const bool completed = reason == wire::FinishReason::Stop || reason == wire::FinishReason::Length;
  // Only what was computed for this very prompt becomes its result.
  if (completed && (r.allowed_levels & reuse::kResult) &&
      r.reuse_level != wire::ReuseLevel::Result && !approximate_answer && !r.sent.empty())
    store_result(r, reason);
  if (completed && r.shadow_mode == wire::ShadowMode::Response)
    reuse_.report_shadow(r, reuse_.policy().same_answer(r.sent, r.donor_completion), 0.0f);
  if (approximate_answer) reuse_.policy().served_approximately(r.client, r.client_request_id);

  std::string tail;
  if (auto rest = r.text->finish(); rest) tail = std::move(*rest);
  const auto now = Clock::now();
  metrics_.e2e->observe(std::chrono::duration<double>(now - r.received).count());
  if (r.sent.size() > 1 && r.has_first_token)
    metrics_.tpot->observe(std::chrono::duration<double>(now - r.first_token).count() /
                           static_cast<double>(r.sent.size() - 1));
  metrics_.outcome(std::string(wire::name(reason))).inc();
  client_.send_event(EventTo::of(r), wire::EventKind::Finished, tail, {}, reason,
                     wire::ErrorCode::None, {}, &r);
  erase(r);
}

void RequestTracker::fail(Request& r, wire::ErrorCode code, const std::string& outcome,
                          const std::string& text) {
  broker_.cancel_at_owner(r);
  metrics_.outcome(outcome).inc();
  metrics_.e2e->observe(std::chrono::duration<double>(Clock::now() - r.received).count());
  log_.warn("request_failed", {{"request_id", r.id}, {"outcome", outcome}, {"detail", text}});
  client_.send_event(EventTo::of(r), wire::EventKind::Error, {}, {}, {}, code, text, &r);
  erase(r);
}

// A token of the current attempt. Tokens the client already has (from an attempt that died)
// must match; new ones are streamed.
void RequestTracker::on_token(Request& r, int32_t token, wire::FinishReason finish_reason,
                              const wire::TokenLogprobs* logprobs,
                              const PromptLogprobs* prompt_logprobs) {
  const size_t index = r.position++;
  if (index < r.sent.size()) {
    if (r.sent[index] != token)
      return fail(r, wire::ErrorCode::StageFailed, "stage_failed",
                  "the retried request diverged from the tokens already streamed");
  } else {
    r.sent.push_back(token);
    if (!r.has_first_token) {
      r.has_first_token = true;
      r.first_token = Clock::now();
      metrics_.ttft->observe(std::chrono::duration<double>(r.first_token - r.received).count());
    }
    std::string delta;
    // Kept special tokens are written out, but not the one that stopped the request (its end of
    // sequence or stop token id), as vLLM leaves it out.
    const bool stopping = finish_reason == wire::FinishReason::Stop;
    if (tokenizer_.id_to_token(token) && !(r.keep_special_tokens && stopping)) {
      auto piece = r.text->step(token);
      if (piece) delta = std::move(*piece);
    }
    // Where the request asked for log-probabilities, every token the client gets has them.
    if (r.sampling.logprobs && logprobs == nullptr)
      return fail(r, wire::ErrorCode::StageFailed, "stage_failed",
                  "a stage sent a token without the log-probabilities the request asked for");
    // The prompt's go with the first token only, one per prompt token after the first.
    const bool first = index == 0;
    if (first && r.sampling.prompt_logprobs &&
        (prompt_logprobs == nullptr || prompt_logprobs->size() + 1 != r.prompt.size()))
      return fail(r, wire::ErrorCode::StageFailed, "stage_failed",
                  "a stage sent the first token without the prompt's log-probabilities");
    if (!client_.send_event(
            EventTo::of(r), wire::EventKind::Delta, delta, {token}, {}, wire::ErrorCode::None, {},
            nullptr,
            {logprobs, first && r.sampling.prompt_logprobs ? prompt_logprobs : nullptr, &r.prompt}))
      return on_client_gone(r.id);
  }
  if (finish_reason != wire::FinishReason::None) {
    r.owner.clear();  // the replica has already let it go
    finish(r, finish_reason);
  }
}

void RequestTracker::on_client_gone(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request& r = it->second;
  log_.info("client_gone", {{"request_id", r.id}, {"tokens", r.sent.size()}});
  broker_.cancel_at_owner(r);
  metrics_.outcome("client_gone").inc();
  erase(r);
}

void RequestTracker::retry_or_fail(Request& r, const std::string& why) {
  if (r.attempt - r.free_attempts > settings_.max_retries)
    return fail(r, wire::ErrorCode::StageFailed, "stage_failed",
                why + "; gave up after " + std::to_string(r.attempt) + " attempts");
  metrics_.retries->inc();
  log_.warn("request_retry", {{"request_id", r.id}, {"attempt", r.attempt + 1}, {"reason", why}});
  broker_.release_reservations(r);
  r.owner.clear();
  ++r.attempt;
  r.position = 0;
  r.early_updates.clear();
  r.prefix_plan.reset();
  r.reuse_level = wire::ReuseLevel::None;
  r.reused_tokens = 0;
  r.prefix_key = 0;
  r.blend_plan = r.blend_shadow = false;
  r.shadow_mode = wire::ShadowMode::None;
  queue_for_probe(r);
}

void RequestTracker::queue_for_probe(Request& r) {
  r.at_probe = true;
  r.probe_since = Clock::now();
  probe_queue.push_back({r.id, r.attempt});
}

// Reuse is an optimisation: a request whose probe has not answered within --probe-timeout-ms
// (a probe that is down, restarting, stopped, or stuck on a full disk) goes to prefill without
// reuse, as a new attempt, so that the probe's late answer is ignored.
void RequestTracker::bypass_slow_probes() {
  const auto now = Clock::now();
  if (settings_.probe_timeout.count() <= 0 ||
      now - last_bypass_scan_ < std::chrono::milliseconds(20))
    return;
  last_bypass_scan_ = now;
  std::vector<uint64_t> late;
  // Waiting for a probe that was sent the job, or for any probe at all (none is connected); a
  // job queued behind busy probes is not late.
  const bool no_probe = !hub_.any(wire::StageKind::Probe);
  for (auto& [id, r] : requests_)
    if (r.at_probe && (!r.owner.empty() || no_probe) &&
        now - r.probe_since > settings_.probe_timeout)
      late.push_back(id);
  for (uint64_t id : late) {
    Request& r = requests_.at(id);
    r.at_probe = false;
    broker_.release_reservations(r);
    r.owner.clear();
    ++r.attempt;
    r.early_updates.clear();
    ++r.free_attempts;
    r.position = 0;
    metrics_.probe_bypassed->inc();
    if (uint64_t suppressed = 0; bypass_log_.allow(suppressed))
      log_.warn("probe_bypassed", {{"request_id", r.id},
                                   {"waited_ms", ms_between(r.probe_since, now)},
                                   {"suppressed", suppressed}});
    prefill_queue.push_back({r.id, r.attempt});
  }
}

void RequestTracker::on_peer_lost(const runtime::Peer& dead) {
  std::vector<uint64_t> held;
  for (auto& [id, r] : requests_)
    if (r.owner == dead.identity) held.push_back(id);
  for (uint64_t id : held) {
    Request& r = requests_.at(id);
    r.owner.clear();
    retry_or_fail(r,
                  std::string(wire::stage_name(dead.stage)) + " replica " + dead.replica + " died");
  }
  // Plans and expert usage waiting on a lost offload manager are simply asked again by the
  // compute stages; nothing else is held per peer.
}

void RequestTracker::expire_deadlines() {
  const auto now = Clock::now();
  if (now - last_deadline_scan_ < std::chrono::milliseconds(20)) return;
  last_deadline_scan_ = now;
  std::vector<uint64_t> expired;
  for (auto& [id, r] : requests_)
    if (now >= r.deadline) expired.push_back(id);
  std::vector<uint64_t> unconfirmed;
  for (auto& [id, r] : requests_)
    if (r.handover_pending && now - r.handover_since > settings_.handover_timeout &&
        now < r.deadline)
      unconfirmed.push_back(id);
  for (uint64_t id : unconfirmed) {
    Request& r = requests_.at(id);
    metrics_.handover_timeouts->inc();
    const std::string target = r.decode_target;
    broker_.cancel_at_owner(r);
    retry_or_fail(r, "decode replica " + target + " did not confirm the hand-over");
  }
  for (uint64_t id : expired) {
    Request& r = requests_.at(id);
    fail(r, wire::ErrorCode::DeadlineExceeded, "deadline_exceeded",
         "deadline of " + std::to_string(static_cast<int64_t>(ms_between(r.received, r.deadline))) +
             " ms exceeded after " + std::to_string(r.sent.size()) + " tokens");
  }
}

// A deterministic request's completion, for an identical request to replay.
void RequestTracker::store_result(const Request& r, wire::FinishReason reason) {
  broker_.put_to_probes(reuse::result_entry(r.prompt_key, r.sampling), wire::SnapshotKind::Result,
                        reuse::encode(reuse::ResultRecord{r.sent, std::string(wire::name(reason))}),
                        &r.cache_namespace);
}

}  // namespace moeline::stages
