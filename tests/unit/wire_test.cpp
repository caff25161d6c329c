// The wire codec (schemas/wire.h): round trips of every message family, every refusal of decode()
// with its metric label, bulk-frame descriptors, alignment, and a seeded mutation fuzz.

#include "schemas/wire.h"
#include "schemas/vocabulary.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace moeline::wire {
namespace {

using flatbuffers::FlatBufferBuilder;

std::vector<zmq::message_t> copy(const std::vector<zmq::message_t>& frames) {
  std::vector<zmq::message_t> out;
  for (const zmq::message_t& frame : frames) out.emplace_back(frame.data(), frame.size());
  return out;
}

std::vector<uint8_t> bytes_of(const zmq::message_t& frame) {
  const auto* p = static_cast<const uint8_t*>(frame.data());
  return {p, p + frame.size()};
}

// The 16-byte envelope header, written by hand from its documented layout (little-endian):
// magic[4], major u16, minor u16, type u16, flags u16, body length u32.
zmq::message_t header(uint16_t major, uint16_t minor, uint16_t type, uint32_t body_bytes) {
  std::vector<uint8_t> h = {'M', 'O', 'E', 'L'};
  for (const uint16_t v : {major, minor, type, uint16_t{0}}) {
    h.push_back(static_cast<uint8_t>(v));
    h.push_back(static_cast<uint8_t>(v >> 8));
  }
  for (int shift = 0; shift < 32; shift += 8)
    h.push_back(static_cast<uint8_t>(body_bytes >> shift));
  return zmq::message_t(h.data(), h.size());
}

std::vector<zmq::message_t> frames_of(uint16_t type, const std::vector<uint8_t>& body) {
  std::vector<zmq::message_t> frames;
  frames.push_back(header(kSchemaMajor, kSchemaMinor, type, static_cast<uint32_t>(body.size())));
  frames.emplace_back(body.data(), body.size());
  return frames;
}

std::vector<uint8_t> pattern(size_t size, uint8_t seed) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(i * 31 + seed);
  return bytes;
}

// --- one valid message of every family ---------------------------------------------------------

std::vector<zmq::message_t> make_hello() {
  FlatBufferBuilder b;
  b.Finish(CreateHelloDirect(b, StageKind::Decode, "decode-3", kSchemaMajor, kSchemaMinor,
                             "test-build", 0xabcdef0123456789ULL, 16, 31337, 8081),
           HelloIdentifier());
  return encode(MessageType::Hello, b);
}

std::vector<zmq::message_t> make_generate_request() {
  FlatBufferBuilder b;
  const std::vector<int32_t> stop = {7, 9};
  const auto sampling = CreateSamplingParamsDirect(b, 0.8, 20, 0.75, 99, true, 128, &stop, true);
  const std::vector<int32_t> tokens = {5, 6, 7};
  b.Finish(CreateGenerateRequestDirect(b, 42, "Why is the sky blue?", &tokens, sampling, "tenant-a",
                                       5000, false),
           GenerateRequestIdentifier());
  return encode(MessageType::GenerateRequest, b);
}

std::vector<zmq::message_t> make_stream_event() {
  FlatBufferBuilder b;
  const auto usage = CreateUsageDirect(b, 30, 10, 16, "prefix");
  const auto timings = CreateTimings(b, 0.25, 12.5, 13.0, 140.75);
  const std::vector<int32_t> token_ids = {101, 102};
  b.Finish(CreateStreamEventDirect(b, 42, 9000, EventKind::Finished, " blue", &token_ids, "length",
                                   usage, timings),
           GenerateRequestIdentifier());
  return encode(MessageType::StreamEvent, b);
}

// 1.11: the events of two requests of one connection, one message.
std::vector<zmq::message_t> make_stream_event_batch() {
  FlatBufferBuilder b;
  const std::vector<int32_t> first = {101}, second = {202};
  const std::vector<flatbuffers::Offset<StreamEvent>> events = {
      CreateStreamEventDirect(b, 1, 9000, EventKind::Delta, " a", &first),
      CreateStreamEventDirect(b, 2, 9001, EventKind::Delta, " b", &second),
      CreateStreamEventDirect(b, 1, 9000, EventKind::Finished, "", nullptr, "stop")};
  b.Finish(CreateStreamEventBatchDirect(b, &events), GenerateRequestIdentifier());
  return encode(MessageType::StreamEventBatch, b);
}

// A PrefillDone carrying each of `kvs` as a bulk frame, described by its size and checksum.
std::vector<zmq::message_t> make_prefill_done(const std::vector<std::vector<uint8_t>>& kvs) {
  FlatBufferBuilder b;
  const auto layout = CreateKvLayoutDirect(b, 2, 2, 8, 16, "bf16", 3);
  std::vector<flatbuffers::Offset<BulkFrame>> frames;
  for (const auto& kv : kvs) frames.push_back(CreateBulkFrame(b, kv.size(), checksum(kv)));
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  b.Finish(CreatePrefillDoneDirect(b, 9000, 1, &tokens, 77, nullptr, 0, "ns", layout, &frames, 4321,
                                   "prefill-1"),
           PrefillJobIdentifier());
  std::vector<zmq::message_t> bulk;
  for (const auto& kv : kvs) bulk.emplace_back(kv.data(), kv.size());
  return encode(MessageType::PrefillDone, b, std::move(bulk));
}

std::vector<zmq::message_t> make_prefill_done(const std::vector<uint8_t>& kv) {
  return make_prefill_done(std::vector<std::vector<uint8_t>>{kv});
}

std::vector<zmq::message_t> make_token_batch() {
  FlatBufferBuilder b;
  const std::vector<flatbuffers::Offset<TokenUpdate>> updates = {
      CreateTokenUpdateDirect(b, 1, 1, 11), CreateTokenUpdateDirect(b, 2, 3, 22, "stop"),
      CreateTokenUpdateDirect(b, 3, 1, 33, "length")};
  b.Finish(CreateTokenBatchDirect(b, &updates, 3, 1234), PrefillJobIdentifier());
  return encode(MessageType::TokenBatch, b);
}

std::vector<zmq::message_t> make_expert_usage() {
  FlatBufferBuilder b;
  const std::vector<uint64_t> counts = {1, 2, 3, 4, 5, 6};
  b.Finish(CreateExpertUsageDirect(b, 2, 3, &counts, 21, "decode-3"), ExpertPlanIdentifier());
  return encode(MessageType::ExpertUsage, b);
}

std::vector<zmq::message_t> make_control_command() {
  FlatBufferBuilder b;
  b.Finish(CreateControlCommandDirect(b, "status", "{\"verbose\":true}"),
           ControlCommandIdentifier());
  return encode(MessageType::ControlCommand, b);
}

Message decode_ok(std::vector<zmq::message_t>&& frames, const Limits& limits = {}) {
  Decoded decoded = decode(std::move(frames), limits);
  if (decoded.error) ADD_FAILURE() << decoded.error->reason << ": " << decoded.error->detail;
  if (!decoded.message) throw std::runtime_error("decode refused a valid message");
  return std::move(*decoded.message);
}

// Decodes and expects a refusal with `reason`; returns the detail text.
std::string refused(std::vector<zmq::message_t>&& frames, const std::string& reason,
                    const Limits& limits = {}, uint16_t raw_type = 0xffff) {
  Decoded decoded = decode(std::move(frames), limits);
  EXPECT_FALSE(decoded.message.has_value());
  if (!decoded.error) {
    ADD_FAILURE() << "accepted; expected refusal " << reason;
    return "";
  }
  EXPECT_EQ(decoded.error->reason, reason) << decoded.error->detail;
  EXPECT_FALSE(decoded.error->detail.empty());
  if (raw_type != 0xffff) {
    EXPECT_EQ(decoded.raw_type, raw_type);
  }
  return decoded.error->detail;
}

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 8 == 0;
}

// --- round trips -------------------------------------------------------------------------------

// A library's Status reaches a client as the wire's ErrorCode: bad input is never Internal, a full
// budget is Overloaded (the client may retry later), and only a broken invariant is Internal.
TEST(WireErrors, StatusCodesMapToTheErrorACallerActsOn) {
  EXPECT_EQ(error_code_for(StatusCode::kOk), ErrorCode::None);
  EXPECT_EQ(error_code_for(StatusCode::kInvalidArgument), ErrorCode::InvalidRequest);
  EXPECT_EQ(error_code_for(StatusCode::kNotFound), ErrorCode::InvalidRequest);
  EXPECT_EQ(error_code_for(StatusCode::kResourceExhausted), ErrorCode::Overloaded);
  EXPECT_EQ(error_code_for(StatusCode::kCorruption), ErrorCode::StageFailed);
  EXPECT_EQ(error_code_for(StatusCode::kIoError), ErrorCode::StageFailed);
  EXPECT_EQ(error_code_for(StatusCode::kUnavailable), ErrorCode::StageFailed);
  EXPECT_EQ(error_code_for(StatusCode::kInternal), ErrorCode::Internal);
  for (int code = 0; code <= static_cast<int>(StatusCode::kInternal); ++code) {
    const auto status_code = static_cast<StatusCode>(code);
    EXPECT_NE(status_code_name(status_code), "unknown") << code;
    if (status_code != StatusCode::kInternal) {
      EXPECT_NE(error_code_for(status_code), ErrorCode::Internal) << status_code_name(status_code);
    }
  }
}

TEST(WireErrors, AnErrorKeepsItsCodeThroughStatusAndStatusError) {
  const Status full(Error{"KV cache full", StatusCode::kResourceExhausted});
  EXPECT_FALSE(full.ok());
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::ok_status().code(), StatusCode::kOk);
  EXPECT_EQ(Status(Error{"bad flag"}).code(), StatusCode::kInvalidArgument);
  const StatusError thrown("truncated spill", StatusCode::kCorruption);
  EXPECT_EQ(thrown.error().code, StatusCode::kCorruption);
  EXPECT_EQ(thrown.error().message, "truncated spill");
}

TEST(WireRoundTrip, HeaderFollowsTheDocumentedLayout) {
  std::vector<zmq::message_t> frames = make_hello();
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(bytes_of(frames[0]), bytes_of(header(kSchemaMajor, kSchemaMinor, 1,
                                                 static_cast<uint32_t>(frames[1].size()))));
}

TEST(WireRoundTrip, Hello) {
  Message m = decode_ok(make_hello());
  EXPECT_EQ(m.type, MessageType::Hello);
  EXPECT_EQ(m.minor, kSchemaMinor);
  EXPECT_EQ(m.header.size(), kHeaderBytes);
  EXPECT_TRUE(m.bulk.empty());
  const Hello* t = m.as<Hello>();
  EXPECT_EQ(t->stage(), StageKind::Decode);
  EXPECT_EQ(t->replica()->str(), "decode-3");
  EXPECT_EQ(t->schema_major(), kSchemaMajor);
  EXPECT_EQ(t->schema_minor(), kSchemaMinor);
  EXPECT_EQ(t->build()->str(), "test-build");
  EXPECT_EQ(t->settings_hash(), 0xabcdef0123456789ULL);
  EXPECT_EQ(t->credits(), 16u);
  EXPECT_EQ(t->pid(), 31337u);
  EXPECT_EQ(t->http_port(), 8081);
}

TEST(WireRoundTrip, GenerateRequestWithSampling) {
  Message m = decode_ok(make_generate_request());
  EXPECT_EQ(m.type, MessageType::GenerateRequest);
  const GenerateRequest* t = m.as<GenerateRequest>();
  EXPECT_EQ(t->client_request_id(), 42u);
  EXPECT_EQ(t->prompt()->str(), "Why is the sky blue?");
  EXPECT_EQ(std::vector<int32_t>(t->tokens()->begin(), t->tokens()->end()),
            (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(t->tenant()->str(), "tenant-a");
  EXPECT_EQ(t->deadline_ms(), 5000u);
  EXPECT_FALSE(t->add_special_tokens());
  const SamplingParams* s = t->sampling();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->temperature(), 0.8);
  EXPECT_EQ(s->top_k(), 20);
  EXPECT_EQ(s->top_p(), 0.75);
  EXPECT_EQ(s->seed(), 99u);
  EXPECT_TRUE(s->has_seed());
  EXPECT_EQ(s->max_tokens(), 128);
  EXPECT_EQ(std::vector<int32_t>(s->stop_token_ids()->begin(), s->stop_token_ids()->end()),
            (std::vector<int32_t>{7, 9}));
  EXPECT_TRUE(s->ignore_eos());
}

TEST(WireRoundTrip, AbsentFieldsReadAsTheirSchemaDefaults) {
  FlatBufferBuilder b;
  b.Finish(CreateGenerateRequest(b, 1, 0, 0, CreateSamplingParams(b)), GenerateRequestIdentifier());
  Message m = decode_ok(encode(MessageType::GenerateRequest, b));
  const GenerateRequest* t = m.as<GenerateRequest>();
  EXPECT_EQ(t->prompt(), nullptr);
  EXPECT_TRUE(t->add_special_tokens());
  EXPECT_EQ(t->sampling()->top_p(), 1.0);
  EXPECT_EQ(t->sampling()->max_tokens(), 16);
  EXPECT_FALSE(t->sampling()->has_seed());
}

TEST(WireRoundTrip, StreamEventBatchKeepsEachEventInOrder) {
  Message m = decode_ok(make_stream_event_batch());
  EXPECT_EQ(m.type, MessageType::StreamEventBatch);
  const auto* events = m.as<StreamEventBatch>()->events();
  ASSERT_NE(events, nullptr);
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ(events->Get(0)->client_request_id(), 1u);
  EXPECT_EQ(events->Get(0)->token_ids()->Get(0), 101);
  EXPECT_EQ(events->Get(1)->client_request_id(), 2u);
  EXPECT_EQ(events->Get(1)->text()->str(), " b");
  EXPECT_EQ(events->Get(2)->kind(), EventKind::Finished);
  EXPECT_EQ(events->Get(2)->request_id(), 9000u);
}

TEST(WireRoundTrip, StreamEventWithUsageAndTimings) {
  Message m = decode_ok(make_stream_event());
  EXPECT_EQ(m.type, MessageType::StreamEvent);
  const StreamEvent* t = m.as<StreamEvent>();
  EXPECT_EQ(t->client_request_id(), 42u);
  EXPECT_EQ(t->request_id(), 9000u);
  EXPECT_EQ(t->kind(), EventKind::Finished);
  EXPECT_EQ(t->text()->str(), " blue");
  EXPECT_EQ(std::vector<int32_t>(t->token_ids()->begin(), t->token_ids()->end()),
            (std::vector<int32_t>{101, 102}));
  EXPECT_EQ(t->finish_reason()->str(), "length");
  EXPECT_EQ(t->error_code(), ErrorCode::None);
  EXPECT_EQ(t->error_message(), nullptr);
  ASSERT_NE(t->usage(), nullptr);
  EXPECT_EQ(t->usage()->prompt_tokens(), 30u);
  EXPECT_EQ(t->usage()->completion_tokens(), 10u);
  EXPECT_EQ(t->usage()->reused_tokens(), 16u);
  EXPECT_EQ(t->usage()->reuse_level()->str(), "prefix");
  ASSERT_NE(t->timings(), nullptr);
  EXPECT_EQ(t->timings()->queue_ms(), 0.25);
  EXPECT_EQ(t->timings()->prefill_ms(), 12.5);
  EXPECT_EQ(t->timings()->ttft_ms(), 13.0);
  EXPECT_EQ(t->timings()->total_ms(), 140.75);
}

TEST(WireRoundTrip, PrefillDoneWithKvLayoutAndABulkFrame) {
  const std::vector<uint8_t> kv = pattern(1000, 5);
  Message m = decode_ok(make_prefill_done(kv));
  EXPECT_EQ(m.type, MessageType::PrefillDone);
  const PrefillDone* t = m.as<PrefillDone>();
  EXPECT_EQ(t->request_id(), 9000u);
  EXPECT_EQ(t->attempt(), 1u);
  EXPECT_EQ(t->first_token(), 77);
  EXPECT_EQ(t->finish_reason(), nullptr);
  EXPECT_EQ(t->sampling(), nullptr);
  EXPECT_EQ(t->cache_namespace()->str(), "ns");
  EXPECT_EQ(t->prefill_us(), 4321u);
  EXPECT_EQ(t->replica()->str(), "prefill-1");
  const KvLayout* layout = t->layout();
  ASSERT_NE(layout, nullptr);
  EXPECT_EQ(layout->layers(), 2u);
  EXPECT_EQ(layout->kv_heads(), 2u);
  EXPECT_EQ(layout->head_dim(), 8u);
  EXPECT_EQ(layout->block_tokens(), 16u);
  EXPECT_EQ(layout->dtype()->str(), "bf16");
  EXPECT_EQ(layout->blocks(), 3u);
  ASSERT_EQ(t->frames()->size(), 1u);
  EXPECT_EQ(t->frames()->Get(0)->bytes(), kv.size());
  EXPECT_EQ(t->frames()->Get(0)->xxh3(), checksum(kv));
  ASSERT_EQ(m.bulk.size(), 1u);
  EXPECT_EQ(std::vector<uint8_t>(m.bulk[0].bytes().begin(), m.bulk[0].bytes().end()), kv);
  EXPECT_TRUE(aligned(m.bulk[0].data()));
  EXPECT_EQ(check_bulk(t->frames(), m.bulk), std::nullopt);
}

TEST(WireRoundTrip, ReleasedFramesDecodeAgainUnchanged) {
  const std::vector<uint8_t> kv = pattern(300, 9);
  Message first = decode_ok(make_prefill_done(kv));
  Message second = decode_ok(first.release_frames());
  EXPECT_EQ(second.type, MessageType::PrefillDone);
  EXPECT_EQ(second.as<PrefillDone>()->replica()->str(), "prefill-1");
  ASSERT_EQ(second.bulk.size(), 1u);
  EXPECT_EQ(check_bulk(second.as<PrefillDone>()->frames(), second.bulk), std::nullopt);
}

TEST(WireRoundTrip, TokenBatch) {
  Message m = decode_ok(make_token_batch());
  EXPECT_EQ(m.type, MessageType::TokenBatch);
  const TokenBatch* t = m.as<TokenBatch>();
  EXPECT_EQ(t->batch_size(), 3u);
  EXPECT_EQ(t->step_us(), 1234u);
  ASSERT_EQ(t->updates()->size(), 3u);
  EXPECT_EQ(t->updates()->Get(0)->request_id(), 1u);
  EXPECT_EQ(t->updates()->Get(0)->token(), 11);
  EXPECT_EQ(t->updates()->Get(0)->finish_reason(), nullptr);
  EXPECT_EQ(t->updates()->Get(1)->attempt(), 3u);
  EXPECT_EQ(t->updates()->Get(1)->finish_reason()->str(), "stop");
  EXPECT_EQ(t->updates()->Get(2)->token(), 33);
  EXPECT_EQ(t->updates()->Get(2)->finish_reason()->str(), "length");
}

TEST(WireRoundTrip, ExpertUsage) {
  Message m = decode_ok(make_expert_usage());
  EXPECT_EQ(m.type, MessageType::ExpertUsage);
  const ExpertUsage* t = m.as<ExpertUsage>();
  EXPECT_EQ(t->layers(), 2u);
  EXPECT_EQ(t->experts(), 3u);
  EXPECT_EQ(std::vector<uint64_t>(t->counts()->begin(), t->counts()->end()),
            (std::vector<uint64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(t->tokens(), 21u);
  EXPECT_EQ(t->replica()->str(), "decode-3");
}

TEST(WireRoundTrip, ControlCommand) {
  Message m = decode_ok(make_control_command());
  EXPECT_EQ(m.type, MessageType::ControlCommand);
  const ControlCommand* t = m.as<ControlCommand>();
  EXPECT_EQ(t->command()->str(), "status");
  EXPECT_EQ(t->arguments()->str(), "{\"verbose\":true}");
}

TEST(WireRoundTrip, NewerMinorVersionIsAcceptedAndReported) {
  FlatBufferBuilder b;
  b.Finish(CreateCredit(b, 5), HelloIdentifier());
  const uint16_t newer = kSchemaMinor + 1;
  Message m = decode_ok(encode_with_version(MessageType::Credit, b, 1, newer));
  EXPECT_EQ(m.type, MessageType::Credit);
  EXPECT_EQ(m.minor, newer);
  EXPECT_EQ(m.as<Credit>()->credits(), 5u);
}

// Schema 1.9's typed values and the strings they replace name each other, both ways.
TEST(WireVocabulary, EveryTypedValueNamesItsStringAndBack) {
  for (const ReuseLevel v : EnumValuesReuseLevel()) EXPECT_EQ(parse_reuse_level(name(v)), v);
  for (const ApproximateOutcome v : EnumValuesApproximateOutcome())
    EXPECT_EQ(parse_approximate_outcome(name(v)), v);
  for (const ShadowMode v : EnumValuesShadowMode()) EXPECT_EQ(parse_shadow_mode(name(v)), v);
  for (const FinishReason v : EnumValuesFinishReason()) EXPECT_EQ(parse_finish_reason(name(v)), v);
  EXPECT_EQ(name(ReuseLevel::Prefix), "prefix");
  EXPECT_EQ(name(ApproximateOutcome::NoCandidate), "no_candidate");
  EXPECT_EQ(name(FinishReason::Length), "length");
  EXPECT_EQ(parse_reuse_level(""), ReuseLevel::None);  // what 1.0-1.8 writers left empty
  EXPECT_EQ(parse_reuse_level("prefixes"), std::nullopt);
  EXPECT_EQ(parse_finish_reason("STOP"), std::nullopt);
}

// The typed field wins over the string; without it the string counts; a value nobody defined (a
// newer writer's, or a hostile peer's) reads as the default, never as something else.
TEST(WireVocabulary, TypedFieldsWinAndUnknownValuesReadAsTheDefault) {
  auto plan = [](std::optional<uint8_t> level, const char* text, std::optional<uint8_t> finish) {
    FlatBufferBuilder b;
    auto level_text = b.CreateString(text);
    ProbePlanBuilder p(b);
    p.add_reuse_level(level_text);
    if (level) p.add_level(static_cast<ReuseLevel>(*level));
    if (finish) p.add_finish(static_cast<FinishReason>(*finish));
    b.Finish(p.Finish(), PrefillJobIdentifier());
    return std::vector<uint8_t>(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
  };
  auto level_of = [](const std::vector<uint8_t>& bytes) {
    return reuse_level_of(*flatbuffers::GetRoot<ProbePlan>(bytes.data()));
  };
  auto finish_of = [](const std::vector<uint8_t>& bytes) {
    return finish_reason_of(*flatbuffers::GetRoot<ProbePlan>(bytes.data()));
  };
  EXPECT_EQ(level_of(plan(2, "prefix", std::nullopt)), ReuseLevel::Full);
  EXPECT_EQ(level_of(plan(std::nullopt, "prefix", std::nullopt)), ReuseLevel::Prefix);
  EXPECT_EQ(level_of(plan(std::nullopt, "something new", std::nullopt)), ReuseLevel::None);
  EXPECT_EQ(level_of(plan(200, "prefix", std::nullopt)), ReuseLevel::None);
  EXPECT_EQ(finish_of(plan(std::nullopt, "", 1)), FinishReason::Stop);
  EXPECT_EQ(finish_of(plan(std::nullopt, "", 99)), FinishReason::None);
  EXPECT_EQ(finish_of(plan(std::nullopt, "", std::nullopt)), FinishReason::None);

  FlatBufferBuilder b;
  const std::vector<flatbuffers::Offset<SnapshotEntry>> entries = {
      CreateSnapshotEntry(b, 1, SnapshotKind::Signature),
      CreateSnapshotEntry(b, 2, static_cast<SnapshotKind>('X')), CreateSnapshotEntry(b, 3)};
  b.Finish(CreateSnapshotPutDirect(b, &entries), PrefillJobIdentifier());
  const auto* put = flatbuffers::GetRoot<SnapshotPut>(b.GetBufferPointer());
  EXPECT_EQ(snapshot_kind_of(*put->entries()->Get(0)), SnapshotKind::Signature);
  EXPECT_EQ(snapshot_kind_of(*put->entries()->Get(1)), SnapshotKind::Unknown);
  EXPECT_EQ(snapshot_kind_of(*put->entries()->Get(2)), SnapshotKind::Unknown);
}

TEST(WireNames, KnownAndUnknownTypes) {
  EXPECT_STREQ(message_type_name(MessageType::PrefillDone), "PrefillDone");
  EXPECT_STREQ(message_type_name(static_cast<MessageType>(6)), "unknown");
  EXPECT_STREQ(message_type_name(static_cast<MessageType>(999)), "unknown");
  EXPECT_STREQ(stage_name(StageKind::OffloadManager), "offload");
  EXPECT_STREQ(stage_name(static_cast<StageKind>(200)), "unknown");
}

// --- refusals ----------------------------------------------------------------------------------

TEST(WireDecode, FewerThanTwoFramesIsTruncated) {
  refused({}, "truncated", {}, 0);
  std::vector<zmq::message_t> header_only = make_hello();
  header_only.pop_back();
  refused(std::move(header_only), "truncated", {}, 0);
}

TEST(WireDecode, HeaderOfTheWrongSizeIsTruncated) {
  for (const size_t size : {size_t{0}, size_t{15}, size_t{17}}) {
    std::vector<zmq::message_t> frames = make_hello();
    std::vector<uint8_t> h = bytes_of(frames[0]);
    h.resize(size);
    frames[0] = zmq::message_t(h.data(), h.size());
    refused(std::move(frames), "truncated", {}, 0);
  }
}

// The shared-memory flag is resolved by the intake that offers it (stages/runtime/shared_bulk.h);
// a flag anywhere else is one this peer does not speak, never a header to read past.
TEST(WireDecode, EnvelopeFlagsAreRefused) {
  for (const uint16_t flags : {uint16_t{1}, uint16_t{0x8000}}) {
    std::vector<zmq::message_t> frames = make_hello();
    std::memcpy(static_cast<uint8_t*>(frames[0].data()) + 10, &flags, 2);
    refused(std::move(frames), "flags");
  }
}

// 1.14: a stage's credit rides in the flags' high byte of a message to the hub. Only a hub reads
// it (a client's message, or one forwarded to another stage, must not carry credit along), and it
// is read once: the header comes out without it.
TEST(WireDecode, EnvelopeCreditIsForTheHubOnly) {
  const Limits hub{.accepts_credits = true};
  for (const uint32_t credits : {1u, 2u, kMaxEnvelopeCredits}) {
    SCOPED_TRACE(credits);
    std::vector<zmq::message_t> frames = make_token_batch();
    set_envelope_credits(frames, credits);
    EXPECT_EQ(bytes_of(frames[1]), bytes_of(make_token_batch()[1]));  // the body is untouched
    std::vector<zmq::message_t> copy;
    for (const zmq::message_t& frame : frames) copy.emplace_back(frame.data(), frame.size());
    refused(std::move(copy), "flags");
    Message m = decode_ok(std::move(frames), hub);
    EXPECT_EQ(m.credits, credits);
    EXPECT_EQ(m.as<TokenBatch>()->updates()->size(), 3u);
    const std::vector<zmq::message_t> forwarded = m.release_frames();
    EXPECT_EQ(bytes_of(forwarded[0]), bytes_of(make_token_batch()[0]));
  }
  // A message without credit reads the same either way.
  EXPECT_EQ(decode_ok(make_token_batch(), hub).credits, 0u);
  // The low byte stays a flag no reader here speaks, credit or not.
  std::vector<zmq::message_t> flagged = make_token_batch();
  const uint16_t flags = 0x0301;
  std::memcpy(static_cast<uint8_t*>(flagged[0].data()) + 10, &flags, 2);
  refused(std::move(flagged), "flags", hub);
  std::vector<zmq::message_t> frames = make_token_batch();
  EXPECT_THROW(set_envelope_credits(frames, kMaxEnvelopeCredits + 1), std::logic_error);
}

TEST(WireDecode, BadMagic) {
  std::vector<zmq::message_t> frames = make_hello();
  static_cast<uint8_t*>(frames[0].data())[0] = 'X';
  refused(std::move(frames), "bad_magic", {}, 0);
}

TEST(WireDecode, AnotherSchemaMajorIsRefused) {
  FlatBufferBuilder b;
  b.Finish(CreateCredit(b, 5), HelloIdentifier());
  refused(encode_with_version(MessageType::Credit, b, 2, 0), "version", {},
          static_cast<uint16_t>(MessageType::Credit));
  refused(encode_with_version(MessageType::Credit, b, 0, 9), "version");
}

TEST(WireDecode, BodySizeDifferentFromTheHeaderIsTruncated) {
  std::vector<zmq::message_t> longer = make_hello();
  const std::vector<uint8_t> body = bytes_of(longer[1]);
  longer[0] = header(1, 0, 1, static_cast<uint32_t>(body.size() + 1));
  refused(std::move(longer), "truncated");

  std::vector<zmq::message_t> shorter = make_hello();
  shorter[1] = zmq::message_t(body.data(), body.size() - 1);
  refused(std::move(shorter), "truncated");
}

TEST(WireDecode, BodyOverTheLimitIsOversized) {
  std::vector<zmq::message_t> frames = make_generate_request();
  const size_t body = frames[1].size();
  decode_ok(copy(frames), Limits{.max_body_bytes = body});
  refused(std::move(frames), "oversized", Limits{.max_body_bytes = body - 1});
}

TEST(WireDecode, TooManyBulkFramesIsOversized) {
  auto with_bulk = [](size_t count) {
    std::vector<zmq::message_t> frames = make_hello();
    for (size_t i = 0; i < count; ++i) frames.emplace_back(size_t{8});
    return frames;
  };
  EXPECT_EQ(decode_ok(with_bulk(2), Limits{.max_bulk_frames = 2}).bulk.size(), 2u);
  refused(with_bulk(3), "oversized", Limits{.max_bulk_frames = 2});
  refused(with_bulk(5000), "oversized");  // the default limit: 4096
}

TEST(WireDecode, TooManyBulkBytesIsOversized) {
  std::vector<zmq::message_t> frames = make_hello();
  frames.emplace_back(size_t{6});
  frames.emplace_back(size_t{5});
  refused(std::move(frames), "oversized", Limits{.max_bulk_bytes = 10});
}

TEST(WireDecode, UnknownTypeNumber) {
  const std::vector<uint8_t> body = bytes_of(make_hello()[1]);
  for (const uint16_t type : {uint16_t{999}, uint16_t{0}, uint16_t{6}, uint16_t{42}})
    refused(frames_of(type, body), "unknown_type", {}, type);
}

TEST(WireDecode, RandomBytesForAKnownTypeAreMalformed) {
  std::mt19937 rng(7);
  for (const uint16_t type :
       {uint16_t{1}, uint16_t{10}, uint16_t{13}, uint16_t{23}, uint16_t{41}}) {
    for (const size_t size : {size_t{0}, size_t{3}, size_t{8}, size_t{64}, size_t{1000}}) {
      std::vector<uint8_t> body(size);
      for (uint8_t& byte : body) byte = static_cast<uint8_t>(rng());
      refused(frames_of(type, body), "malformed", {}, type);
    }
  }
}

TEST(WireDecode, BodyFinishedWithAnotherFamilysIdentifierIsMalformed) {
  FlatBufferBuilder b;
  b.Finish(CreateHelloDirect(b, StageKind::Probe, "probe-0"), GenerateRequestIdentifier());
  const std::vector<uint8_t> body(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
  refused(frames_of(static_cast<uint16_t>(MessageType::Hello), body), "malformed");
  // The same table under its own family's identifier is fine: only the identifier differs.
  FlatBufferBuilder good;
  good.Finish(CreateHelloDirect(good, StageKind::Probe, "probe-0"), HelloIdentifier());
  const std::vector<uint8_t> good_body(good.GetBufferPointer(),
                                       good.GetBufferPointer() + good.GetSize());
  decode_ok(frames_of(static_cast<uint16_t>(MessageType::Hello), good_body));
}

TEST(WireEncode, WrongIdentifierIsALogicError) {
  FlatBufferBuilder b;
  b.Finish(CreateCredit(b, 1), PrefillJobIdentifier());
  EXPECT_THROW(encode(MessageType::Credit, b), std::logic_error);
  EXPECT_THROW(encode_with_version(MessageType::Credit, b, 1, 0), std::logic_error);
  FlatBufferBuilder none;
  none.Finish(CreateCredit(none, 1));
  EXPECT_THROW(encode(MessageType::Credit, none), std::logic_error);
}

// --- bulk descriptors --------------------------------------------------------------------------

TEST(WireBulk, CheckBulkCatchesCountSizeAndChecksumMismatches) {
  const std::vector<uint8_t> kv = pattern(256, 1);
  {
    Message m = decode_ok(make_prefill_done(kv));
    m.bulk.clear();
    const auto error = check_bulk(m.as<PrefillDone>()->frames(), m.bulk);
    ASSERT_TRUE(error.has_value());
    EXPECT_NE(error->find("describes 1"), std::string::npos) << *error;
  }
  {
    std::vector<zmq::message_t> frames = make_prefill_done(kv);
    frames.emplace_back(kv.data(), kv.size());
    Message m = decode_ok(std::move(frames));
    EXPECT_TRUE(check_bulk(m.as<PrefillDone>()->frames(), m.bulk).has_value());
  }
  {
    std::vector<zmq::message_t> frames = make_prefill_done(kv);
    frames[2] = zmq::message_t(kv.data(), kv.size() - 1);
    Message m = decode_ok(std::move(frames));
    const auto error = check_bulk(m.as<PrefillDone>()->frames(), m.bulk);
    ASSERT_TRUE(error.has_value());
    EXPECT_NE(error->find("bytes"), std::string::npos) << *error;
  }
  {
    std::vector<zmq::message_t> frames = make_prefill_done(kv);
    static_cast<uint8_t*>(frames[2].data())[100] ^= 0x01;
    Message m = decode_ok(std::move(frames));
    const auto error = check_bulk(m.as<PrefillDone>()->frames(), m.bulk);
    ASSERT_TRUE(error.has_value());
    EXPECT_NE(error->find("checksum"), std::string::npos) << *error;
  }
  // A message without descriptors and without bulk frames is consistent.
  EXPECT_EQ(check_bulk(nullptr, {}), std::nullopt);
  std::vector<AlignedFrame> stray;
  stray.emplace_back(zmq::message_t(size_t{4}));
  EXPECT_TRUE(check_bulk(nullptr, stray).has_value());
}

TEST(WireBulk, EveryFrameOfSeveralIsChecked) {
  // Three KV blocks: the last one damaged, or the middle one cut short, is named; none of them is
  // taken on the strength of the first.
  const std::vector<std::vector<uint8_t>> kvs = {pattern(128, 1), pattern(192, 2), pattern(64, 3)};
  const Message whole = decode_ok(make_prefill_done(kvs));
  EXPECT_EQ(check_bulk(whole.as<PrefillDone>()->frames(), whole.bulk), std::nullopt);
  {
    std::vector<zmq::message_t> frames = make_prefill_done(kvs);
    static_cast<uint8_t*>(frames[4].data())[10] ^= 0x01;  // header, body, then the bulk frames
    Message m = decode_ok(std::move(frames));
    const auto error = check_bulk(m.as<PrefillDone>()->frames(), m.bulk);
    ASSERT_TRUE(error.has_value());
    EXPECT_NE(error->find("bulk frame 2 fails its checksum"), std::string::npos) << *error;
  }
  {
    std::vector<zmq::message_t> frames = make_prefill_done(kvs);
    frames[3] = zmq::message_t(kvs[1].data(), kvs[1].size() - 1);
    Message m = decode_ok(std::move(frames));
    const auto error = check_bulk(m.as<PrefillDone>()->frames(), m.bulk);
    ASSERT_TRUE(error.has_value());
    EXPECT_NE(error->find("bulk frame 1 has"), std::string::npos) << *error;
  }
}

TEST(WireBulk, ChecksumIsXxh3OfTheBytes) {
  const std::vector<uint8_t> a = pattern(100, 0);
  std::vector<uint8_t> b = a;
  EXPECT_EQ(checksum(a), checksum(b));
  b[50] ^= 0x80;
  EXPECT_NE(checksum(a), checksum(b));
  // XXH3_64bits of the empty input (the reference value from xxHash).
  EXPECT_EQ(checksum({}), 0x2D06800538D394C2ULL);
}

// --- alignment ---------------------------------------------------------------------------------

TEST(WireAlignment, AlignedFramesAreEightByteAligned) {
  // Storage of uint64_t is 8-aligned; one byte in, it is not.
  std::vector<uint64_t> storage(64);
  auto* unaligned = reinterpret_cast<uint8_t*>(storage.data()) + 1;
  for (size_t i = 0; i < 200; ++i) unaligned[i] = static_cast<uint8_t>(i);
  for (const size_t size : {size_t{1}, size_t{13}, size_t{64}, size_t{200}}) {
    // No free function: ZeroMQ points at our bytes instead of copying them (a constant message).
    AlignedFrame frame(zmq::message_t(unaligned, size, nullptr));
    ASSERT_FALSE(aligned(frame.message().data()));
    EXPECT_TRUE(aligned(frame.data()));
    ASSERT_EQ(frame.size(), size);
    EXPECT_EQ(std::memcmp(frame.data(), unaligned, size), 0);
  }
  // An already aligned message is used in place, not copied.
  zmq::message_t heap(size_t{100});
  ASSERT_TRUE(aligned(heap.data()));
  const void* where = heap.data();
  AlignedFrame frame(std::move(heap));
  EXPECT_EQ(static_cast<const void*>(frame.data()), where);
}

TEST(WireAlignment, UnalignedBodyAndBulkFramesDecodeAligned) {
  const std::vector<uint8_t> kv = pattern(128, 3);
  std::vector<zmq::message_t> frames = make_prefill_done(kv);
  const std::vector<uint8_t> body = bytes_of(frames[1]);
  std::vector<uint64_t> body_storage(body.size() / 8 + 2);
  std::vector<uint64_t> kv_storage(kv.size() / 8 + 2);
  auto* body_at = reinterpret_cast<uint8_t*>(body_storage.data()) + 4;
  auto* kv_at = reinterpret_cast<uint8_t*>(kv_storage.data()) + 3;
  std::memcpy(body_at, body.data(), body.size());
  std::memcpy(kv_at, kv.data(), kv.size());
  frames[1] = zmq::message_t(body_at, body.size(), nullptr);
  frames[2] = zmq::message_t(kv_at, kv.size(), nullptr);
  Message m = decode_ok(std::move(frames));
  EXPECT_TRUE(aligned(m.body.data()));
  ASSERT_EQ(m.bulk.size(), 1u);
  EXPECT_TRUE(aligned(m.bulk[0].data()));
  EXPECT_EQ(m.as<PrefillDone>()->replica()->str(), "prefill-1");
  EXPECT_EQ(check_bulk(m.as<PrefillDone>()->frames(), m.bulk), std::nullopt);
}

// --- fuzz --------------------------------------------------------------------------------------

// Reads every string, vector and nested table of a verified message: safe only if the Verifier
// did its job. Returns a value so that nothing is optimised away.
size_t touch(const Message& m) {
  size_t n = 0;
  auto s = [&](const flatbuffers::String* v) { n += v == nullptr ? 0 : v->str().size(); };
  auto vec = [&](const auto* v) {
    if (v != nullptr)
      for (const auto x : *v) n += static_cast<size_t>(x);
  };
  auto sampling = [&](const SamplingParams* p) {
    if (p != nullptr) vec(p->stop_token_ids());
  };
  auto stream_event = [&](const StreamEvent* t) {
    s(t->text());
    vec(t->token_ids());
    s(t->finish_reason());
    s(t->error_message());
    if (t->usage() != nullptr) s(t->usage()->reuse_level());
    if (t->timings() != nullptr) n += static_cast<size_t>(t->timings()->total_ms() > 0);
  };
  switch (m.type) {
    case MessageType::Hello:
      s(m.as<Hello>()->replica());
      s(m.as<Hello>()->build());
      break;
    case MessageType::HelloReply:
      s(m.as<HelloReply>()->reason());
      break;
    case MessageType::Heartbeat:
      s(m.as<Heartbeat>()->peer());
      break;
    case MessageType::Credit:
      n += m.as<Credit>()->credits();
      break;
    case MessageType::ErrorReply:
      s(m.as<ErrorReply>()->message());
      break;
    case MessageType::GenerateRequest: {
      const auto* t = m.as<GenerateRequest>();
      s(t->prompt());
      s(t->tenant());
      vec(t->tokens());
      sampling(t->sampling());
      break;
    }
    case MessageType::CancelRequest:
      n += m.as<CancelRequest>()->client_request_id();
      break;
    case MessageType::Feedback:
      s(m.as<Feedback>()->comment());
      break;
    case MessageType::StreamEvent:
      stream_event(m.as<StreamEvent>());
      break;
    case MessageType::StreamEventBatch:
      if (const auto* events = m.as<StreamEventBatch>()->events(); events != nullptr)
        for (const StreamEvent* t : *events) stream_event(t);
      break;
    case MessageType::ProbeJob:
      vec(m.as<ProbeJob>()->tokens());
      s(m.as<ProbeJob>()->cache_namespace());
      break;
    case MessageType::ProbePlan:
      s(m.as<ProbePlan>()->reuse_level());
      break;
    case MessageType::PrefillJob: {
      const auto* t = m.as<PrefillJob>();
      vec(t->tokens());
      sampling(t->sampling());
      s(t->cache_namespace());
      s(t->reuse_level());
      for (const PeerRoute* route : {t->decode_route(), t->store_route()})
        if (route != nullptr) {
          s(route->endpoint());
          s(route->server_key());
          vec(route->ticket());
        }
      break;
    }
    case MessageType::HandoverAccepted:
      n += m.as<HandoverAccepted>()->request_id();
      break;
    case MessageType::PrefillDone: {
      const auto* t = m.as<PrefillDone>();
      vec(t->tokens());
      s(t->finish_reason());
      sampling(t->sampling());
      s(t->cache_namespace());
      s(t->replica());
      if (t->layout() != nullptr) s(t->layout()->dtype());
      if (t->frames() != nullptr)
        for (const BulkFrame* f : *t->frames()) n += f->bytes() + f->xxh3();
      n += check_bulk(t->frames(), m.bulk).has_value();
      break;
    }
    case MessageType::TokenBatch:
      if (m.as<TokenBatch>()->updates() != nullptr)
        for (const TokenUpdate* u : *m.as<TokenBatch>()->updates()) s(u->finish_reason());
      break;
    case MessageType::JobFailed:
      s(m.as<JobFailed>()->message());
      break;
    case MessageType::CancelJob:
      n += m.as<CancelJob>()->attempt();
      break;
    case MessageType::SnapshotPut: {
      const auto* t = m.as<SnapshotPut>();
      if (t->entries())
        for (const SnapshotEntry* entry : *t->entries())
          n += entry->key() + static_cast<uint64_t>(entry->kind());
      if (t->frames())
        for (const BulkFrame* frame : *t->frames()) n += frame->bytes();
      break;
    }
    case MessageType::ExpertPlanRequest:
      s(m.as<ExpertPlanRequest>()->replica());
      break;
    case MessageType::ExpertPlan:
      s(m.as<ExpertPlan>()->tier());
      s(m.as<ExpertPlan>()->requester());
      break;
    case MessageType::ExpertUsage:
      vec(m.as<ExpertUsage>()->counts());
      s(m.as<ExpertUsage>()->replica());
      break;
    case MessageType::ControlCommand:
      s(m.as<ControlCommand>()->command());
      s(m.as<ControlCommand>()->arguments());
      break;
    case MessageType::ControlReply:
      s(m.as<ControlReply>()->message());
      s(m.as<ControlReply>()->json());
      break;
  }
  return n;
}

TEST(WireFuzz, MutatedBodiesNeverCrashDecode) {
  std::vector<std::vector<zmq::message_t>> corpus;
  corpus.push_back(make_hello());
  corpus.push_back(make_generate_request());
  corpus.push_back(make_stream_event());
  corpus.push_back(make_stream_event_batch());
  corpus.push_back(make_prefill_done(pattern(96, 2)));
  corpus.push_back(make_token_batch());
  corpus.push_back(make_expert_usage());
  corpus.push_back(make_control_command());
  const std::vector<uint16_t> known_types = {1,  2,  3,  4,  5,  10, 11, 12, 13, 14, 20,
                                             21, 22, 23, 24, 25, 26, 30, 31, 32, 40, 41};

  std::mt19937_64 rng(20240601);
  auto below = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::map<std::string, int> outcomes;
  size_t touched = 0;
  for (int iteration = 0; iteration < 2000; ++iteration) {
    const std::vector<zmq::message_t>& base = corpus[below(corpus.size())];
    std::vector<uint8_t> body = bytes_of(base[1]);
    uint16_t type = static_cast<const uint8_t*>(base[0].data())[8];
    const size_t mutations = 1 + below(4);
    for (size_t i = 0; i < mutations; ++i) {
      switch (below(4)) {
        case 0:  // flip one bit
          if (!body.empty()) body[below(body.size())] ^= static_cast<uint8_t>(1u << below(8));
          break;
        case 1:  // overwrite one byte
          if (!body.empty()) body[below(body.size())] = static_cast<uint8_t>(rng());
          break;
        case 2:  // truncate
          body.resize(below(body.size() + 1));
          break;
        case 3:  // extend with random bytes
          for (size_t k = 1 + below(16); k > 0; --k) body.push_back(static_cast<uint8_t>(rng()));
          break;
      }
    }
    // Sometimes claim another known type for the body, to verify it against the wrong table.
    if (below(5) == 0) type = known_types[below(known_types.size())];
    std::vector<zmq::message_t> frames = frames_of(type, body);
    // Mostly keep the header's length honest, so that the Verifier (not the length check) is
    // what stands between the mutation and the reader.
    if (below(10) == 0)
      frames[0] = header(1, 0, type, static_cast<uint32_t>(bytes_of(base[1]).size()));
    for (size_t i = 2; i < base.size(); ++i) frames.emplace_back(base[i].data(), base[i].size());

    Decoded decoded = decode(std::move(frames));
    ASSERT_NE(decoded.message.has_value(), decoded.error.has_value());
    if (decoded.message) {
      touched += touch(*decoded.message);
      ++outcomes["accepted"];
    } else {
      ++outcomes[decoded.error->reason];
    }
  }
  // Both paths were exercised: mutations the Verifier refused, and ones it let through to a reader.
  EXPECT_GT(outcomes["malformed"], 100);
  EXPECT_GT(outcomes["accepted"], 50);
  EXPECT_GT(outcomes["truncated"], 0);
  EXPECT_GT(touched, 0u);
  int total = 0;
  for (const auto& [reason, count] : outcomes) {
    EXPECT_TRUE(reason == "accepted" || reason == "malformed" || reason == "truncated") << reason;
    total += count;
    RecordProperty(reason, count);
  }
  EXPECT_EQ(total, 2000);
}

}  // namespace
}  // namespace moeline::wire
