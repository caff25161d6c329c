#pragma once
// Which slot of the shared expert pool a load takes: the pool's eviction policy over the
// shared tables (pool_layout.h), and queueing the load into the slot it chose. Internal to
// offload/; called under the pool's lock.

#include <cstdint>

#include "offload/pool_layout.h"

namespace moeline::offload::pool_detail {

// A slot: a free one, or the unpinned resident expert whose next use is expected farthest ahead
// (expected_reuse_distance: decode runs the layers in a cycle, so the experts of the layer that
// just ran are the last needed again). A prefetch never evicts another prefetch that has not been
// used yet, nor an expert expected sooner than the one it brings in (`at_most`). -1: none.
int64_t reserve_slot(PoolLayout* l, int32_t current, bool for_prefetch, double at_most);

// `prefetched`: 0 for a demand load, else 1 + the PrefetchKind that asked for it.
void queue_load(PoolLayout* l, uint32_t index, int64_t slot, uint8_t prefetched, bool streamed);

// How many pins one client may hold before try_acquire refuses more: half the slots, split
// among the clients attached now (at least one).
int64_t pin_share(PoolLayout* l);

}  // namespace moeline::offload::pool_detail
