// The wire decoder on any multipart message: every type, truncated, oversized, bulk frames that
// do not match their description. Whatever decodes is read field by field as a stage would.
#include <zmq.hpp>

#include "fuzz.h"
#include "schemas/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<zmq::message_t> message;
  for (std::string_view frame : moeline::fuzz::frames(data, size))
    message.emplace_back(frame.data(), frame.size());
  moeline::wire::Decoded decoded = moeline::wire::decode(std::move(message));
  if (!decoded.message) return 0;
  const moeline::wire::Message& m = *decoded.message;
  // Messages that carry bulk frames are checked against their description, as stages do.
  switch (m.type) {
    case moeline::wire::MessageType::PrefillDone:
      (void)moeline::wire::check_bulk(m.as<moeline::wire::PrefillDone>()->frames(), m.bulk);
      break;
    case moeline::wire::MessageType::PrefillJob:
      (void)moeline::wire::check_bulk(m.as<moeline::wire::PrefillJob>()->frames(), m.bulk);
      break;
    case moeline::wire::MessageType::ProbePlan:
      (void)moeline::wire::check_bulk(m.as<moeline::wire::ProbePlan>()->frames(), m.bulk);
      break;
    case moeline::wire::MessageType::SnapshotPut:
      (void)moeline::wire::check_bulk(m.as<moeline::wire::SnapshotPut>()->frames(), m.bulk);
      break;
    default:
      break;
  }
  return 0;
}
