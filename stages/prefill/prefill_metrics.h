#pragma once
// Every metric prefill exports, named in one place (the table is what /metrics shows), registered
// once at start so that a scrape before the first job already lists them.

#include <map>
#include <string>

#include "stages/runtime/metrics.h"

namespace moeline::stages::prefill {

namespace metric {
using runtime::MetricName;
inline constexpr MetricName kKvBlocks{"moeline_prefill_kv_blocks", "KV blocks"};
inline constexpr MetricName kQueueDepth{"moeline_prefill_queue_depth", "Jobs waiting for a batch"};
inline constexpr MetricName kBatchSize{"moeline_prefill_batch_size", "Prompts per prefill batch"};
inline constexpr MetricName kBatchTokens{"moeline_prefill_batch_tokens",
                                         "Tokens per prefill batch"};
inline constexpr MetricName kTtft{"moeline_prefill_ttft_seconds",
                                  "Job received to first token sampled, in this stage"};
inline constexpr MetricName kTpot{"moeline_prefill_time_per_output_token_seconds",
                                  "Prefill produces one token per job: equal to the job time"};
inline constexpr MetricName kE2e{"moeline_prefill_e2e_seconds", "Job received to PrefillDone sent"};
inline constexpr MetricName kRequests{"moeline_prefill_requests_total", "Prefill jobs by outcome"};
inline constexpr MetricName kTokens{"moeline_prefill_tokens_total", "Prompt tokens prefilled"};
inline constexpr MetricName kReusedTokens{"moeline_prefill_reused_tokens_total",
                                          "Prompt tokens whose KV came from the store"};
inline constexpr MetricName kBlendJobs{"moeline_prefill_blend_jobs_total",
                                       "Blended prefills served (a donor's KV, part recomputed)"};
inline constexpr MetricName kBlendRecomputed{"moeline_prefill_blend_recomputed_tokens_total",
                                             "Tokens a blended prefill recomputed in every layer"};
inline constexpr MetricName kBlendTokens{"moeline_prefill_blend_tokens_total",
                                         "Prompt tokens of blended prefills (served and shadowed)"};
inline constexpr MetricName kBlendShadows{"moeline_prefill_blend_shadow_total",
                                          "Blends also computed in full and compared"};
inline constexpr MetricName kBlendRefused{"moeline_prefill_blend_refused_total",
                                          "Blend jobs whose KV did not fit (computed in full)"};
inline constexpr MetricName kHandoverFailures{
    "moeline_prefill_handover_failures_total",
    "Prompts whose KV the decode replica did not take (the gateway retries them)"};
inline constexpr MetricName kScoredTokens{
    "moeline_prefill_scored_prompt_tokens_total",
    "Prompt tokens of jobs that asked for their prompt's log-probabilities (computed in full)"};
inline constexpr MetricName kPutsDropped{"moeline_prefill_snapshot_puts_dropped_total",
                                         "Snapshot puts the probe could not take (lost as cache)"};
}  // namespace metric

// The outcomes of kRequests.
enum class Outcome { kDone, kFinished, kFailed, kCancelled, kHandedBack };

struct PrefillMetrics {
  explicit PrefillMetrics(runtime::Registry& registry);
  runtime::Counter& outcome(Outcome outcome) { return *outcomes[static_cast<size_t>(outcome)]; }

  runtime::Gauge *kv_used, *kv_free, *queue_depth;
  runtime::Histogram *batch_size, *batch_tokens, *ttft, *tpot, *e2e;
  runtime::Counter *tokens, *reused_tokens, *blend_jobs, *blend_recomputed, *blend_tokens,
      *blend_shadows, *blend_refused, *handover_failures, *puts_dropped, *scored_tokens;
  runtime::Counter* outcomes[5];
};

}  // namespace moeline::stages::prefill
