#include "stages/gateway/stage_results.h"

#include "stages/common/common.h"
#include "stages/runtime/dispatch.h"

namespace moeline::stages {
namespace {

// Decode tokens kept for one request until prefill's first token arrives.
constexpr size_t kMaxEarlyUpdates = 256;

// A TokenUpdate copied into a TokenBatch of its own (the message it came in is gone by then).
std::string one_update(const wire::TokenUpdate& from) {
  flatbuffers::FlatBufferBuilder builder(128);
  const wire::FinishReason reason = wire::finish_reason_of(from);
  auto finish = builder.CreateString(wire::name(reason));
  auto logprobs = copy_logprobs(builder, from.logprobs());
  auto update = wire::CreateTokenUpdate(builder, from.request_id(), from.attempt(), from.token(),
                                        finish, logprobs, reason);
  builder.Finish(wire::CreateTokenBatch(builder, builder.CreateVector(&update, 1)));
  return std::string(reinterpret_cast<const char*>(builder.GetBufferPointer()), builder.GetSize());
}

}  // namespace

// Streams the tokens decode sent before prefill's first token, now that it has come.
void StageResults::replay_early(uint64_t id, uint32_t attempt) {
  Request* r = tracker_.find(id, attempt);
  if (r == nullptr || r->early_updates.empty()) return;
  const std::vector<std::string> early = std::move(r->early_updates);
  r->early_updates.clear();
  for (const std::string& bytes : early) {
    const auto* batch = flatbuffers::GetRoot<wire::TokenBatch>(bytes.data());
    for (const wire::TokenUpdate* update : *batch->updates()) {
      Request* live = tracker_.find(id, attempt);
      if (live == nullptr) return;  // finished, failed or retried meanwhile
      tracker_.on_token(*live, update->token(), wire::finish_reason_of(*update),
                        update->logprobs());
    }
  }
}

void StageResults::on_stage(runtime::Hub::Incoming& incoming) {
  static constexpr runtime::HandlerTable<StageResults, 10, runtime::Hub::Incoming&> kStageHandlers({
      {wire::MessageType::ProbePlan, &StageResults::on_probe_plan},
      {wire::MessageType::PrefillDone, &StageResults::on_prefill_done},
      {wire::MessageType::HandoverAccepted, &StageResults::on_handover_accepted},
      {wire::MessageType::TokenBatch, &StageResults::on_token_batch},
      {wire::MessageType::JobFailed, &StageResults::on_job_failed},
      {wire::MessageType::ExpertPlanRequest, &StageResults::on_expert_traffic},
      {wire::MessageType::ExpertUsage, &StageResults::on_expert_traffic},
      {wire::MessageType::SnapshotPut, &StageResults::on_snapshot_put},
      {wire::MessageType::ExpertPlan, &StageResults::on_expert_plan},
      {wire::MessageType::ErrorReply, &StageResults::on_stage_error},
  });
  if (kStageHandlers.dispatch(*this, incoming.message.type, incoming)) return;
  log_.warn("unexpected_message", {{"peer", incoming.identity},
                                   {"type", wire::message_type_name(incoming.message.type)}});
}

void StageResults::on_probe_plan(runtime::Hub::Incoming& incoming) {
  wire::Message& message = incoming.message;
  const auto* plan = message.as<wire::ProbePlan>();
  Request* r = tracker_.find(plan->request_id(), plan->attempt());
  // The notice of a plan sent on to prefill, overtaken by prefill's own answer: only the
  // bookkeeping is left to do.
  const bool overtaken =
      r != nullptr && plan->forwarded() && !r->at_probe &&
      broker_.from_stage(incoming.identity, message.type, {wire::StageKind::Probe});
  if (!overtaken)
    r = tracker_.owned(plan->request_id(), plan->attempt(), incoming.identity, message.type);
  if (r == nullptr) return;
  if (plan->forwarded() && !overtaken) {
    if (!r->prefill_reserved || hub_.peer(r->handed_by) == nullptr)
      return tracker_.retry_or_fail(*r, "the prefill replica the probe sent the job to is gone");
    tracker_.took_job_from_probe(*r);
  } else if (!plan->forwarded()) {
    r->owner.clear();
    r->at_probe = false;
    // The plan comes here: prefill and decode are picked when it runs.
    broker_.release_prefill(*r, false);
    broker_.release_reservations(*r);
  }
  r->probe_us = plan->probe_us();
  using wire::ApproximateOutcome, wire::ReuseLevel;
  const ReuseLevel level = wire::reuse_level_of(*plan);
  const ApproximateOutcome outcome = wire::approximate_outcome_of(*plan);
  if (outcome != ApproximateOutcome::NotAsked) {
    r->approximate = outcome;
    r->similarity = plan->similarity();
    r->donor = plan->donor_key();
    r->cell = plan->cell();
    r->shadow_sampled = plan->shadow_sampled();
    reuse_.on_lookup(outcome);
    if (outcome == ApproximateOutcome::Shadow &&
        wire::shadow_mode_of(*plan) == wire::ShadowMode::Response && plan->completion()) {
      r->shadow_mode = wire::ShadowMode::Response;
      r->donor_completion.assign(plan->completion()->begin(), plan->completion()->end());
    }
  }
  if (plan->forwarded()) {
    // Prefill has the job: what the plan reused is known here for the request's usage.
    if (level == ReuseLevel::Blend) {
      r->blend_plan = true;
      r->blend_shadow = outcome == ApproximateOutcome::Shadow;
      r->reused_tokens = plan->reused_tokens();
    } else if (level == ReuseLevel::Prefix) {
      r->reuse_level = level;
      r->reused_tokens = plan->reused_tokens();
    }
    return;
  }
  if (level == ReuseLevel::Blend && plan->layout() != nullptr && plan->blend_mask() != nullptr &&
      plan->blend_mask()->size() == r->prompt.size()) {
    if (auto bad = wire::check_bulk(plan->frames(), message.bulk)) {
      log_.warn("probe_plan_refused", {{"request_id", r->id}, {"reason", *bad}});
    } else {
      r->blend_plan = true;
      r->blend_shadow = outcome == ApproximateOutcome::Shadow;
      r->reused_tokens = plan->reused_tokens();  // the exact prefix the blend continues
      r->prefix_key = plan->prefix_key();        // same template or donor, same replica
      r->prefix_plan = std::move(message);
    }
    tracker_.prefill_queue.push_back({r->id, r->attempt});
    return;
  }
  if ((level == ReuseLevel::Result || level == ReuseLevel::Response) && plan->completion() &&
      plan->completion()->size() > 0) {
    // A finished completion replayed, nothing computed: an identical deterministic
    // request's (result), or a near-identical one's that the decision rule let through
    // (response).
    r->reuse_level = level;
    r->reused_tokens = plan->reused_tokens();
    wire::FinishReason finish = wire::finish_reason_of(*plan);
    if (finish == wire::FinishReason::None) finish = wire::FinishReason::Stop;
    const uint64_t id = r->id;
    const uint32_t attempt = r->attempt;
    const auto* completion = plan->completion();
    for (flatbuffers::uoffset_t i = 0; i < completion->size(); ++i) {
      Request* live = tracker_.find(id, attempt);
      if (live == nullptr) break;
      tracker_.on_token(*live, completion->Get(i),
                        i + 1 == completion->size() ? finish : wire::FinishReason::None);
    }
    return;
  }
  if (level == ReuseLevel::Prefix && plan->reused_tokens() > 0 && plan->layout() != nullptr) {
    if (auto bad = wire::check_bulk(plan->frames(), message.bulk)) {
      log_.warn("probe_plan_refused", {{"request_id", r->id}, {"reason", *bad}});
    } else {
      r->reuse_level = level;
      r->reused_tokens = plan->reused_tokens();
      r->prefix_key = plan->prefix_key();
      r->prefix_plan = std::move(message);
    }
  }
  tracker_.prefill_queue.push_back({r->id, r->attempt});
}

void StageResults::on_prefill_done(runtime::Hub::Incoming& incoming) {
  wire::Message& message = incoming.message;
  const auto* done = message.as<wire::PrefillDone>();
  Request* r =
      tracker_.from_prefill(done->request_id(), done->attempt(), incoming.identity, message.type);
  if (r == nullptr) return;
  if (r->at_probe) {
    // The probe answered a full hit itself: the prefill replica picked for it had nothing to do.
    r->at_probe = false;
    broker_.release_prefill(*r, false);
    r->handed_by = incoming.identity;  // who sends the KV on to decode
  }
  r->owner.clear();
  r->prefill_ms = static_cast<double>(done->prefill_us()) / 1000.0;
  if (done->prefill_us() > 0 && r->probe_us > 0)
    metrics_.probe_fraction->observe(static_cast<double>(r->probe_us) /
                                     static_cast<double>(done->prefill_us()));
  // Prefill names the level where it knows better than the plan (a prefix it could not use).
  if (done->level().has_value() || (done->reuse_level() && done->reuse_level()->size() > 0)) {
    r->reuse_level = wire::reuse_level_of(*done);
    r->reused_tokens = done->reused_tokens();
  }
  if (done->shadow_checked() && r->blend_shadow) {
    r->blend_shadow = false;
    reuse_.report_shadow(*r, done->shadow_top1() && done->shadow_kl() <= blend_max_kl_,
                         done->shadow_kl());
  }
  const wire::FinishReason finish = wire::finish_reason_of(*done);
  const uint64_t id = r->id;
  const uint32_t attempt = r->attempt;
  const bool carries_kv = done->frames() != nullptr && done->frames()->size() > 0;
  const bool finished = finish != wire::FinishReason::None;
  if (finished || carries_kv) broker_.release_reservations(*r);  // no hand-over will come
  if (!finished && !carries_kv) {
    // Prefill hands the KV to the decode replica picked at dispatch; from now on the request's
    // tokens come from there.
    if (r->decode_target.empty() || hub_.peer(r->decode_target) == nullptr)
      return tracker_.retry_or_fail(*r, "the decode replica picked for the hand-over is gone");
    r->owner = r->decode_target;
    r->handover_pending = !r->handover_confirmed;
    if (r->handover_confirmed) r->decode_reserved = false;
    r->handover_since = Clock::now();
  }
  tracker_.on_token(*r, done->first_token(), finish, done->first_logprobs(),
                    done->prompt_logprobs());
  if (!finished && !carries_kv) replay_early(id, attempt);
  // A PrefillDone with the KV (a full hit answered by the probe): relayed to a decode replica.
  if (!finished && carries_kv && tracker_.find(id, attempt) != nullptr)
    tracker_.decode_queue.push_back({id, attempt, std::move(message)});
}

// Decode holds a sequence prefill handed to it: its tokens follow on this connection.
void StageResults::on_handover_accepted(runtime::Hub::Incoming& incoming) {
  const auto* accepted = incoming.message.as<wire::HandoverAccepted>();
  Request* r = tracker_.find(accepted->request_id(), accepted->attempt());
  if (r != nullptr && r->decode_target == incoming.identity && r->decode_reserved) {
    if (r->handover_pending) {
      r->handover_pending = false;
      r->decode_reserved = false;  // the replica returns the credit when the sequence ends
    } else {
      r->handover_confirmed = true;  // before prefill's PrefillDone: noted for it
    }
    return;
  }
  // A hand-over the gateway gave up on (retried, cancelled, finished): the replica drops it,
  // and the credit it will return for it was already given back (release_reservations).
  flatbuffers::FlatBufferBuilder builder(64);
  builder.Finish(wire::CreateCancelJob(builder, accepted->request_id(), accepted->attempt()),
                 wire::PrefillJobIdentifier());
  if (hub_.send(incoming.identity, wire::encode(wire::MessageType::CancelJob, builder), false))
    hub_.spend_credit(incoming.identity);
}

void StageResults::on_token_batch(runtime::Hub::Incoming& incoming) {
  wire::Message& message = incoming.message;
  const auto* batch = message.as<wire::TokenBatch>();
  metrics_.batch_size->observe(batch->batch_size());
  if (batch->updates() == nullptr) return;
  for (const wire::TokenUpdate* update : *batch->updates()) {
    Request* known = tracker_.find(update->request_id(), update->attempt());
    if (known == nullptr) {
      broker_.cancel_orphan(incoming.identity, update->request_id(), update->attempt());
      continue;
    }
    if (known->decode_target == incoming.identity && known->owner != incoming.identity) {
      // Decode's tokens overtook prefill's PrefillDone (the first token): kept until it comes.
      // Past a bound (a decode replica sending tokens for a sequence it was never handed) the
      // attempt starts again.
      if (known->early_updates.size() < kMaxEarlyUpdates) {
        known->early_updates.push_back(one_update(*update));
        continue;
      }
      broker_.cancel_at_owner(*known);
      tracker_.retry_or_fail(*known, "decode sent tokens before prefill's first token");
      continue;
    }
    Request* r =
        tracker_.owned(update->request_id(), update->attempt(), incoming.identity, message.type);
    if (r == nullptr) continue;  // not this peer's
    tracker_.on_token(*r, update->token(), wire::finish_reason_of(*update), update->logprobs());
  }
}

void StageResults::on_job_failed(runtime::Hub::Incoming& incoming) {
  wire::Message& message = incoming.message;
  const auto* failed = message.as<wire::JobFailed>();
  Request* r = tracker_.find(failed->request_id(), failed->attempt());
  if (r == nullptr)
    broker_.settle_stale_prefill(failed->request_id(), failed->attempt(), incoming.identity);
  if (r != nullptr && r->at_probe && r->prefill_reserved && r->handed_by == incoming.identity)
    tracker_.took_job_from_probe(*r);
  // Prefill reports a hand-over the decode replica would not take after its PrefillDone.
  if (r != nullptr && r->handover_pending && r->handed_by == incoming.identity) {
    broker_.cancel_at_owner(*r);
    return tracker_.retry_or_fail(
        *r, failed->message() ? failed->message()->str() : "hand-over failed");
  }
  r = tracker_.owned(failed->request_id(), failed->attempt(), incoming.identity, message.type);
  if (r == nullptr) return;
  broker_.release_reservations(*r);
  r->owner.clear();
  if (failed->code() == wire::ErrorCode::Draining) {
    // Handed back by a draining replica: another one takes it (not a failure).
    ++r->free_attempts;
    metrics_.handed_back->inc();
    return tracker_.retry_or_fail(*r, "replica draining");
  }
  return tracker_.fail(*r, failed->code(), "failed",
                       failed->message() ? failed->message()->str() : "a stage refused the job");
}

void StageResults::on_expert_traffic(runtime::Hub::Incoming& incoming) {
  wire::Message& message = incoming.message;
  if (!broker_.from_stage(incoming.identity, message.type,
                          {wire::StageKind::Prefill, wire::StageKind::Decode}))
    return;
  return broker_.forward_to_offload(message);
}

// Prefill sends its puts to the probe's intake; the gateway carries no snapshot byte.
void StageResults::on_snapshot_put(runtime::Hub::Incoming& incoming) {
  broker_.refuse(incoming.identity, incoming.message.type, "sent_to_the_gateway");
}

void StageResults::on_expert_plan(runtime::Hub::Incoming& incoming) {
  wire::Message& message = incoming.message;
  if (!broker_.from_stage(incoming.identity, message.type, {wire::StageKind::OffloadManager}))
    return;
  const auto* plan = message.as<wire::ExpertPlan>();
  const std::string requester = plan->requester() ? plan->requester()->str() : "";
  const runtime::Peer* to = hub_.peer(requester);
  if (to == nullptr ||
      (to->stage != wire::StageKind::Prefill && to->stage != wire::StageKind::Decode))
    return;
  hub_.send(requester, message.release_frames(), false);
}

void StageResults::on_stage_error(runtime::Hub::Incoming& incoming) {
  wire::Message& message = incoming.message;
  log_.warn("stage_error", {{"peer", incoming.identity},
                            {"detail", message.as<wire::ErrorReply>()->message()
                                           ? message.as<wire::ErrorReply>()->message()->str()
                                           : ""}});
}

}  // namespace moeline::stages
