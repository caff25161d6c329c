#include "stages/prefill/job_intake.h"

#include <string>

#include "reuse/records.h"
#include "stages/common/common.h"

namespace moeline::stages::prefill {

Route Route::from(const wire::PeerRoute* route) {
  Route out;
  if (route == nullptr) return out;
  if (route->replica()) out.replica = route->replica()->str();
  out.to = runtime::PeerAddress::of(route);
  if (route->ticket()) out.ticket.assign(route->ticket()->begin(), route->ticket()->end());
  return out;
}

Expected<Job> JobIntake::read(wire::Message& message) {
  const wire::PrefillJob& wire_job = *message.as<wire::PrefillJob>();
  Job job;
  job.request_id = wire_job.request_id();
  job.attempt = wire_job.attempt();
  if (wire_job.tokens()) job.tokens.assign(wire_job.tokens()->begin(), wire_job.tokens()->end());
  job.sampling = from_wire(wire_job.sampling());
  job.cache_namespace = wire_job.cache_namespace() ? wire_job.cache_namespace()->str() : "";
  job.received = std::chrono::steady_clock::now();
  const int64_t vocab = worker_.model->config().vocab_size;
  if (job.tokens.empty()) return Error{"empty prompt"};
  if (static_cast<int64_t>(job.tokens.size()) > context_)
    return Error{"prompt of " + std::to_string(job.tokens.size()) +
                 " tokens exceeds the context of " + std::to_string(context_)};
  for (int32_t token : job.tokens)
    if (token < 0 || token >= vocab)
      return Error{"token id " + std::to_string(token) + " out of range"};
  if (moeline::Status status = job.sampling.validate(vocab); !status.ok()) return status.error();
  job.store_levels = wire_job.store_levels();
  job.decode_route = Route::from(wire_job.decode_route());
  job.store_route = Route::from(wire_job.store_route());
  worker_.peers->prepare(job.store_route.to);
  worker_.peers->prepare(job.decode_route.to);
  job.reuse_level = wire::reuse_level_of(wire_job);
  if (job.reuse_level == wire::ReuseLevel::Blend) {
    accept_blend(wire_job, message, job);
  } else if (wire_job.reused_tokens() > 0) {
    accept_prefix(wire_job, message, job);
  }
  return job;
}

// A prefix that does not fit this replica's cache exactly is recomputed, never trusted.
void JobIntake::accept_prefix(const wire::PrefillJob& wire_job, wire::Message& message, Job& job) {
  const uint32_t reused = wire_job.reused_tokens();
  const wire::KvLayout* layout = wire_job.layout();
  const bool usable =
      reused % model::kBlockTokens == 0 && reused < job.tokens.size() &&
      kv_layout_matches(layout, worker_.model->config(), reused / model::kBlockTokens) &&
      !wire::check_bulk(wire_job.frames(), message.bulk) && message.bulk.size() == 1 &&
      message.bulk[0].size() == layout->blocks() * worker_.forward->kv_block_bytes();
  if (usable) {
    job.reused = reused;
    job.prefix_kv = std::move(message.bulk[0]);
  } else {
    worker_.service.log.warn("prefix_refused", {{"request_id", job.request_id}});
    job.reuse_level = wire::ReuseLevel::None;
  }
}

// A blend whose KV does not fit this replica exactly is computed in full, never trusted.
void JobIntake::accept_blend(const wire::PrefillJob& wire_job, wire::Message& message, Job& job) {
  if (!worker_.engine) {
    // Blended prefill is the CPU engine's; on a GPU the job is computed in full (its exact
    // prefix, if any, is not trusted alone: the frame's layout is the blend's).
    metrics_.blend_refused->inc();
    worker_.service.log.warn("blend_refused",
                             {{"request_id", job.request_id}, {"reason", "device"}});
    job.reuse_level = wire::ReuseLevel::None;
    return;
  }
  const wire::KvLayout* layout = wire_job.layout();
  const size_t blocks = (job.tokens.size() + model::kBlockTokens - 1) / model::kBlockTokens;
  // The frame holds every block of the prompt; the first reused_tokens (whole blocks) are an
  // exact prefix, imported and never recomputed.
  const uint32_t prefix = wire_job.reused_tokens();
  const bool usable = prefix % model::kBlockTokens == 0 && prefix < job.tokens.size() &&
                      wire_job.blend_mask() && wire_job.blend_mask()->size() == job.tokens.size() &&
                      kv_layout_matches(layout, worker_.model->config(), blocks) &&
                      !wire::check_bulk(wire_job.frames(), message.bulk) &&
                      message.bulk.size() == 1 &&
                      message.bulk[0].size() == blocks * worker_.forward->kv_block_bytes() &&
                      wire_job.recompute_fraction() >= 0 && wire_job.recompute_fraction() <= 1;
  if (!usable) {
    metrics_.blend_refused->inc();
    worker_.service.log.warn("blend_refused", {{"request_id", job.request_id}});
    job.reuse_level = wire::ReuseLevel::None;
    return;
  }
  job.blend = true;
  job.shadow = wire_job.shadow();
  job.reused = prefix;
  job.blend_mask.assign(wire_job.blend_mask()->begin(), wire_job.blend_mask()->end());
  job.recompute_fraction = wire_job.recompute_fraction();
  job.blend_kv = std::move(message.bulk[0]);
  // What a blend computed is approximate: none of it goes into the exact store (a shadow job's
  // full computation does).
  if (!job.shadow) job.store_levels = 0;
}

}  // namespace moeline::stages::prefill
