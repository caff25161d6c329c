#pragma once
// The probe's access to its snapshot stores: opening one so that a bad disk never keeps the probe
// down, the longest cached run of a prompt's blocks, and blocks as one bulk frame.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>
#include <zmq.hpp>

#include "reuse/snapshot_store.h"
#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"

namespace moeline::stages {

// A disk tier that cannot be opened (corrupt, or on a full disk) must not keep the probe down:
// every request would wait for it. It is moved aside (named in the log and counted) and the
// probe starts with an empty disk tier, or with none when even that cannot be opened. `name`
// labels it in the metrics ("snapshots", "signatures").
std::unique_ptr<reuse::SnapshotStore> open_store(const reuse::StoreOptions& options,
                                                 const char* name, runtime::Registry& registry,
                                                 runtime::Logger& log);

// The longest run of cached blocks of `chain` from the start, at most `limit` (values in order).
// The blocks are read deepest first, so that the head of the chain is the most recently used: a
// chain is only useful from its first block on, so its first blocks are the last ones to evict.
// A record that is not one block of `block_bytes` (failed its checksum) ends the run there.
std::vector<reuse::Value> cached_prefix(reuse::SnapshotStore& store,
                                        const std::vector<uint64_t>& chain, size_t limit,
                                        size_t block_bytes);

// One bulk frame holding the blocks' KV in order, and its checksum.
zmq::message_t concatenate(const std::vector<reuse::Value>& blocks, uint64_t& checksum);

}  // namespace moeline::stages
