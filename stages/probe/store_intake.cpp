#include "stages/probe/store_intake.h"

namespace moeline::stages {

void StoreIntake::on_intake(wire::Message& message) {
  if (message.type != wire::MessageType::SnapshotPut)
    return intake_.refuse(message.type, "not_taken_here");
  if (!runtime::has_valid_ticket(link_.handover_key(), *message.as<wire::SnapshotPut>()))
    return intake_.refuse(message.type, "bad_ticket");
  this->put(message);
}

void StoreIntake::put(const wire::Message& message) {
  const auto* put = message.as<wire::SnapshotPut>();
  if (auto bad = wire::check_bulk(put->frames(), message.bulk)) {
    log_.warn("snapshot_refused", {{"reason", *bad}});
    return;
  }
  const size_t entries = put->entries() ? put->entries()->size() : 0;
  if (entries != message.bulk.size()) {
    log_.warn("snapshot_refused", {{"reason", "entries and frames differ in number"}});
    return;
  }
  // Deepest first (entries come in chain order): the head of a chain ends up the most recent.
  for (size_t i = entries; i-- > 0;) {
    const auto* entry = put->entries()->Get(static_cast<flatbuffers::uoffset_t>(i));
    const auto bytes = message.bulk[i].bytes();
    std::string record(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    switch (wire::snapshot_kind_of(*entry)) {
      case wire::SnapshotKind::Signature:
        approximate_.put_signature(record);
        continue;
      case wire::SnapshotKind::Quality:
        approximate_.record_quality(entry->key(), record);
        continue;
      case wire::SnapshotKind::Prompt:
        approximate_.compare_first_tokens(entry->key(), record);
        break;
      case wire::SnapshotKind::Block:
        // A block must be exactly one block of this model's KV.
        if (bytes.size() != block_bytes_) continue;
        break;
      case wire::SnapshotKind::Result:
        break;
      case wire::SnapshotKind::Unknown:
        // Not a kind this probe stores: kept out of the store rather than filed under a guess.
        metrics_.refused_records->inc();
        continue;
    }
    store_.put(entry->key(), std::move(record));
    metrics_.puts->inc();
  }
}

}  // namespace moeline::stages
