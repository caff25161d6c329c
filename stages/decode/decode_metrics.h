#pragma once
// Every metric decode exports, named in one place (the table is what /metrics shows), registered
// once at start so that a scrape before the first sequence already lists them.

#include <map>
#include <string>

#include "stages/runtime/metrics.h"

namespace moeline::stages::decode {

namespace metric {
using runtime::MetricName;
inline constexpr MetricName kKvBlocks{"moeline_decode_kv_blocks", "KV blocks"};
inline constexpr MetricName kQueueDepth{"moeline_decode_queue_depth",
                                        "Sequences waiting for KV room to join"};
inline constexpr MetricName kActive{"moeline_decode_active_sequences",
                                    "Sequences in the running batch"};
inline constexpr MetricName kBatchSize{"moeline_decode_batch_size", "Sequences per decode step"};
inline constexpr MetricName kStep{"moeline_decode_step_seconds",
                                  "One decode step (forward+sample)"};
inline constexpr MetricName kTtft{"moeline_decode_ttft_seconds",
                                  "Handoff received to the second token (first decoded here)"};
inline constexpr MetricName kTpot{"moeline_decode_time_per_output_token_seconds",
                                  "Time between a sequence's tokens"};
inline constexpr MetricName kE2e{"moeline_decode_e2e_seconds", "Handoff received to last token"};
inline constexpr MetricName kRequests{"moeline_decode_requests_total", "Sequences by outcome"};
inline constexpr MetricName kTokens{"moeline_decode_tokens_total", "Tokens generated"};
inline constexpr MetricName kHandedBack{"moeline_decode_handed_back_total",
                                        "Sequences given back to the gateway by a drain"};
inline constexpr MetricName kHandovers{"moeline_decode_handovers_total",
                                       "Sequences prefill handed over directly, by outcome"};
}  // namespace metric

struct DecodeMetrics {
  explicit DecodeMetrics(runtime::Registry& registry);
  // kRequests by outcome: "stop", "length", "failed", "cancelled".
  runtime::Counter& outcome(const std::string& outcome) { return *outcomes.at(outcome); }

  runtime::Gauge *kv_used, *kv_free, *queue_depth, *active;
  runtime::Histogram *batch_size, *step, *ttft, *tpot, *e2e;
  runtime::Counter *tokens, *handed_back, *handovers, *handovers_refused;
  std::map<std::string, runtime::Counter*> outcomes;
};

}  // namespace moeline::stages::decode
