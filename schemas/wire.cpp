#include "schemas/wire.h"

#include <xxhash.h>

#include <cstring>
#include <stdexcept>

namespace moeline::wire {
namespace {

template <class Table>
bool verify_table(const uint8_t* data, size_t size, const char* identifier) {
  flatbuffers::Verifier::Options options;
  options.max_depth = 32;
  options.max_tables = 1'000'000;
  flatbuffers::Verifier verifier(data, size, options);
  return verifier.VerifyBuffer<Table>(identifier);
}

// The identifier of the family (schema file) that defines each type, and its verifier. A switch
// without default: adding a type to the enum without handling it here fails to compile.
bool verify_body(MessageType type, const uint8_t* data, size_t size, bool& known) {
  known = true;
  switch (type) {
    case MessageType::Hello:
      return verify_table<Hello>(data, size, HelloIdentifier());
    case MessageType::HelloReply:
      return verify_table<HelloReply>(data, size, HelloIdentifier());
    case MessageType::Heartbeat:
      return verify_table<Heartbeat>(data, size, HelloIdentifier());
    case MessageType::Credit:
      return verify_table<Credit>(data, size, HelloIdentifier());
    case MessageType::ErrorReply:
      return verify_table<ErrorReply>(data, size, HelloIdentifier());
    case MessageType::GenerateRequest:
      return verify_table<GenerateRequest>(data, size, GenerateRequestIdentifier());
    case MessageType::CancelRequest:
      return verify_table<CancelRequest>(data, size, GenerateRequestIdentifier());
    case MessageType::Feedback:
      return verify_table<Feedback>(data, size, GenerateRequestIdentifier());
    case MessageType::StreamEvent:
      return verify_table<StreamEvent>(data, size, GenerateRequestIdentifier());
    case MessageType::StreamEventBatch:
      return verify_table<StreamEventBatch>(data, size, GenerateRequestIdentifier());
    case MessageType::ProbeJob:
      return verify_table<ProbeJob>(data, size, PrefillJobIdentifier());
    case MessageType::ProbePlan:
      return verify_table<ProbePlan>(data, size, PrefillJobIdentifier());
    case MessageType::PrefillJob:
      return verify_table<PrefillJob>(data, size, PrefillJobIdentifier());
    case MessageType::PrefillDone:
      return verify_table<PrefillDone>(data, size, PrefillJobIdentifier());
    case MessageType::TokenBatch:
      return verify_table<TokenBatch>(data, size, PrefillJobIdentifier());
    case MessageType::JobFailed:
      return verify_table<JobFailed>(data, size, PrefillJobIdentifier());
    case MessageType::CancelJob:
      return verify_table<CancelJob>(data, size, PrefillJobIdentifier());
    case MessageType::SnapshotPut:
      return verify_table<SnapshotPut>(data, size, PrefillJobIdentifier());
    case MessageType::HandoverAccepted:
      return verify_table<HandoverAccepted>(data, size, PrefillJobIdentifier());
    case MessageType::ExpertPlanRequest:
      return verify_table<ExpertPlanRequest>(data, size, ExpertPlanIdentifier());
    case MessageType::ExpertPlan:
      return verify_table<ExpertPlan>(data, size, ExpertPlanIdentifier());
    case MessageType::ExpertUsage:
      return verify_table<ExpertUsage>(data, size, ExpertPlanIdentifier());
    case MessageType::ControlCommand:
      return verify_table<ControlCommand>(data, size, ControlCommandIdentifier());
    case MessageType::ControlReply:
      return verify_table<ControlReply>(data, size, ControlCommandIdentifier());
  }
  known = false;
  return false;
}

const char* identifier_of(MessageType type) {
  switch (type) {
    case MessageType::Hello:
    case MessageType::HelloReply:
    case MessageType::Heartbeat:
    case MessageType::Credit:
    case MessageType::ErrorReply:
      return HelloIdentifier();
    case MessageType::GenerateRequest:
    case MessageType::CancelRequest:
    case MessageType::Feedback:
    case MessageType::StreamEvent:
    case MessageType::StreamEventBatch:
      return GenerateRequestIdentifier();
    case MessageType::ProbeJob:
    case MessageType::ProbePlan:
    case MessageType::PrefillJob:
    case MessageType::PrefillDone:
    case MessageType::TokenBatch:
    case MessageType::JobFailed:
    case MessageType::CancelJob:
    case MessageType::SnapshotPut:
    case MessageType::HandoverAccepted:
      return PrefillJobIdentifier();
    case MessageType::ExpertPlanRequest:
    case MessageType::ExpertPlan:
    case MessageType::ExpertUsage:
      return ExpertPlanIdentifier();
    case MessageType::ControlCommand:
    case MessageType::ControlReply:
      return ControlCommandIdentifier();
  }
  return nullptr;
}

uint16_t read_u16(const uint8_t* p) {
  uint16_t value;
  std::memcpy(&value, p, 2);
  return value;
}

uint32_t read_u32(const uint8_t* p) {
  uint32_t value;
  std::memcpy(&value, p, 4);
  return value;
}

zmq::message_t make_header(MessageType type, size_t body_bytes, uint16_t major, uint16_t minor) {
  zmq::message_t header(kHeaderBytes);
  auto* p = static_cast<uint8_t*>(header.data());
  std::memcpy(p, kMagic, 4);
  const auto raw_type = static_cast<uint16_t>(type);
  const uint16_t flags = 0;
  const auto body = static_cast<uint32_t>(body_bytes);
  std::memcpy(p + 4, &major, 2);
  std::memcpy(p + 6, &minor, 2);
  std::memcpy(p + 8, &raw_type, 2);
  std::memcpy(p + 10, &flags, 2);
  std::memcpy(p + 12, &body, 4);
  return header;
}

}  // namespace

AlignedFrame::AlignedFrame(zmq::message_t&& message)
    : message_(std::move(message)), size_(message_.size()) {
  if (reinterpret_cast<uintptr_t>(message_.data()) % 8 != 0) {
    copy_.resize((size_ + 7) / 8);
    std::memcpy(copy_.data(), message_.data(), size_);
  }
}

const uint8_t* AlignedFrame::data() const {
  if (!copy_.empty()) return reinterpret_cast<const uint8_t*>(copy_.data());
  return static_cast<const uint8_t*>(message_.data());
}

std::vector<zmq::message_t> Message::release_frames() {
  std::vector<zmq::message_t> frames;
  frames.push_back(std::move(header.message()));
  frames.push_back(std::move(body.message()));
  for (AlignedFrame& frame : bulk) frames.push_back(std::move(frame.message()));
  bulk.clear();
  return frames;
}

ErrorCode error_code_for(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return ErrorCode::None;
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
      return ErrorCode::InvalidRequest;
    case StatusCode::kResourceExhausted:
      return ErrorCode::Overloaded;
    case StatusCode::kCorruption:
    case StatusCode::kIoError:
    case StatusCode::kUnavailable:
      return ErrorCode::StageFailed;
    case StatusCode::kInternal:
      return ErrorCode::Internal;
  }
  return ErrorCode::Internal;
}

const char* message_type_name(MessageType type) {
  const char* name = EnumNameMessageType(type);
  return name != nullptr && *name != '\0' ? name : "unknown";
}

const char* stage_name(StageKind stage) {
  switch (stage) {
    case StageKind::Gateway:
      return "gateway";
    case StageKind::Probe:
      return "probe";
    case StageKind::Prefill:
      return "prefill";
    case StageKind::Decode:
      return "decode";
    case StageKind::OffloadManager:
      return "offload";
    case StageKind::Client:
      return "client";
    case StageKind::LoadGenerator:
      return "load";
  }
  return "unknown";
}

Decoded decode(std::vector<zmq::message_t>&& frames, const Limits& limits) {
  Decoded out;
  auto fail = [&](const char* reason, std::string detail) {
    out.error = WireError{reason, std::move(detail)};
    return std::move(out);
  };
  if (frames.size() < 2) return fail("truncated", "a message needs a header and a body frame");
  if (frames.size() - 2 > limits.max_bulk_frames)
    return fail("oversized", std::to_string(frames.size() - 2) + " bulk frames (limit " +
                                 std::to_string(limits.max_bulk_frames) + ")");
  if (frames[0].size() != kHeaderBytes)
    return fail("truncated", "header frame has " + std::to_string(frames[0].size()) +
                                 " bytes, expected " + std::to_string(kHeaderBytes));
  const auto* h = static_cast<const uint8_t*>(frames[0].data());
  if (std::memcmp(h, kMagic, 4) != 0) return fail("bad_magic", "not a moeline message (magic)");
  const uint16_t major = read_u16(h + 4);
  const uint16_t minor = read_u16(h + 6);
  out.raw_type = read_u16(h + 8);
  const uint32_t body_bytes = read_u32(h + 12);
  // The only flag (the bulk is in shared memory) is resolved by the intake that takes it, before
  // this; any flag that reaches here is one this peer does not speak, and so is credit (the high
  // byte) anywhere but at a hub.
  const uint16_t flags = read_u16(h + 10);
  const uint32_t credits = flags >> 8;
  if ((flags & 0xff) != 0 || (credits != 0 && !limits.accepts_credits))
    return fail("flags", "envelope flags " + std::to_string(flags) + " not understood here");
  if (major != kSchemaMajor)
    return fail("version", "schema major " + std::to_string(major) + " (this build speaks " +
                               std::to_string(kSchemaMajor) + "." + std::to_string(kSchemaMinor) +
                               ")");
  if (frames[1].size() > limits.max_body_bytes)
    return fail("oversized", "body of " + std::to_string(frames[1].size()) + " bytes (limit " +
                                 std::to_string(limits.max_body_bytes) + ")");
  if (frames[1].size() != body_bytes)
    return fail("truncated", "body has " + std::to_string(frames[1].size()) +
                                 " bytes, header says " + std::to_string(body_bytes));
  size_t bulk_bytes = 0;
  for (size_t i = 2; i < frames.size(); ++i) bulk_bytes += frames[i].size();
  if (bulk_bytes > limits.max_bulk_bytes)
    return fail("oversized", std::to_string(bulk_bytes) + " bulk bytes (limit " +
                                 std::to_string(limits.max_bulk_bytes) + ")");

  Message message;
  message.type = static_cast<MessageType>(out.raw_type);
  message.minor = minor;
  message.credits = credits;
  if (credits != 0) std::memset(static_cast<uint8_t*>(frames[0].data()) + 10, 0, 2);
  message.header = AlignedFrame(std::move(frames[0]));
  message.body = AlignedFrame(std::move(frames[1]));
  bool known = false;
  const bool valid = verify_body(message.type, message.body.data(), message.body.size(), known);
  if (!known) return fail("unknown_type", "unknown message type " + std::to_string(out.raw_type));
  if (!valid)
    return fail("malformed", std::string(message_type_name(message.type)) +
                                 " body failed FlatBuffers verification");
  for (size_t i = 2; i < frames.size(); ++i) message.bulk.emplace_back(std::move(frames[i]));
  out.message = std::move(message);
  return out;
}

std::vector<zmq::message_t> encode_with_version(MessageType type,
                                                flatbuffers::FlatBufferBuilder& builder,
                                                uint16_t major, uint16_t minor) {
  // A body finished with another family's identifier would be refused by every receiver.
  if (!flatbuffers::BufferHasIdentifier(builder.GetBufferPointer(), identifier_of(type)))
    throw std::logic_error(std::string("encode: ") + message_type_name(type) +
                           " body is not finished with its family's file identifier");
  std::vector<zmq::message_t> frames;
  frames.push_back(make_header(type, builder.GetSize(), major, minor));
  frames.emplace_back(builder.GetBufferPointer(), builder.GetSize());
  return frames;
}

std::vector<zmq::message_t> encode(MessageType type, flatbuffers::FlatBufferBuilder& builder,
                                   std::vector<zmq::message_t> bulk) {
  std::vector<zmq::message_t> frames =
      encode_with_version(type, builder, kSchemaMajor, kSchemaMinor);
  for (zmq::message_t& frame : bulk) frames.push_back(std::move(frame));
  return frames;
}

void set_envelope_credits(std::vector<zmq::message_t>& frames, uint32_t credits) {
  if (frames.empty() || frames[0].size() != kHeaderBytes || credits > kMaxEnvelopeCredits)
    throw std::logic_error(
        "set_envelope_credits: not an envelope, or more than one byte of credit");
  auto* flags = static_cast<uint8_t*>(frames[0].data()) + 10;
  flags[1] = static_cast<uint8_t>(credits);  // little-endian u16: the high byte
}

bool send(zmq::socket_t& socket, std::vector<zmq::message_t>&& frames, const std::string* identity,
          bool dont_wait) {
  const zmq::send_flags base = dont_wait ? zmq::send_flags::dontwait : zmq::send_flags::none;
  try {
    if (identity != nullptr &&
        !socket.send(zmq::buffer(*identity), base | zmq::send_flags::sndmore))
      return false;
    for (size_t i = 0; i < frames.size(); ++i) {
      const bool last = i + 1 == frames.size();
      if (!socket.send(frames[i], last ? base : base | zmq::send_flags::sndmore)) return false;
    }
  } catch (const zmq::error_t&) {
    return false;
  }
  return true;
}

std::optional<std::vector<zmq::message_t>> receive(zmq::socket_t& socket, bool dont_wait) {
  std::vector<zmq::message_t> frames;
  zmq::message_t frame;
  if (!socket.recv(frame, dont_wait ? zmq::recv_flags::dontwait : zmq::recv_flags::none))
    return std::nullopt;
  bool more = frame.more();
  frames.push_back(std::move(frame));
  while (more) {
    zmq::message_t next;
    (void)socket.recv(next, zmq::recv_flags::none);
    more = next.more();
    frames.push_back(std::move(next));
  }
  return frames;
}

uint64_t checksum(std::span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::optional<std::string> check_bulk(
    const flatbuffers::Vector<flatbuffers::Offset<BulkFrame>>* frames,
    const std::vector<AlignedFrame>& bulk) {
  const size_t described = frames == nullptr ? 0 : frames->size();
  if (described != bulk.size())
    return std::to_string(bulk.size()) + " bulk frames, the body describes " +
           std::to_string(described);
  for (size_t i = 0; i < described; ++i) {
    const BulkFrame* frame = frames->Get(static_cast<flatbuffers::uoffset_t>(i));
    if (frame->bytes() != bulk[i].size())
      return "bulk frame " + std::to_string(i) + " has " + std::to_string(bulk[i].size()) +
             " bytes, expected " + std::to_string(frame->bytes());
    if (frame->xxh3() != checksum(bulk[i].bytes()))
      return "bulk frame " + std::to_string(i) + " fails its checksum";
  }
  return std::nullopt;
}

}  // namespace moeline::wire
