// Writes the golden wire buffers of the current schema version (tests/compat/README.md): one file
// per message type, every field set to a fixed, non-default value, so that the compat test can
// prove that today's reader still reads these bytes. Deterministic: the same build writes the same
// bytes. Run by hand when a schema version is released, never by ctest; a released version's
// files are never rewritten (the tool refuses to overwrite without --overwrite).
//
//   moeline_make_golden <tests/compat> [--overwrite]   writes <tests/compat>/v<major>.<minor>/

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "schemas/wire.h"

namespace {

namespace wire = moeline::wire;
using flatbuffers::FlatBufferBuilder;

// 1.7: a Curve public key (Z85) and fixed byte strings (keys, tickets).
constexpr const char* kGoldenKey = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
// 1.10: a node token (stages/runtime/shared_bulk.h), in hellos and routes.
constexpr const char* kGoldenNode = "0123456789abcdef0123456789abcdef";
std::vector<uint8_t> golden_bytes(size_t n, uint8_t first) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(first + i);
  return out;
}

std::vector<zmq::message_t> hello() {
  FlatBufferBuilder b;
  // 1.7: the intake and its Curve key; 1.10: its node token.
  b.Finish(wire::CreateHelloDirect(b, wire::StageKind::Prefill, "prefill-0", 1, 0, "golden-1.0",
                                   0x0123456789abcdefULL, 4, 4242, 9102, false,
                                   "tcp://10.0.0.7:41234", kGoldenKey, kGoldenNode),
           wire::HelloIdentifier());
  return wire::encode(wire::MessageType::Hello, b);
}

std::vector<zmq::message_t> hello_reply() {
  FlatBufferBuilder b;
  const std::vector<uint8_t> key = golden_bytes(32, 0x40);  // 1.7: the hand-over key
  b.Finish(wire::CreateHelloReplyDirect(b, true, "welcome", 0xfedcba9876543210ULL, &key),
           wire::HelloIdentifier());
  return wire::encode(wire::MessageType::HelloReply, b);
}

std::vector<zmq::message_t> heartbeat() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateHeartbeatDirect(b, 1700000000123456789ULL, 3, 2, "decode-1", 120, 904),
           wire::HelloIdentifier());
  return wire::encode(wire::MessageType::Heartbeat, b);
}

std::vector<zmq::message_t> credit() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateCredit(b, 8), wire::HelloIdentifier());
  return wire::encode(wire::MessageType::Credit, b);
}

std::vector<zmq::message_t> error_reply() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateErrorReplyDirect(b, wire::ErrorCode::PromptTooLong,
                                        "prompt of 9000 tokens exceeds 8192", 77),
           wire::HelloIdentifier());
  return wire::encode(wire::MessageType::ErrorReply, b);
}

std::vector<zmq::message_t> generate_request() {
  FlatBufferBuilder b;
  const std::vector<int32_t> stop = {2, 32000};
  // 1.12: logit_bias.
  const std::vector<wire::TokenBias> bias = {{50256, -100.0f}, {7, 2.5f}};
  // 1.13: prompt_logprobs. 1.15: structured output with its schema. 1.16: after the reasoning
  // block the prompt opened. 1.18: min_tokens.
  const auto sampling = wire::CreateSamplingParamsDirect(
      b, 0.7, 40, 0.9, 1234, true, 64, &stop, true, 0.05, 0.5, -0.25, 1.1, true, 3, &bias, true,
      wire::StructuredOutput::JsonSchema,
      R"({"type":"object","properties":{"a":{"type":"integer"}}})", wire::ReasoningBlock::Open, 8);
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  // 1.11: batch_events. 1.17: special tokens kept in the text.
  b.Finish(
      wire::CreateGenerateRequestDirect(b, 1001, "Hello, world", &tokens, sampling, "acme", 30000,
                                        false, "approximate", "ml_0123abcd_secret", true, false),
      wire::GenerateRequestIdentifier());
  return wire::encode(wire::MessageType::GenerateRequest, b);
}

std::vector<zmq::message_t> cancel_request() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateCancelRequest(b, 1001), wire::GenerateRequestIdentifier());
  return wire::encode(wire::MessageType::CancelRequest, b);
}

std::vector<zmq::message_t> feedback() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateFeedbackDirect(b, 1001, -0.5f, "too long"),
           wire::GenerateRequestIdentifier());
  return wire::encode(wire::MessageType::Feedback, b);
}

// 1.6: log-probabilities, one entry with two alternatives.
flatbuffers::Offset<wire::TokenLogprobs> golden_logprobs(FlatBufferBuilder& b) {
  const std::vector<int32_t> ids = {13, 7};
  const std::vector<float> values = {-0.25f, -1.5f};
  return wire::CreateTokenLogprobsDirect(b, -0.25f, &ids, &values);
}

std::vector<zmq::message_t> stream_event() {
  FlatBufferBuilder b;
  const std::vector<flatbuffers::Offset<wire::TokenLogprobs>> logprobs = {golden_logprobs(b),
                                                                          golden_logprobs(b)};
  // 1.9: each string also typed.
  const auto usage =
      wire::CreateUsageDirect(b, 12, 5, 8, "prefix", "shadow", 0.96875f, wire::ReuseLevel::Prefix,
                              wire::ApproximateOutcome::Shadow);
  const auto timings = wire::CreateTimings(b, 1.5, 20.25, 22.0, 80.125);
  const std::vector<int32_t> token_ids = {0, 13};
  // 1.13: the prompt's ids and log-probabilities (one for each id after the first).
  const std::vector<flatbuffers::Offset<wire::TokenLogprobs>> prompt = {
      golden_logprobs(b), golden_logprobs(b), golden_logprobs(b)};
  const std::vector<int32_t> prompt_ids = {1, 15043, 29892, 3186};
  b.Finish(wire::CreateStreamEventDirect(b, 1001, 555, wire::EventKind::Finished, "!", &token_ids,
                                         "stop", usage, timings, wire::ErrorCode::Cancelled,
                                         "cancelled by the client", &logprobs,
                                         wire::FinishReason::Stop, &prompt, &prompt_ids),
           wire::GenerateRequestIdentifier());
  return wire::encode(wire::MessageType::StreamEvent, b);
}

// 1.11: two requests' events in one message.
std::vector<zmq::message_t> stream_event_batch() {
  FlatBufferBuilder b;
  const std::vector<int32_t> first = {13}, second = {7};
  const std::vector<flatbuffers::Offset<wire::StreamEvent>> events = {
      wire::CreateStreamEventDirect(b, 1001, 555, wire::EventKind::Delta, "Hi", &first),
      wire::CreateStreamEventDirect(b, 1002, 556, wire::EventKind::Delta, "!", &second),
      wire::CreateStreamEventDirect(b, 1001, 555, wire::EventKind::Finished, "", nullptr, "stop", 0,
                                    0, wire::ErrorCode::None, nullptr, nullptr,
                                    wire::FinishReason::Stop)};
  b.Finish(wire::CreateStreamEventBatchDirect(b, &events), wire::GenerateRequestIdentifier());
  return wire::encode(wire::MessageType::StreamEventBatch, b);
}

flatbuffers::Offset<wire::SamplingParams> pipeline_sampling(FlatBufferBuilder& b) {
  const std::vector<int32_t> stop = {2};
  return wire::CreateSamplingParamsDirect(b, 1.0, 50, 0.95, 7, true, 32, &stop, false);
}

// One block of one layer, keys then values, [1 head][2 tokens][4 dims] of f32: 64 bytes.
std::vector<uint8_t> kv_bytes() {
  std::vector<uint8_t> bytes(64);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  return bytes;
}

// 1.1: sampling and allowed reuse levels.
std::vector<zmq::message_t> probe_job() {
  FlatBufferBuilder b;
  const auto sampling = pipeline_sampling(b);
  const std::vector<int32_t> tokens = {1, 15043, 29892};
  // 1.7: the routes to the prefill and decode replicas, the levels to store back.
  const std::vector<uint8_t> prefill_ticket = golden_bytes(32, 0x30);
  const std::vector<uint8_t> decode_ticket = golden_bytes(32, 0x10);
  const auto prefill_route = wire::CreatePeerRouteDirect(b, "prefill-0", "tcp://10.0.0.9:41100",
                                                         kGoldenKey, &prefill_ticket, kGoldenNode);
  const auto decode_route = wire::CreatePeerRouteDirect(b, "decode-1", "tcp://10.0.0.8:41000",
                                                        kGoldenKey, &decode_ticket, kGoldenNode);
  b.Finish(wire::CreateProbeJobDirect(b, 555, 2, &tokens, "acme/ns", sampling, 5, prefill_route,
                                      decode_route, 3),
           wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::ProbeJob, b);
}

// 1.1: the prefix's KV as a bulk frame, a completion, the prefix key.
std::vector<zmq::message_t> probe_plan() {
  FlatBufferBuilder b;
  const std::vector<uint8_t> kv = kv_bytes();
  const auto layout = wire::CreateKvLayoutDirect(b, 1, 1, 4, 2, "f32", 1);
  const std::vector<flatbuffers::Offset<wire::BulkFrame>> frames = {
      wire::CreateBulkFrame(b, kv.size(), wire::checksum(kv))};
  const std::vector<int32_t> completion = {306, 2};
  const std::vector<uint8_t> mask = {1, 0, 1};
  b.Finish(wire::CreateProbePlanDirect(
               b, 555, 2, "prefix", 16, 350, &frames, layout, &completion, "stop",
               0x0badc0ffee0ddf00ULL, "blend", 0x00d0d0d0d0d0d0d0ULL, 0.9375f, 5003, &mask, 0.15f,
               "blend", true, true, wire::ReuseLevel::Prefix, wire::FinishReason::Stop,
               wire::ApproximateOutcome::Blend, wire::ShadowMode::Blend),
           wire::PrefillJobIdentifier());
  std::vector<zmq::message_t> bulk;
  bulk.emplace_back(kv.data(), kv.size());
  return wire::encode(wire::MessageType::ProbePlan, b, std::move(bulk));
}

// 1.1: reused tokens with their KV, the levels to store back, the prefix key.
std::vector<zmq::message_t> prefill_job() {
  FlatBufferBuilder b;
  const std::vector<uint8_t> kv = kv_bytes();
  const auto sampling = pipeline_sampling(b);
  // 1.4: a keys-only (MLA latent) layout.
  const auto layout = wire::CreateKvLayoutDirect(b, 1, 1, 4, 2, "f32", 1, false);
  const std::vector<flatbuffers::Offset<wire::BulkFrame>> frames = {
      wire::CreateBulkFrame(b, kv.size(), wire::checksum(kv))};
  const std::vector<int32_t> tokens = {1, 15043, 29892};
  const std::vector<uint8_t> mask = {1, 0, 1};
  // 1.7: the routes to the decode replica's and the probe's intakes.
  const std::vector<uint8_t> decode_ticket = golden_bytes(32, 0x10);
  const std::vector<uint8_t> store_ticket = golden_bytes(32, 0x20);
  const std::vector<uint8_t> prefill_ticket = golden_bytes(32, 0x30);
  const auto decode_route = wire::CreatePeerRouteDirect(b, "decode-1", "tcp://10.0.0.8:41000",
                                                        kGoldenKey, &decode_ticket, kGoldenNode);
  const auto store_route = wire::CreatePeerRouteDirect(
      b, "probe-0", "ipc:///run/moeline/probe-0.intake", "", &store_ticket, kGoldenNode);
  b.Finish(wire::CreatePrefillJobDirect(b, 555, 2, &tokens, sampling, "acme/ns", "prefix", 2,
                                        &frames, layout, 3, 0x0badc0ffee0ddf00ULL, &mask, 0.15f,
                                        true, decode_route, store_route, &prefill_ticket,
                                        wire::ReuseLevel::Prefix),
           wire::PrefillJobIdentifier());
  std::vector<zmq::message_t> bulk;
  bulk.emplace_back(kv.data(), kv.size());
  return wire::encode(wire::MessageType::PrefillJob, b, std::move(bulk));
}

// 1.1: store entries, each record one bulk frame.
std::vector<zmq::message_t> snapshot_put() {
  FlatBufferBuilder b;
  const std::vector<uint8_t> kv = kv_bytes();
  const std::vector<flatbuffers::Offset<wire::SnapshotEntry>> entries = {
      wire::CreateSnapshotEntry(b, 0x1111222233334444ULL, wire::SnapshotKind::Block)};
  const std::vector<flatbuffers::Offset<wire::BulkFrame>> frames = {
      wire::CreateBulkFrame(b, kv.size(), wire::checksum(kv))};
  const std::vector<uint8_t> ticket = golden_bytes(32, 0x20);  // 1.7: to a probe's intake
  b.Finish(wire::CreateSnapshotPutDirect(b, &entries, &frames, 555, 2, &ticket),
           wire::PrefillJobIdentifier());
  std::vector<zmq::message_t> bulk;
  bulk.emplace_back(kv.data(), kv.size());
  return wire::encode(wire::MessageType::SnapshotPut, b, std::move(bulk));
}

std::vector<zmq::message_t> prefill_done() {
  FlatBufferBuilder b;
  const std::vector<uint8_t> kv = kv_bytes();
  const auto sampling = pipeline_sampling(b);
  const auto layout = wire::CreateKvLayoutDirect(b, 1, 1, 4, 2, "f32", 1);
  const std::vector<flatbuffers::Offset<wire::BulkFrame>> frames = {
      wire::CreateBulkFrame(b, kv.size(), wire::checksum(kv))};
  const std::vector<int32_t> tokens = {1, 15043, 29892};
  const std::vector<uint8_t> ticket = golden_bytes(32, 0x10);  // 1.7: the hand-over's ticket
  // 1.13: the prompt's log-probabilities, one per token after the first.
  const std::vector<flatbuffers::Offset<wire::TokenLogprobs>> prompt = {golden_logprobs(b),
                                                                        golden_logprobs(b)};
  b.Finish(wire::CreatePrefillDoneDirect(b, 555, 2, &tokens, 306, "", sampling, "acme/ns", layout,
                                         &frames, 12345, "prefill-0", "prefix", 2, 1, true, 0.125f,
                                         true, golden_logprobs(b), &ticket, flatbuffers::nullopt,
                                         wire::ReuseLevel::Prefix, &prompt),
           wire::PrefillJobIdentifier());
  std::vector<zmq::message_t> bulk;
  bulk.emplace_back(kv.data(), kv.size());
  return wire::encode(wire::MessageType::PrefillDone, b, std::move(bulk));
}

std::vector<zmq::message_t> token_batch() {
  FlatBufferBuilder b;
  const std::vector<flatbuffers::Offset<wire::TokenUpdate>> updates = {
      wire::CreateTokenUpdateDirect(b, 555, 2, 306, "", golden_logprobs(b)),
      wire::CreateTokenUpdateDirect(b, 556, 1, 2, "stop", 0, wire::FinishReason::Stop)};
  b.Finish(wire::CreateTokenBatchDirect(b, &updates, 2, 850), wire::PrefillJobIdentifier());
  std::vector<zmq::message_t> frames = wire::encode(wire::MessageType::TokenBatch, b);
  wire::set_envelope_credits(frames, 3);  // 1.14: two finished sequences' credit, and one more
  return frames;
}

std::vector<zmq::message_t> job_failed() {
  FlatBufferBuilder b;
  b.Finish(
      wire::CreateJobFailedDirect(b, 555, 2, wire::ErrorCode::StageFailed, "decode replica died"),
      wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::JobFailed, b);
}

std::vector<zmq::message_t> cancel_job() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateCancelJob(b, 555, 3), wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::CancelJob, b);
}

std::vector<zmq::message_t> expert_plan_request() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateExpertPlanRequestDirect(b, 0x1122334455667788ULL, "decode-1"),
           wire::ExpertPlanIdentifier());
  return wire::encode(wire::MessageType::ExpertPlanRequest, b);
}

std::vector<zmq::message_t> expert_plan() {
  FlatBufferBuilder b;
  const std::vector<uint8_t> ticket = golden_bytes(32, 0x50);  // 1.8: the usage ticket
  auto usage_route = wire::CreatePeerRouteDirect(b, "offload", "tcp://10.0.0.7:41300", kGoldenKey,
                                                 &ticket, kGoldenNode);
  b.Finish(wire::CreateExpertPlanDirect(b, 0x1122334455667788ULL, false, 2, 8, uint64_t{1} << 20,
                                        "host_pool", "decode-1", "/moeline-pool-golden",
                                        uint64_t{1} << 19, 2, usage_route),
           wire::ExpertPlanIdentifier());
  return wire::encode(wire::MessageType::ExpertPlan, b);
}

std::vector<zmq::message_t> expert_usage() {
  FlatBufferBuilder b;
  const std::vector<uint64_t> counts = {5, 0, 3, 8, 2, 7, 1, 6};
  const std::vector<uint64_t> layer_tokens = {8, 8};
  const std::vector<double> confidence = {12.5, 3.25};
  const std::vector<double> router_seconds = {0.5, 0.25};
  const std::vector<uint8_t> ticket = golden_bytes(32, 0x50);  // 1.8: the usage ticket
  b.Finish(wire::CreateExpertUsageDirect(b, 2, 4, &counts, 16, "decode-1", &layer_tokens,
                                         &confidence, &router_seconds, "decode-1#a1b2c3", &ticket),
           wire::ExpertPlanIdentifier());
  return wire::encode(wire::MessageType::ExpertUsage, b);
}

std::vector<zmq::message_t> control_command() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateControlCommandDirect(b, "drain", "{\"stage\":\"decode\"}", "ml_op_key"),
           wire::ControlCommandIdentifier());
  return wire::encode(wire::MessageType::ControlCommand, b);
}

std::vector<zmq::message_t> control_reply() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateControlReplyDirect(b, true, "draining", "{\"draining\":true}"),
           wire::ControlCommandIdentifier());
  return wire::encode(wire::MessageType::ControlReply, b);
}

std::vector<zmq::message_t> handover_accepted() {
  FlatBufferBuilder b;
  b.Finish(wire::CreateHandoverAccepted(b, 42, 2), wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::HandoverAccepted, b);
}

// A switch without default: a new message type needs a golden buffer before it compiles.
std::vector<zmq::message_t> golden(wire::MessageType type) {
  switch (type) {
    case wire::MessageType::Hello:
      return hello();
    case wire::MessageType::HelloReply:
      return hello_reply();
    case wire::MessageType::Heartbeat:
      return heartbeat();
    case wire::MessageType::Credit:
      return credit();
    case wire::MessageType::ErrorReply:
      return error_reply();
    case wire::MessageType::GenerateRequest:
      return generate_request();
    case wire::MessageType::CancelRequest:
      return cancel_request();
    case wire::MessageType::Feedback:
      return feedback();
    case wire::MessageType::StreamEvent:
      return stream_event();
    case wire::MessageType::StreamEventBatch:
      return stream_event_batch();
    case wire::MessageType::ProbeJob:
      return probe_job();
    case wire::MessageType::ProbePlan:
      return probe_plan();
    case wire::MessageType::PrefillJob:
      return prefill_job();
    case wire::MessageType::PrefillDone:
      return prefill_done();
    case wire::MessageType::TokenBatch:
      return token_batch();
    case wire::MessageType::JobFailed:
      return job_failed();
    case wire::MessageType::CancelJob:
      return cancel_job();
    case wire::MessageType::SnapshotPut:
      return snapshot_put();
    case wire::MessageType::ExpertPlanRequest:
      return expert_plan_request();
    case wire::MessageType::ExpertPlan:
      return expert_plan();
    case wire::MessageType::ExpertUsage:
      return expert_usage();
    case wire::MessageType::ControlCommand:
      return control_command();
    case wire::MessageType::ControlReply:
      return control_reply();
    case wire::MessageType::HandoverAccepted:
      return handover_accepted();
  }
  return {};
}

// Each frame as a u32 little-endian length followed by its bytes.
std::string serialize(const std::vector<zmq::message_t>& frames) {
  std::string out;
  for (const zmq::message_t& frame : frames) {
    const auto size = static_cast<uint32_t>(frame.size());
    for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<char>(size >> shift));
    out.append(static_cast<const char*>(frame.data()), frame.size());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const bool overwrite = argc == 3 && std::string(argv[2]) == "--overwrite";
  if (argc != 2 && !overwrite) {
    std::fprintf(stderr, "usage: %s <tests/compat directory> [--overwrite]\n", argv[0]);
    return 2;
  }
  std::string version = "v";
  version += std::to_string(wire::kSchemaMajor);
  version += '.';
  version += std::to_string(wire::kSchemaMinor);
  const fs::path dir = fs::path(argv[1]) / version;
  fs::create_directories(dir);
  int written = 0;
  for (const wire::MessageType type : wire::EnumValuesMessageType()) {
    const fs::path path = dir / (std::string(wire::message_type_name(type)) + ".bin");
    if (fs::exists(path) && !overwrite) {
      std::fprintf(stderr, "refusing to overwrite %s (released golden buffers never change)\n",
                   path.c_str());
      return 1;
    }
    const std::string bytes = serialize(golden(type));
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!file) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
    ++written;
  }
  std::printf("wrote %d golden buffers to %s\n", written, dir.c_str());
  return 0;
}
