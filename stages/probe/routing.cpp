#include "stages/probe/routing.h"

#include "schemas/vocabulary.h"
#include "stages/common/common.h"

namespace moeline::stages {
namespace {

bool has_route(const wire::PeerRoute* route) {
  return route != nullptr && route->endpoint() != nullptr && route->endpoint()->size() > 0;
}

std::string text(const flatbuffers::String* s) {
  return s == nullptr ? std::string() : s->str();
}

flatbuffers::Offset<wire::PeerRoute> copy_route(flatbuffers::FlatBufferBuilder& builder,
                                                const wire::PeerRoute* route) {
  if (route == nullptr) return 0;
  auto ticket =
      route->ticket() ? builder.CreateVector(route->ticket()->data(), route->ticket()->size()) : 0;
  return wire::CreatePeerRoute(builder, builder.CreateString(text(route->replica())),
                               builder.CreateString(text(route->endpoint())),
                               builder.CreateString(text(route->server_key())), ticket,
                               builder.CreateString(text(route->node())));
}

}  // namespace

void PlanRouter::send_plan(const wire::ProbeJob& job, std::vector<zmq::message_t>&& plan) {
  if (!has_route(job.prefill_route())) {
    link_.send(std::move(plan));
    return;
  }
  wire::Decoded decoded = wire::decode(std::move(plan));
  if (!decoded.message) return;  // the probe's own message: cannot happen
  const auto* p = decoded.message->as<wire::ProbePlan>();
  // A finished completion is replayed by the gateway: nothing for prefill to do.
  if (p->completion() != nullptr && p->completion()->size() > 0 &&
      wire::approximate_outcome_of(*p) != wire::ApproximateOutcome::Shadow) {
    link_.send(decoded.message->release_frames());
    return;
  }
  if (peers_.send(runtime::PeerAddress::of(job.prefill_route()),
                  prefill_job(job, *decoded.message))) {
    link_.send(notice(*p));
    return;
  }
  // Prefill did not take it: the gateway dispatches the plan itself.
  link_.send(decoded.message->release_frames());
}

std::vector<zmq::message_t> PlanRouter::prefill_job(const wire::ProbeJob& job,
                                                    wire::Message& plan_message) {
  const auto* plan = plan_message.as<wire::ProbePlan>();
  const wire::ReuseLevel level = wire::reuse_level_of(*plan);
  const bool blend = level == wire::ReuseLevel::Blend && plan->blend_mask() != nullptr;
  const bool prefix = level == wire::ReuseLevel::Prefix && plan->reused_tokens() > 0;
  const wire::ReuseLevel job_level = blend    ? wire::ReuseLevel::Blend
                                     : prefix ? wire::ReuseLevel::Prefix
                                              : wire::ReuseLevel::None;
  flatbuffers::FlatBufferBuilder builder(512 + (job.tokens() ? job.tokens()->size() * 4 : 0));
  auto tokens = job.tokens() ? builder.CreateVector(job.tokens()->data(), job.tokens()->size()) : 0;
  auto sampling = to_wire(builder, from_wire(job.sampling()));
  flatbuffers::Offset<wire::KvLayout> layout = 0;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
  std::vector<zmq::message_t> bulk;
  if ((blend || prefix) && plan->layout() != nullptr && plan->frames() != nullptr) {
    const wire::KvLayout* l = plan->layout();
    layout =
        wire::CreateKvLayout(builder, l->layers(), l->kv_heads(), l->head_dim(), l->block_tokens(),
                             builder.CreateString(text(l->dtype())), l->blocks(), l->values());
    std::vector<flatbuffers::Offset<wire::BulkFrame>> described;
    for (const wire::BulkFrame* frame : *plan->frames())
      described.push_back(wire::CreateBulkFrame(builder, frame->bytes(), frame->xxh3()));
    frames = builder.CreateVector(described);
    for (wire::AlignedFrame& frame : plan_message.bulk) {
      zmq::message_t shared;
      shared.copy(frame.message());  // shares the bytes: the plan may still go to the gateway
      bulk.push_back(std::move(shared));
    }
  }
  auto mask =
      blend ? builder.CreateVector(plan->blend_mask()->data(), plan->blend_mask()->size()) : 0;
  // A blend's shadow job also computes the prompt in full; a blend served stores nothing.
  const bool shadow =
      blend && wire::approximate_outcome_of(*plan) == wire::ApproximateOutcome::Shadow;
  // The store this probe owns takes what prefill computes (its own route, signed by itself).
  flatbuffers::Offset<wire::PeerRoute> store = 0;
  if (const auto& key = link_.handover_key(); key && job.store_levels() != 0) {
    const runtime::Ticket ticket = runtime::handover_ticket(*key, job.request_id(), job.attempt());
    store = wire::CreatePeerRoute(
        builder, builder.CreateString(""), builder.CreateString(intake_.endpoint()),
        builder.CreateString(intake_.public_key()),
        builder.CreateVector(ticket.data(), ticket.size()), builder.CreateString(intake_.node()));
  }
  auto decode = copy_route(builder, job.decode_route());
  const auto* prefill_ticket = job.prefill_route()->ticket();
  auto ticket =
      prefill_ticket ? builder.CreateVector(prefill_ticket->data(), prefill_ticket->size()) : 0;
  builder.Finish(
      wire::CreatePrefillJob(builder, job.request_id(), job.attempt(), tokens, sampling,
                             builder.CreateString(text(job.cache_namespace())),
                             builder.CreateString(wire::name(job_level)),
                             (blend || prefix) ? plan->reused_tokens() : 0, frames, layout,
                             job.store_levels(), plan->prefix_key(), mask,
                             plan->recompute_fraction(), shadow, decode, store, ticket, job_level),
      wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::PrefillJob, builder, std::move(bulk));
}

std::vector<zmq::message_t> PlanRouter::notice(const wire::ProbePlan& plan) {
  flatbuffers::FlatBufferBuilder builder(256);
  auto completion = plan.completion()
                        ? builder.CreateVector(plan.completion()->data(), plan.completion()->size())
                        : 0;
  const wire::PlanLabels labels(builder, wire::reuse_level_of(plan), wire::finish_reason_of(plan),
                                wire::approximate_outcome_of(plan), wire::shadow_mode_of(plan));
  wire::ProbePlanBuilder out(builder);
  out.add_request_id(plan.request_id());
  out.add_attempt(plan.attempt());
  labels.add_to(out);
  out.add_reused_tokens(plan.reused_tokens());
  out.add_probe_us(plan.probe_us());
  if (!completion.IsNull()) out.add_completion(completion);
  out.add_prefix_key(plan.prefix_key());
  out.add_donor_key(plan.donor_key());
  out.add_similarity(plan.similarity());
  out.add_cell(plan.cell());
  out.add_recompute_fraction(plan.recompute_fraction());
  out.add_shadow_sampled(plan.shadow_sampled());
  out.add_forwarded(true);
  builder.Finish(out.Finish(), wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::ProbePlan, builder);
}

void PlanRouter::send_done(const wire::ProbeJob& job, bool sequence_goes_on,
                           const BuildDone& build) {
  const wire::PeerRoute* decode = job.decode_route();
  if (!sequence_goes_on || !has_route(decode)) {
    link_.send(build(sequence_goes_on, nullptr));
    return;
  }
  // As prefill does: the gateway hears first, then the KV goes to the decode replica.
  link_.send(build(false, nullptr));
  if (!peers_.send(runtime::PeerAddress::of(decode), build(true, decode->ticket()))) {
    send_job_failed(link_, job.request_id(), job.attempt(), wire::ErrorCode::StageFailed,
                    "decode replica " + text(decode->replica()) + " did not take the hand-over");
  }
}

}  // namespace moeline::stages
