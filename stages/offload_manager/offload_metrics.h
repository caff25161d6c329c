#pragma once
// Every metric the offload manager exports, named in one place: the table is what /metrics shows
// (dashboards and `moeline experts` read these names). The pool's are registered once a pool
// exists; the router health's per layer and expert.

#include "stages/runtime/metrics.h"

namespace moeline::stages::offload_metric {

using runtime::MetricName;
inline constexpr MetricName kExpertHitsTotal{"moeline_offload_expert_hits_total",
                                             "Expert acquisitions that found the expert resident"};
inline constexpr MetricName kExpertMissesTotal{"moeline_offload_expert_misses_total",
                                               "Expert acquisitions that waited for a load"};
inline constexpr MetricName kExpertJoinedTotal{
    "moeline_offload_expert_joined_total",
    "Expert misses that waited for a load another caller's demand had started (read nothing)"};
inline constexpr MetricName kExpertLoadsTotal{"moeline_offload_expert_loads_total",
                                              "Experts read into the tier"};
inline constexpr MetricName kExpertEvictionsTotal{"moeline_offload_expert_evictions_total",
                                                  "Experts evicted from the tier"};
inline constexpr MetricName kBytesMovedTotal{"moeline_offload_bytes_moved_total",
                                             "Bytes read into the tier"};
inline constexpr MetricName kExpertLoadSecondsTotal{"moeline_offload_expert_load_seconds_total",
                                                    "Time spent reading experts"};
inline constexpr MetricName kStallSecondsTotal{"moeline_offload_stall_seconds_total",
                                               "Time compute waited for experts"};
inline constexpr MetricName kPrefetchRequestsTotal{"moeline_offload_prefetch_requests_total",
                                                   "Prefetches queued"};
inline constexpr MetricName kPrefetchUsedTotal{"moeline_offload_prefetch_used_total",
                                               "Prefetched experts used before eviction"};
inline constexpr MetricName kPrefetchLateTotal{
    "moeline_offload_prefetch_late_total", "Demand found its expert still loading for a prefetch"};
inline constexpr MetricName kPrefetchDroppedTotal{"moeline_offload_prefetch_dropped_total",
                                                  "Prefetches not queued for want of a free slot"};
inline constexpr MetricName kClientsReclaimedTotal{
    "moeline_offload_clients_reclaimed_total",
    "Dead compute processes whose expert pins were taken back"};
inline constexpr MetricName kPrefetchEnabled{
    "moeline_offload_prefetch_enabled",
    "1 while prefetch runs for this kind of forward pass (decode, prefill), 0 once switched off"};
inline constexpr MetricName kPrefetchSwitchedOffTotal{
    "moeline_offload_prefetch_switched_off_total",
    "Times prefetch was switched off for a kind: its late or wasted share passed the threshold"};
inline constexpr MetricName kExpertHitRatio{"moeline_offload_expert_hit_ratio",
                                            "Share of acquisitions served without a load"};
inline constexpr MetricName kPrefetchPrecision{
    "moeline_offload_prefetch_precision", "Prefetched experts used / prefetched experts loaded"};
inline constexpr MetricName kExpertsResident{"moeline_offload_experts_resident",
                                             "Experts in the tier"};
inline constexpr MetricName kExpertSlots{"moeline_offload_expert_slots",
                                         "Expert slots of the tier"};
inline constexpr MetricName kExpertLoadSeconds{"moeline_offload_expert_load_seconds",
                                               "Expert load time (sum from bucket midpoints; exact "
                                               "total: moeline_offload_expert_load_seconds_total)"};
inline constexpr MetricName kPrefetchRecall{
    "moeline_offload_prefetch_recall",
    "Prefetched experts used / needed experts that were not resident"};
inline constexpr MetricName kBytesPerToken{"moeline_offload_bytes_per_token",
                                           "Bytes read into the tier per routed token"};
inline constexpr MetricName kStallSecondsPerToken{
    "moeline_offload_stall_seconds_per_token",
    "Compute time spent waiting for experts per routed token"};
inline constexpr MetricName kExpertsPerToken{"moeline_offload_experts_per_token",
                                             "Expert acquisitions per routed token (all layers)"};
inline constexpr MetricName kDirectIo{"moeline_offload_direct_io",
                                      "1 when experts are read with O_DIRECT (no page cache)"};
inline constexpr MetricName kLayerHitRatio{"moeline_offload_layer_hit_ratio",
                                           "Share of a layer's acquisitions served without a load"};
inline constexpr MetricName kRoutedTokensTotal{
    "moeline_offload_routed_tokens_total", "Tokens whose routing was reported by compute stages"};
inline constexpr MetricName kLoadImbalance{"moeline_offload_load_imbalance",
                                           "std/mean of per-expert token counts (recent traffic)"};
inline constexpr MetricName kRouterConfidence{
    "moeline_offload_router_confidence",
    "Mean ln(top-1 / top-2 router probability) over recent tokens"};
inline constexpr MetricName kRouterHealth{"moeline_offload_router_health",
                                          "0 ok, 1 warning, 2 critical"};
inline constexpr MetricName kRouterSecondsTotal{"moeline_offload_router_seconds_total",
                                                "Time the routers took"};
inline constexpr MetricName kExpertTokensTotal{"moeline_offload_expert_tokens_total",
                                               "Tokens routed to each expert"};
inline constexpr MetricName kExpertBytes{"moeline_offload_expert_bytes", "Bytes of expert weights"};
inline constexpr MetricName kTierBudgetBytes{"moeline_offload_tier_budget_bytes",
                                             "Byte budget of a tier"};
inline constexpr MetricName kPlansTotal{"moeline_offload_plans_total", "Expert plans served"};

}  // namespace moeline::stages::offload_metric
