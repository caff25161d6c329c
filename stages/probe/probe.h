#pragma once
// `moeline probe`: looks up every job before prefill in the snapshot store it owns (reuse/:
// RAM tier, RocksDB disk tier) and answers the job's reuse plan, within the levels the gateway
// allows for that request:
//   result  an identical deterministic request finished before: its completion is replayed;
//   full    the whole prompt is cached (blocks + first-token logits): the probe itself samples
//           the first token and answers PrefillDone with the KV — prefill is skipped;
//   prefix  the longest run of cached full blocks: their KV goes to prefill, which computes only
//           the rest;
//   none    nothing cached.
// Entries arrive as SnapshotPut: prefill puts the blocks and prompt logits it computed, the
// gateway the completions of deterministic requests. Keys chain the model id and the cache
// namespace (derived by the gateway from the tenant), so tenants never see each other's entries.
namespace moeline::stages {
int probe_main(int argc, char** argv);
}
