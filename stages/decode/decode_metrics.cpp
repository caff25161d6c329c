#include "stages/decode/decode_metrics.h"

namespace moeline::stages::decode {

using namespace metric;

DecodeMetrics::DecodeMetrics(runtime::Registry& registry) {
  kv_used = &registry.gauge(kKvBlocks, {{"state", "used"}});
  kv_free = &registry.gauge(kKvBlocks, {{"state", "free"}});
  queue_depth = &registry.gauge(kQueueDepth);
  active = &registry.gauge(kActive);
  batch_size = &registry.histogram(kBatchSize, runtime::size_buckets());
  step = &registry.histogram(kStep, runtime::latency_buckets());
  ttft = &registry.histogram(kTtft, runtime::latency_buckets());
  tpot = &registry.histogram(kTpot, runtime::latency_buckets());
  e2e = &registry.histogram(kE2e, runtime::latency_buckets());
  for (const char* name : {"stop", "length", "failed", "cancelled"})
    outcomes[name] = &registry.counter(kRequests, {{"outcome", name}});
  tokens = &registry.counter(kTokens);
  handed_back = &registry.counter(kHandedBack);
  handovers = &registry.counter(kHandovers, {{"outcome", "accepted"}});
  handovers_refused = &registry.counter(kHandovers, {{"outcome", "refused"}});
}

}  // namespace moeline::stages::decode
