#include "stages/prefill/prefill_metrics.h"

namespace moeline::stages::prefill {

using namespace metric;

PrefillMetrics::PrefillMetrics(runtime::Registry& registry) {
  kv_used = &registry.gauge(kKvBlocks, {{"state", "used"}});
  kv_free = &registry.gauge(kKvBlocks, {{"state", "free"}});
  queue_depth = &registry.gauge(kQueueDepth);
  batch_size = &registry.histogram(kBatchSize, runtime::size_buckets());
  batch_tokens = &registry.histogram(kBatchTokens, {16, 64, 256, 1024, 4096, 16384});
  ttft = &registry.histogram(kTtft, runtime::latency_buckets());
  tpot = &registry.histogram(kTpot, runtime::latency_buckets());
  e2e = &registry.histogram(kE2e, runtime::latency_buckets());
  const char* names[] = {"done", "finished", "failed", "cancelled", "handed_back"};
  for (size_t i = 0; i < std::size(names); ++i)
    outcomes[i] = &registry.counter(kRequests, {{"outcome", names[i]}});
  tokens = &registry.counter(kTokens);
  reused_tokens = &registry.counter(kReusedTokens);
  blend_jobs = &registry.counter(kBlendJobs);
  blend_recomputed = &registry.counter(kBlendRecomputed);
  blend_tokens = &registry.counter(kBlendTokens);
  blend_shadows = &registry.counter(kBlendShadows);
  blend_refused = &registry.counter(kBlendRefused);
  handover_failures = &registry.counter(kHandoverFailures);
  puts_dropped = &registry.counter(kPutsDropped);
  scored_tokens = &registry.counter(kScoredTokens);
}

}  // namespace moeline::stages::prefill
