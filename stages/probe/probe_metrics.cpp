#include "stages/probe/probe_metrics.h"

#include <utility>

namespace moeline::stages {

ProbeMetrics::ProbeMetrics(runtime::Registry& registry) {
  lookups = &registry.counter("moeline_probe_lookups_total", "Jobs looked up");
  lookup_tokens =
      &registry.counter("moeline_probe_lookup_tokens_total", "Prompt tokens of the jobs looked up");
  for (const wire::ReuseLevel value : wire::EnumValuesReuseLevel()) {
    const std::string level(wire::name(value));
    hits[value] = &registry.counter("moeline_probe_hits_total",
                                    "Jobs by the reuse level that served them (request-weighted)",
                                    {{"level", level}});
    hit_tokens[value] = &registry.counter(
        "moeline_probe_hit_tokens_total",
        "Prompt tokens reused, by level (token-weighted; none: tokens not reused)",
        {{"level", level}});
    outcomes[value] =
        &registry.counter("moeline_probe_requests_total", "Jobs by outcome", {{"outcome", level}});
  }
  latency = &registry.histogram("moeline_probe_latency_seconds", "Lookup time per job",
                                runtime::latency_buckets());
  batch = &registry.histogram("moeline_probe_batch_size", "Messages handled per loop iteration",
                              runtime::size_buckets());
  queue_depth = &registry.gauge("moeline_probe_queue_depth", "Jobs waiting in this probe");
  puts = &registry.counter("moeline_probe_store_puts_total", "Entries put into the store");
  for (const char* tier : {"ram", "disk"}) {
    bytes[tier] = &registry.gauge("moeline_probe_store_bytes", "Snapshot store bytes by tier",
                                  {{"tier", tier}});
    entries[tier] = &registry.gauge("moeline_probe_store_entries", "Snapshot store entries by tier",
                                    {{"tier", tier}});
  }
  for (const char* store : {"snapshots", "signatures"})
    disk_file_bytes[store] = &registry.gauge(
        "moeline_probe_store_disk_file_bytes",
        "Bytes a store's disk tier takes on its file system (its files, as du counts them)",
        {{"store", store}});
  using wire::ApproximateOutcome;
  for (const ApproximateOutcome outcome :
       {ApproximateOutcome::Response, ApproximateOutcome::Blend, ApproximateOutcome::Shadow,
        ApproximateOutcome::NoCandidate, ApproximateOutcome::Rejected})
    approximate[outcome] = &registry.counter(
        "moeline_probe_approximate_total",
        "Lookups that asked for approximate reuse, by outcome (response/blend: served hits; "
        "shadow: candidate computed in full and compared; rejected: candidate refused)",
        {{"outcome", std::string(wire::name(outcome))}});
  for (const char* mode : {"response", "blend"}) {
    candidates[mode] =
        &registry.counter("moeline_probe_approximate_candidates_total",
                          "Candidates at or above the threshold, by mode", {{"mode", mode}});
    served[mode] = &registry.counter("moeline_probe_approximate_served_total",
                                     "Approximate hits served, by mode", {{"mode", mode}});
  }
  for (const char* result : {"agreed", "disagreed"})
    checks[result] = &registry.counter("moeline_probe_shadow_checks_total",
                                       "Shadow check outcomes received", {{"result", result}});
  agreement = &registry.gauge("moeline_probe_shadow_agreement",
                              "Share of shadow checks that agreed (all received)");
  error_estimate = &registry.gauge(
      "moeline_probe_approximate_error_bound",
      "Upper 95% bound of the false-reuse rate, in the best-evidenced cell of the decision rule");
  index_entries = &registry.gauge("moeline_probe_index_entries", "Live signatures in the index");
  index_tombstones =
      &registry.gauge("moeline_probe_index_tombstones", "Removed entries not yet rebuilt away");
  index_rebuilds = &registry.gauge("moeline_probe_index_rebuilds", "Index rebuilds (total)");
  signature_seconds = &registry.histogram(
      "moeline_probe_signature_seconds",
      "Partial forward for a lookup's signature (compare with prefill time per job)",
      runtime::latency_buckets());
  shadow_kl = &registry.histogram(
      "moeline_probe_shadow_kl",
      "Response-reuse shadow checks: KL(full || donor) of the first-token distributions (nats)",
      {0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5});
  for (const char* result : {"agreed", "disagreed"})
    top1[result] = &registry.counter(
        "moeline_probe_shadow_top1_total",
        "Response-reuse shadow checks: top-1 first token of the full computation vs the donor's",
        {{"result", result}});
  prefix_imports = &registry.counter(
      "moeline_probe_signature_prefix_imports_total",
      "Lookups whose signature imported the cached prefix (KV and router sums) instead of "
      "recomputing it");
  refused_records = &registry.counter(
      "moeline_probe_refused_records_total",
      "Snapshot records refused (a malformed signature or quality record, or an unknown kind)");
  const std::vector<std::pair<const char*, const char*>> counters = {
      {"evictions", "Entries evicted from the RAM tier"},
      {"spills", "Entries written to the disk tier"},
      {"restores", "Entries read back from the disk tier"},
      {"disk_evictions", "Entries dropped from the disk tier (its budget)"},
      {"corrupt_entries", "Disk entries that failed their checksum (dropped, never served)"},
      {"spill_failures", "Spills the disk tier refused (a full or failing disk; dropped)"}};
  for (const auto& [name, help] : counters)
    store_counters[name] =
        &registry.gauge(std::string("moeline_probe_store_") + name, std::string(help) + " (total)");
}

}  // namespace moeline::stages
