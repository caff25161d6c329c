#include "offload/pool_eviction.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "offload/expert_pool.h"
#include "offload/pool_layout.h"

namespace moeline::offload::pool_detail {
namespace {

// How far ahead, in layer steps, an entry's next use is expected while `current` runs.
// The layers the clients' decode steps are at now (those seen within kDecodeIdleNs), or `current`
// when none is decoding: what an expert's next use is measured from. A prefill's own position
// says nothing of when decode needs an expert again.
struct DecodePositions {
  int32_t layers[kMaxClients];
  uint32_t count = 0;
};
DecodePositions decode_positions(PoolLayout* l, int32_t current) {
  DecodePositions out;
  const uint64_t now = now_ns();
  for (uint32_t c = 0; c < kMaxClients; ++c) {
    const PoolClientSlot& client = l->clients()[c];
    if (client.in_use && client.decode_layer >= 0 && client.decode_layer_ns + kDecodeIdleNs > now)
      out.layers[out.count++] = client.decode_layer;
  }
  if (out.count == 0) out.layers[out.count++] = current;
  return out;
}

// The nearest expected next use of the entry from any of those positions.
double entry_distance(PoolLayout* l, uint32_t index, const DecodePositions& from) {
  const PoolEntry& e = l->entry_table()[index];
  const auto layer = static_cast<int32_t>(index / l->experts_per_layer);
  double nearest = std::numeric_limits<double>::infinity();
  for (uint32_t i = 0; i < from.count; ++i)
    nearest = std::min(
        nearest, expected_reuse_distance(layer, from.layers[i], static_cast<int32_t>(l->layers),
                                         e.uses, l->layer_visits()[layer]));
  return nearest;
}

// The clients that have said which experts of the layer they run they have still to acquire
// (PoolClient::expect), recently enough to be running it.
struct WantedNow {
  uint32_t clients[kMaxClients];
  uint32_t count = 0;
};
WantedNow wanted_now(PoolLayout* l) {
  WantedNow out;
  const uint64_t now = now_ns();
  for (uint32_t c = 0; c < kMaxClients; ++c) {
    const PoolClientSlot& client = l->clients()[c];
    if (client.in_use && client.wanted_layer >= 0 && client.wanted_ns + kDecodeIdleNs > now)
      out.clients[out.count++] = c;
  }
  return out;
}

bool is_wanted(PoolLayout* l, const WantedNow& wanted, uint32_t index) {
  const uint32_t layer = index / l->experts_per_layer, expert = index % l->experts_per_layer;
  for (uint32_t i = 0; i < wanted.count; ++i) {
    const uint32_t c = wanted.clients[i];
    if (static_cast<uint32_t>(l->clients()[c].wanted_layer) == layer && l->wanted_by(c, expert))
      return true;
  }
  return false;
}

}  // namespace

int64_t reserve_slot(PoolLayout* l, int32_t current, bool for_prefetch, double at_most) {
  int32_t* owner = l->slot_owner();
  PoolEntry* entries = l->entry_table();
  int64_t victim = -1;
  double victim_distance = 0;
  const DecodePositions from = decode_positions(l, current);
  const WantedNow wanted = wanted_now(l);
  for (uint64_t s = 0; s < l->slots; ++s) {
    if (owner[s] < 0) return static_cast<int64_t>(s);
    const PoolEntry& e = entries[owner[s]];
    if (e.state != kResident || e.pins > 0) continue;
    if (for_prefetch && e.prefetched) continue;
    // What a forward pass is about to acquire of the layer it runs goes last (distance 0, below
    // any other): by the estimate alone the experts of a layer running look a whole cycle away,
    // and were evicted between two acquisitions of that layer. What a prefill batch brought in and
    // no decode step has used since sits at the cold end: evicted before anything decode uses
    // (the least recent of them first).
    const auto index = static_cast<uint32_t>(owner[s]);
    const double distance = is_wanted(l, wanted, index) ? -1.0
                            : e.streamed                ? std::numeric_limits<double>::infinity()
                                                        : entry_distance(l, index, from);
    if (for_prefetch && distance <= at_most) continue;
    if (victim < 0 || distance > victim_distance ||
        (distance == victim_distance && e.last_use < entries[owner[victim]].last_use)) {
      victim = static_cast<int64_t>(s);
      victim_distance = distance;
    }
  }
  if (victim >= 0) {
    PoolEntry& evicted = entries[owner[victim]];
    if (evicted.prefetched) ++l->counters.prefetch_by_kind[evicted.prefetched - 1u].wasted;
    evicted.state = kAbsent;
    evicted.slot = -1;
    evicted.prefetched = 0;
    evicted.streamed = 0;
    owner[victim] = -1;
    ++l->counters.evictions;
  }
  return victim;
}

void queue_load(PoolLayout* l, uint32_t index, int64_t slot, uint8_t prefetched, bool streamed) {
  PoolEntry& e = l->entry_table()[index];
  l->slot_owner()[slot] = static_cast<int32_t>(index);
  e.slot = static_cast<int32_t>(slot);
  e.state = kQueued;
  e.demanded = prefetched == 0 ? 1 : 0;
  e.prefetched = prefetched;
  e.streamed = streamed ? 1 : 0;
  e.request_tick = ++l->tick;
  notify(&l->requests);
}

int64_t pin_share(PoolLayout* l) {
  int64_t clients = 0;
  for (uint32_t c = 0; c < kMaxClients; ++c) clients += l->clients()[c].in_use ? 1 : 0;
  return std::max<int64_t>(1, static_cast<int64_t>(l->slots) / (2 * std::max<int64_t>(clients, 1)));
}

}  // namespace moeline::offload::pool_detail
