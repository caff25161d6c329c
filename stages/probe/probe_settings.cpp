#include "stages/probe/probe_settings.h"

#include "stages/common/common.h"

namespace moeline::stages::probe {

ProbeSettings ProbeSettings::from(const runtime::Config& config, const std::string& replica) {
  ProbeSettings settings;
  const int64_t queue = config.integer("queue");
  if (queue < 1 || queue > 4096)
    throw runtime::ConfigError("--queue must be 1..4096, got " + std::to_string(queue));
  settings.queue_capacity = static_cast<uint32_t>(queue);
  settings.store.ram_bytes = runtime::parse_bytes(config.text("store-ram-bytes"));
  settings.store.disk_bytes = runtime::parse_bytes(config.text("store-disk-bytes"));
  settings.store.disk_reserve_bytes = runtime::parse_bytes(config.text("store-disk-reserve"));
  settings.store.disk_path = config.text("store-path");
  // One folder per replica where replicas share a volume (docker-compose --scale probe=N).
  if (const size_t at = settings.store.disk_path.find("{replica}"); at != std::string::npos)
    settings.store.disk_path.replace(at, 9, replica);
  settings.store_policy = config.text("store-policy");
  if (settings.store_policy != "slru" && settings.store_policy != "lru")
    throw runtime::ConfigError("--store-policy must be slru or lru, got '" + settings.store_policy +
                               "'");
  settings.store.policy = settings.store_policy == "lru" ? reuse::EvictionPolicy::kLru
                                                         : reuse::EvictionPolicy::kSegmentedLru;
  return settings;
}

std::vector<runtime::ConfigKey> probe_keys() {
  std::vector<runtime::ConfigKey> keys = worker_keys();
  for (const runtime::ConfigKey& key : intake_keys()) keys.push_back(key);
  keys.push_back({"queue", "64", "jobs this probe accepts at once (its credit)"});
  keys.push_back({"store-ram-bytes", "256MiB", "RAM tier budget of the snapshot store"});
  keys.push_back({"store-disk-bytes", "4GiB", "disk tier budget (RocksDB)"});
  keys.push_back({"store-disk-reserve", "64MiB",
                  "free space the disk tier leaves on its file system: below it nothing spills, "
                  "and a store is opened without its disk tier"});
  keys.push_back({"store-path", "",
                  "disk tier folder (empty: no disk tier); {replica} becomes the replica's name "
                  "(one folder each where probes share a volume)"});
  keys.push_back(
      {"store-policy", "slru", "RAM eviction: slru (segmented LRU, scan-resistant) or lru"});
  for (const runtime::ConfigKey& key : signature_keys()) keys.push_back(key);
  keys.push_back(
      {"signature-max-tokens", "4096",
       "longest prompt a lookup computes a signature for (longer: no approximate reuse)"});
  keys.push_back({"signature-store-bytes", "64MiB",
                  "RAM budget of the signature records (disk: store-path/signatures)"});
  keys.push_back({"index-m", "32", "HNSW M (links per node)"});
  keys.push_back({"index-ef-construction", "200", "HNSW efConstruction"});
  keys.push_back({"index-ef-search", "64", "HNSW efSearch"});
  keys.push_back({"approximate-metric", "cosine",
                  "signature similarity: cosine, euclidean (as 1 - distance / 2) or jaccard (over "
                  "the chosen experts per layer)"});
  keys.push_back({"approximate-threshold", "0.93",
                  "candidates at signature similarity >= this (in --approximate-metric)"});
  keys.push_back({"approximate-max-error", "0.01",
                  "delta: serve a cell's candidates only while the upper 95% bound of its "
                  "false-reuse rate is at most this"});
  keys.push_back({"approximate-shadow-fraction", "0.05",
                  "share of served approximate hits also computed in full and compared"});
  keys.push_back({"approximate-bin-width", "0.01", "similarity bins of the decision rule's cells"});
  keys.push_back({"approximate-recompute-fraction", "0.15",
                  "blended reuse recomputes this share of the donor's tokens (most deviating)"});
  return keys;
}

}  // namespace moeline::stages::probe
