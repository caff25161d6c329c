#include "stages/gateway/dispatcher.h"

#include "reuse/records.h"
#include "stages/common/common.h"

namespace moeline::stages {

uint32_t Dispatcher::store_levels_of(const Request& r) {
  return (r.allowed_levels & (reuse::kPrefix | reuse::kFull)) |
         (r.namespace_levels & reuse::kApproximateLevels);
}

void Dispatcher::dispatch() {
  to_probes();
  to_prefill();
  to_decode();
}

// Requests waiting for their namespace's probe.
void Dispatcher::to_probes() {
  while (!tracker_.probe_queue.empty()) {
    auto [id, attempt] = tracker_.probe_queue.front();
    Request* r = tracker_.find(id, attempt);
    if (r == nullptr) {
      tracker_.probe_queue.pop_front();
      continue;
    }
    // The namespace's own probe, once it has room (a job waits rather than go to a probe that
    // does not hold its namespace).
    runtime::Peer* probe = broker_.probe_for(r->cache_namespace);
    if (probe == nullptr || probe->credits == 0) break;
    // The shortest path: the probe sends the job on to a prefill replica picked now, and the KV
    // goes on to a decode replica picked now. Without room in both, the probe's plan comes back
    // here and waits for prefill as before.
    runtime::Peer* prefill = broker_.pick_with_intake(wire::StageKind::Prefill);
    runtime::Peer* decode = prefill ? broker_.pick_with_intake(wire::StageKind::Decode) : nullptr;
    if (prefill != nullptr && decode == nullptr) {
      hub_.restore_credit(prefill->identity);
      prefill = nullptr;
    }
    flatbuffers::FlatBufferBuilder builder(256 + r->prompt.size() * 4);
    auto tokens = builder.CreateVector(r->prompt);
    auto name_space = builder.CreateString(r->cache_namespace);
    auto sampling = to_wire(builder, r->sampling);
    auto prefill_route = prefill ? broker_.route_to(builder, *prefill, *r) : 0;
    auto decode_route = decode ? broker_.route_to(builder, *decode, *r) : 0;
    builder.Finish(
        wire::CreateProbeJob(builder, r->id, r->attempt, tokens, name_space, sampling,
                             r->allowed_levels, prefill_route, decode_route, store_levels_of(*r)),
        wire::PrefillJobIdentifier());
    const std::string identity = probe->identity;
    const std::string prefill_identity = prefill ? prefill->identity : "";
    const std::string decode_identity = decode ? decode->identity : "";
    if (!hub_.send(identity, wire::encode(wire::MessageType::ProbeJob, builder), true)) {
      if (prefill) hub_.restore_credit(prefill_identity);
      if (decode) hub_.restore_credit(decode_identity);
      break;
    }
    r->owner = identity;
    r->probe_since = Clock::now();
    if (prefill) {
      r->handed_by = prefill_identity;
      r->prefill_reserved = true;
      r->decode_target = decode_identity;
      r->decode_reserved = true;
    }
    tracker_.probe_queue.pop_front();
  }
}

// Plans that came back from the probe: prefill with the decode replica picked now.
void Dispatcher::to_prefill() {
  while (!tracker_.prefill_queue.empty() && tracker_.decode_queue.size() < max_decode_backlog_) {
    auto [id, attempt] = tracker_.prefill_queue.front();
    Request* r = tracker_.find(id, attempt);
    if (r == nullptr) {
      tracker_.prefill_queue.pop_front();
      continue;
    }
    runtime::Peer* prefill = broker_.prefill_for(r->prefix_key);
    if (prefill == nullptr) break;
    // The decode replica is chosen now, so that prefill sends it the KV directly: a prefill
    // starts only when a decode replica has room for the sequence.
    runtime::Peer* decode = broker_.pick_with_intake(wire::StageKind::Decode);
    if (decode == nullptr) break;  // the prefill replica was only chosen: nothing to give back
    flatbuffers::FlatBufferBuilder builder(512 + r->prompt.size() * 4);
    auto decode_route = broker_.route_to(builder, *decode, *r);
    const runtime::Peer* store = broker_.store_for(r->cache_namespace);
    auto store_route = store != nullptr ? broker_.route_to(builder, *store, *r) : 0;
    auto tokens = builder.CreateVector(r->prompt);
    auto sampling = to_wire(builder, r->sampling);
    flatbuffers::Offset<wire::KvLayout> layout = 0;
    flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
    std::vector<zmq::message_t> bulk;
    if (r->prefix_plan) {
      // The prefix's KV moves on to prefill without a copy.
      const auto* plan = r->prefix_plan->as<wire::ProbePlan>();
      const wire::KvLayout* l = plan->layout();
      layout = wire::CreateKvLayout(builder, l->layers(), l->kv_heads(), l->head_dim(),
                                    l->block_tokens(), builder.CreateString("f32"), l->blocks(),
                                    l->values());
      std::vector<flatbuffers::Offset<wire::BulkFrame>> described;
      for (const wire::BulkFrame* frame : *plan->frames())
        described.push_back(wire::CreateBulkFrame(builder, frame->bytes(), frame->xxh3()));
      frames = builder.CreateVector(described);
      for (wire::AlignedFrame& frame : r->prefix_plan->bulk)
        bulk.push_back(std::move(frame.message()));
    }
    // Prefill stores the prompt's blocks and record as allowed, and its signature where the
    // namespace allows approximate reuse (so that later prompts find it).
    const uint32_t store_levels = store_levels_of(*r);
    flatbuffers::Offset<flatbuffers::Vector<uint8_t>> mask = 0;
    float recompute = 0;
    if (r->blend_plan && r->prefix_plan) {
      const auto* plan = r->prefix_plan->as<wire::ProbePlan>();
      mask = builder.CreateVector(plan->blend_mask()->data(), plan->blend_mask()->size());
      recompute = plan->recompute_fraction();
    }
    const wire::ReuseLevel level = r->blend_plan ? wire::ReuseLevel::Blend : r->reuse_level;
    builder.Finish(wire::CreatePrefillJob(builder, r->id, r->attempt, tokens, sampling,
                                          builder.CreateString(r->cache_namespace),
                                          builder.CreateString(wire::name(level)),
                                          r->prefix_plan ? r->reused_tokens : 0, frames, layout,
                                          store_levels, r->prefix_key, mask, recompute,
                                          r->blend_shadow, decode_route, store_route, 0, level),
                   wire::PrefillJobIdentifier());
    const std::string identity = prefill->identity;
    const std::string decode_identity = decode->identity;
    std::vector<zmq::message_t> job =
        wire::encode(wire::MessageType::PrefillJob, builder, std::move(bulk));
    if (!hub_.send(identity, job, true)) {
      hub_.restore_credit(decode_identity);
      // That replica is gone; the next try recomputes the prefix rather than keep its KV here.
      r->prefix_plan.reset();
      r->reuse_level = wire::ReuseLevel::None;
      r->reused_tokens = 0;
      r->blend_plan = r->blend_shadow = false;
      break;
    }
    r->prefix_plan.reset();
    broker_.remember_prefix(r->prefix_key, identity);
    r->owner = identity;
    r->handed_by = identity;
    r->decode_target = decode_identity;
    r->decode_reserved = true;
    if (r->attempt == 1 || r->prefill_dispatched == Clock::time_point{}) {
      r->prefill_dispatched = Clock::now();
      metrics_.queue_time->observe(
          std::chrono::duration<double>(r->prefill_dispatched - r->received).count());
    }
    tracker_.prefill_queue.pop_front();
  }
}

// A full hit's KV, which the probe sent back with its PrefillDone: to a decode replica.
void Dispatcher::to_decode() {
  while (!tracker_.decode_queue.empty()) {
    Handoff& handoff = tracker_.decode_queue.front();
    Request* r = tracker_.find(handoff.id, handoff.attempt);
    if (r == nullptr) {
      tracker_.decode_queue.pop_front();
      continue;
    }
    runtime::Peer* decode = hub_.pick(wire::StageKind::Decode);
    if (decode == nullptr) break;
    const std::string identity = decode->identity;
    // The KV frame moves on without a copy.
    std::vector<zmq::message_t> frames = handoff.message.release_frames();
    if (!hub_.send(identity, frames, true)) {
      // That replica is gone; the handoff waits for another (the frames were not sent).
      wire::Decoded again = wire::decode(std::move(frames));
      if (!again.message) {
        tracker_.decode_queue.pop_front();
        tracker_.retry_or_fail(*r, "decode replica unreachable");
        continue;
      }
      handoff.message = std::move(*again.message);
      break;
    }
    r->owner = identity;
    tracker_.decode_queue.pop_front();
  }
}

}  // namespace moeline::stages
