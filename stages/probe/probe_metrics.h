#pragma once
// Every metric the probe exports, registered once at start (a scrape before the first lookup
// already lists them): lookups and hits by level, the snapshot store's tiers, approximate reuse
// (candidates, decisions, shadow checks, the index).

#include <map>
#include <string>

#include "schemas/vocabulary.h"
#include "stages/runtime/metrics.h"

namespace moeline::stages {

struct ProbeMetrics {
  explicit ProbeMetrics(runtime::Registry& registry);

  // Lookups and what served them.
  runtime::Counter *lookups, *lookup_tokens, *puts;
  std::map<wire::ReuseLevel, runtime::Counter*> hits, hit_tokens, outcomes;
  runtime::Histogram *latency, *batch;
  runtime::Gauge* queue_depth;
  // The snapshot store, by tier ("ram", "disk"), and its totals by name.
  std::map<std::string, runtime::Gauge*> bytes, entries, store_counters;
  // What each store's disk tier takes on its file system ("snapshots", "signatures").
  std::map<std::string, runtime::Gauge*> disk_file_bytes;
  // Approximate reuse.
  std::map<wire::ApproximateOutcome, runtime::Counter*> approximate;
  std::map<std::string, runtime::Counter*> candidates, served, checks, top1;
  runtime::Gauge *agreement, *error_estimate, *index_entries, *index_tombstones, *index_rebuilds;
  runtime::Histogram *signature_seconds, *shadow_kl;
  runtime::Counter *prefix_imports, *refused_records;
};

}  // namespace moeline::stages
