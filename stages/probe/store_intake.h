#pragma once
// What the probe stores: SnapshotPut entries from prefill's intake (taken only with the ticket
// the gateway signed for this replica) and from the gateway on the hub (results and shadow
// outcomes). Blocks and prompt records go into the snapshot store; signature records and shadow
// outcomes to the approximate lookup.

#include <cstddef>

#include "reuse/snapshot_store.h"
#include "schemas/wire.h"
#include "stages/probe/approximate_lookup.h"
#include "stages/probe/probe_metrics.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/link.h"
#include "stages/runtime/log.h"

namespace moeline::stages {

class StoreIntake {
 public:
  StoreIntake(reuse::SnapshotStore& store, ApproximateLookup& approximate, runtime::Intake& intake,
              runtime::HubLink& link, ProbeMetrics& metrics, runtime::Logger& log,
              size_t block_bytes)
      : store_(store),
        approximate_(approximate),
        intake_(intake),
        link_(link),
        metrics_(metrics),
        log_(log),
        block_bytes_(block_bytes) {}

  // A message that came to the intake (a SnapshotPut with its ticket, or refused and counted).
  void on_intake(wire::Message& message);
  // A SnapshotPut's entries, checked against their bulk frames.
  void put(const wire::Message& message);

 private:
  reuse::SnapshotStore& store_;
  ApproximateLookup& approximate_;
  runtime::Intake& intake_;
  runtime::HubLink& link_;
  ProbeMetrics& metrics_;
  runtime::Logger& log_;
  size_t block_bytes_;
};

}  // namespace moeline::stages
