#pragma once
// The wire codec (schemas/README.md). A message is a ZeroMQ multipart:
//   [16-byte envelope header][FlatBuffers body][bulk frame]...
// The header carries a magic, the schema version and the message type; the body is one table of
// that type, finished with its family's file identifier. Bulk frames (KV blocks) travel as their
// own frames, never copied into the body, and are described (size, xxHash) by the body.
//
// The header, little-endian: "MOEL", u16 schema major, u16 minor, u16 message type, u16 flags,
// u32 body length. The flags' low byte is 0 but on a transfer to an intake of the same node whose
// bulk frames went through shared memory (1.10, stages/runtime/shared_bulk.h), which that intake
// resolves before decode(); decode() refuses any other. The high byte (1.14) is flow-control
// credit that a stage grants back with a message to the hub (the credit of the job it finished,
// riding on its result instead of a Credit message of its own): only a hub decodes it
// (Limits::accepts_credits), everyone else refuses it like an unknown flag.
//
// decode() checks everything before anyone reads a field of the body: frame count and sizes,
// magic, schema major, a known type, and the FlatBuffers Verifier for exactly that type. Bulk
// frames are checked against their descriptors (count, size, xxHash) by check_bulk(), which the
// receiver calls with the table that describes them. Bodies and bulk frames
// are handed out 8-byte aligned (copied once only when ZeroMQ gave an unaligned buffer).
//
// Thread-safety: free functions, no shared state.

#include <flatbuffers/flatbuffers.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>
#include <zmq.hpp>

#include "base/status.h"
#include "client_generated.h"
#include "common_generated.h"
#include "control_generated.h"
#include "offload_generated.h"
#include "pipeline_generated.h"

namespace moeline::wire {

// Additive change bumps the minor, a break the major (peers of another major are refused).
inline constexpr uint16_t kSchemaMajor = 1;
inline constexpr uint16_t kSchemaMinor = 18;
inline constexpr char kMagic[4] = {'M', 'O', 'E', 'L'};

// The values of GenerateRequest.reuse (client.fbs): "" is the tenant's exact levels. The gateway
// refuses anything else; the SDKs check before sending (the Python SDK keeps the same list, and
// its tests compare it with the CLI's message).
inline constexpr std::string_view kReuseModes[] = {"",         "exact", "none", "approximate",
                                                   "response", "blend"};
inline bool is_reuse_mode(std::string_view mode) {
  for (std::string_view known : kReuseModes)
    if (mode == known) return true;
  return false;
}
inline constexpr size_t kHeaderBytes = 16;

struct Limits {
  size_t max_body_bytes = size_t{4} << 20;
  size_t max_bulk_frames = 4096;
  size_t max_bulk_bytes = size_t{8} << 30;
  // Credits in the envelope's flags (1.14): the hub takes them, every other receiver refuses them.
  bool accepts_credits = false;
};

// The most credit one envelope carries (its flags' high byte); more goes in a Credit message.
inline constexpr uint32_t kMaxEnvelopeCredits = 255;
// The first minor whose hub takes credits in the envelope.
inline constexpr uint16_t kEnvelopeCreditsMinor = 14;

// Why a message was refused; `reason` is the metric label, `detail` the log / error text.
struct WireError {
  std::string reason;  // truncated, bad_magic, flags, version, unknown_type, oversized, malformed
  std::string detail;
};

// A frame's bytes, 8-byte aligned: the ZeroMQ message itself when it already is, else a copy.
class AlignedFrame {
 public:
  AlignedFrame() = default;
  explicit AlignedFrame(zmq::message_t&& message);
  const uint8_t* data() const;
  size_t size() const { return size_; }
  std::span<const uint8_t> bytes() const { return {data(), size_}; }
  // The original message, for forwarding without a copy.
  zmq::message_t& message() { return message_; }

 private:
  zmq::message_t message_;
  std::vector<uint64_t> copy_;
  size_t size_ = 0;
};

struct Message {
  MessageType type = MessageType::Hello;
  uint16_t minor = 0;
  // Credit granted back in the envelope (only where Limits::accepts_credits; the header's flags
  // are cleared once read, so a forwarded message does not carry them on).
  uint32_t credits = 0;
  AlignedFrame header;
  AlignedFrame body;
  std::vector<AlignedFrame> bulk;

  template <class Table>
  const Table* as() const {
    return flatbuffers::GetRoot<Table>(body.data());
  }
  // The frames again, ready to forward to another peer (bulk frames are not copied).
  std::vector<zmq::message_t> release_frames();
};

struct Decoded {
  std::optional<Message> message;
  std::optional<WireError> error;
  // The type from the header even when the body was refused (0 if the header was unreadable).
  uint16_t raw_type = 0;
};

const char* message_type_name(MessageType type);
// The wire's error for a library's Status: a caller's bad input is InvalidRequest, a budget that
// is full is Overloaded, a failure the job may survive elsewhere (I/O, corruption of what a stage
// holds, a peer away) is StageFailed, and only a broken invariant is Internal.
ErrorCode error_code_for(StatusCode code);
const char* stage_name(StageKind stage);

// `frames` excludes any routing identity.
Decoded decode(std::vector<zmq::message_t>&& frames, const Limits& limits = {});

// Finishes `builder` with the identifier of `type`'s family and frames the message.
std::vector<zmq::message_t> encode(MessageType type, flatbuffers::FlatBufferBuilder& builder,
                                   std::vector<zmq::message_t> bulk = {});
std::vector<zmq::message_t> encode_with_version(MessageType type,
                                                flatbuffers::FlatBufferBuilder& builder,
                                                uint16_t major, uint16_t minor);

// Puts `credits` (at most kMaxEnvelopeCredits) in the envelope of an encoded message for the hub.
void set_envelope_credits(std::vector<zmq::message_t>& frames, uint32_t credits);

// Sends the frames (prefixed by `identity` when given, for ROUTER sockets). False when the socket
// would block (ROUTER to a vanished peer) or is closed.
bool send(zmq::socket_t& socket, std::vector<zmq::message_t>&& frames,
          const std::string* identity = nullptr, bool dont_wait = false);
// Receives one multipart message (all frames); nullopt when nothing is waiting (non-blocking).
std::optional<std::vector<zmq::message_t>> receive(zmq::socket_t& socket, bool dont_wait);

uint64_t checksum(std::span<const uint8_t> bytes);
// Checks that bulk frames match their descriptors (count, sizes, xxHash).
std::optional<std::string> check_bulk(
    const flatbuffers::Vector<flatbuffers::Offset<BulkFrame>>* frames,
    const std::vector<AlignedFrame>& bulk);

}  // namespace moeline::wire
