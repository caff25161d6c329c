#include "stages/probe/routing.h"

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
                               builder.CreateString(text(route->server_key())), ticket);
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
      text(p->approximate()) != "shadow") {
    link_.send(decoded.message->release_frames());
    return;
  }
  if (peers_.send(text(job.prefill_route()->endpoint()), text(job.prefill_route()->server_key()),
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
  const std::string level = text(plan->reuse_level());
  const bool blend = level == "blend" && plan->blend_mask() != nullptr;
  const bool prefix = level == "prefix" && plan->reused_tokens() > 0;
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
  const bool shadow = blend && text(plan->approximate()) == "shadow";
  // The store this probe owns takes what prefill computes (its own route, signed by itself).
  flatbuffers::Offset<wire::PeerRoute> store = 0;
  if (const auto& key = link_.handover_key(); key && job.store_levels() != 0) {
    const runtime::Ticket ticket = runtime::handover_ticket(*key, job.request_id(), job.attempt());
    store = wire::CreatePeerRoute(builder, builder.CreateString(""),
                                  builder.CreateString(intake_.endpoint()),
                                  builder.CreateString(intake_.public_key()),
                                  builder.CreateVector(ticket.data(), ticket.size()));
  }
  auto decode = copy_route(builder, job.decode_route());
  const auto* prefill_ticket = job.prefill_route()->ticket();
  auto ticket =
      prefill_ticket ? builder.CreateVector(prefill_ticket->data(), prefill_ticket->size()) : 0;
  builder.Finish(wire::CreatePrefillJob(builder, job.request_id(), job.attempt(), tokens, sampling,
                                        builder.CreateString(text(job.cache_namespace())),
                                        builder.CreateString(blend    ? "blend"
                                                             : prefix ? "prefix"
                                                                      : "none"),
                                        (blend || prefix) ? plan->reused_tokens() : 0, frames,
                                        layout, job.store_levels(), plan->prefix_key(), mask,
                                        plan->recompute_fraction(), shadow, decode, store, ticket),
                 wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::PrefillJob, builder, std::move(bulk));
}

std::vector<zmq::message_t> PlanRouter::notice(const wire::ProbePlan& plan) {
  flatbuffers::FlatBufferBuilder builder(256);
  auto level = builder.CreateString(text(plan.reuse_level()));
  auto completion = plan.completion()
                        ? builder.CreateVector(plan.completion()->data(), plan.completion()->size())
                        : 0;
  auto finish = builder.CreateString(text(plan.finish_reason()));
  auto approximate = builder.CreateString(text(plan.approximate()));
  auto shadow_mode = builder.CreateString(text(plan.shadow_mode()));
  wire::ProbePlanBuilder out(builder);
  out.add_request_id(plan.request_id());
  out.add_attempt(plan.attempt());
  out.add_reuse_level(level);
  out.add_reused_tokens(plan.reused_tokens());
  out.add_probe_us(plan.probe_us());
  if (!completion.IsNull()) out.add_completion(completion);
  out.add_finish_reason(finish);
  out.add_prefix_key(plan.prefix_key());
  out.add_approximate(approximate);
  out.add_donor_key(plan.donor_key());
  out.add_similarity(plan.similarity());
  out.add_cell(plan.cell());
  out.add_recompute_fraction(plan.recompute_fraction());
  out.add_shadow_mode(shadow_mode);
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
  if (!peers_.send(text(decode->endpoint()), text(decode->server_key()),
                   build(true, decode->ticket()))) {
    flatbuffers::FlatBufferBuilder builder(256);
    builder.Finish(wire::CreateJobFailed(
                       builder, job.request_id(), job.attempt(), wire::ErrorCode::StageFailed,
                       builder.CreateString("decode replica " + text(decode->replica()) +
                                            " did not take the hand-over")),
                   wire::PrefillJobIdentifier());
    link_.send(wire::encode(wire::MessageType::JobFailed, builder));
  }
}

}  // namespace moeline::stages
