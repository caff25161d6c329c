#include "stages/probe/stored_kv.h"

#include <algorithm>

#include "reuse/records.h"
#include "schemas/wire.h"

namespace moeline::stages {

std::unique_ptr<reuse::SnapshotStore> open_store(const reuse::StoreOptions& options,
                                                 const char* name, runtime::Registry& registry,
                                                 runtime::Logger& log) {
  reuse::StoreOpenReport report;
  auto store = reuse::SnapshotStore::open_resilient(options, report);
  if (!report.error.empty()) {
    registry
        .counter("moeline_probe_store_open_failures_total",
                 "Disk tiers that could not be opened at start (moved aside, or run without)",
                 {{"store", name}, {"outcome", report.disk_tier ? "moved_aside" : "no_disk_tier"}})
        .inc();
    log.error("store_unusable", {{"store", name},
                                 {"path", options.disk_path},
                                 {"moved_to", report.moved_aside_to},
                                 {"disk_tier", report.disk_tier},
                                 {"error", report.error}});
  }
  registry
      .gauge("moeline_probe_store_disk_tier", "1 while the store has a disk tier",
             {{"store", name}})
      .set(report.disk_tier && !options.disk_path.empty() ? 1 : 0);
  return store;
}

std::vector<reuse::Value> cached_prefix(reuse::SnapshotStore& store,
                                        const std::vector<uint64_t>& chain, size_t limit,
                                        size_t block_bytes) {
  size_t run = 0;
  while (run < chain.size() && run < limit && store.contains(reuse::block_entry(chain[run]))) ++run;
  std::vector<reuse::Value> blocks(run);
  for (size_t b = run; b-- > 0;) blocks[b] = store.get(reuse::block_entry(chain[b]));
  // A record that failed its checksum on disk ends the run there.
  for (size_t b = 0; b < run; ++b) {
    if (!blocks[b] || blocks[b]->size() != block_bytes) {
      blocks.resize(b);
      break;
    }
  }
  return blocks;
}

zmq::message_t concatenate(const std::vector<reuse::Value>& blocks, uint64_t& checksum) {
  size_t total = 0;
  for (const reuse::Value& block : blocks) total += block->size();
  zmq::message_t frame(total);
  auto* out = static_cast<uint8_t*>(frame.data());
  for (const reuse::Value& block : blocks) {
    std::copy(block->begin(), block->end(), reinterpret_cast<char*>(out));
    out += block->size();
  }
  checksum = wire::checksum({static_cast<const uint8_t*>(frame.data()), frame.size()});
  return frame;
}

}  // namespace moeline::stages
