#include "stages/prefill/results.h"

#include <algorithm>

#include "model/generator.h"
#include "model/sampling.h"
#include "reuse/approximate.h"
#include "reuse/records.h"
#include "schemas/vocabulary.h"
#include "stages/common/common.h"

namespace moeline::stages::prefill {
namespace {

// A ZeroMQ message over part of a shared buffer; the buffer lives until its last view is sent.
zmq::message_t view(const std::shared_ptr<std::vector<uint8_t>>& buffer, size_t offset,
                    size_t bytes) {
  auto* keep = new std::shared_ptr<std::vector<uint8_t>>(buffer);
  return zmq::message_t(
      buffer->data() + offset, bytes,
      [](void*, void* hint) { delete static_cast<std::shared_ptr<std::vector<uint8_t>>*>(hint); },
      keep);
}

}  // namespace

bool JobResults::deliver(const Job& job, const PrefillResult& result,
                         const std::shared_ptr<std::vector<uint8_t>>& exported) {
  const bool goes_on = result.finish.empty();
  if (!goes_on || job.decode_route.empty()) {
    worker_.link->send(prefill_done(job, result, goes_on ? exported : nullptr, nullptr));
    return true;
  }
  worker_.link->send(prefill_done(job, result, nullptr, nullptr));
  if (worker_.peers->send(job.decode_route.to,
                          prefill_done(job, result, exported, &job.decode_route.ticket)))
    return true;
  metrics_.handover_failures->inc();
  fail(job, wire::ErrorCode::StageFailed,
       "decode replica " + job.decode_route.replica + " did not take the hand-over at " +
           job.decode_route.to.endpoint);
  return false;
}

void JobResults::fail(const Job& job, wire::ErrorCode code, const std::string& text) {
  send_job_failed(*worker_.link, job.request_id, job.attempt, code, text);
  metrics_.outcome(Outcome::kFailed).inc();
  worker_.service.log.warn("job_failed", {{"request_id", job.request_id}, {"reason", text}});
}

std::vector<zmq::message_t> JobResults::prefill_done(
    const Job& job, const PrefillResult& result,
    const std::shared_ptr<std::vector<uint8_t>>& exported, const std::vector<uint8_t>* ticket) {
  const model::ModelConfig& cfg = worker_.model->config();
  const size_t blocks = (job.tokens.size() + model::kBlockTokens - 1) / model::kBlockTokens;
  flatbuffers::FlatBufferBuilder builder(1024);
  std::vector<zmq::message_t> bulk;
  flatbuffers::Offset<wire::KvLayout> layout = 0;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
  if (exported) {
    zmq::message_t kv = view(exported, 0, blocks * worker_.forward->kv_block_bytes());
    const uint64_t sum = wire::checksum({static_cast<const uint8_t*>(kv.data()), kv.size()});
    std::vector<flatbuffers::Offset<wire::BulkFrame>> described = {
        wire::CreateBulkFrame(builder, kv.size(), sum)};
    frames = builder.CreateVector(described);
    layout = kv_layout(builder, cfg, blocks);
    bulk.push_back(std::move(kv));
  }
  // The prompt goes only with its KV: the gateway has it already.
  auto tokens = exported ? builder.CreateVector(job.tokens) : 0;
  const wire::FinishReason finish =
      wire::parse_finish_reason(result.finish).value_or(wire::FinishReason::Stop);
  auto finish_text = builder.CreateString(result.finish);
  auto sampling = to_wire(builder, job.sampling);
  auto name_space = builder.CreateString(job.cache_namespace);
  auto replica = builder.CreateString(worker_.service.log.replica());
  // What this prefill reused, which the gateway reports (it may be less than the plan offered).
  const wire::ReuseLevel level = job.blend        ? wire::ReuseLevel::Blend
                                 : job.reused > 0 ? wire::ReuseLevel::Prefix
                                                  : wire::ReuseLevel::None;
  auto level_text = builder.CreateString(wire::name(level));
  const bool checked = !job.blend_logits.empty();
  const double kl = checked
                        ? reuse::softmax_kl({result.logits, static_cast<size_t>(cfg.vocab_size)},
                                            job.blend_logits)
                        : 0.0;
  const bool top1 = checked && model::argmax(result.logits, cfg.vocab_size) ==
                                   model::argmax(job.blend_logits.data(), cfg.vocab_size);
  const auto reused = static_cast<uint32_t>(
      job.blend ? static_cast<int64_t>(job.tokens.size()) - job.recomputed : job.reused);
  auto logprobs =
      logprobs_to_wire(builder, result.logits, cfg.vocab_size, result.first, job.sampling);
  auto signed_ticket = ticket ? builder.CreateVector(*ticket) : 0;
  // The prompt's log-probabilities go to the gateway (which streams them), not to decode.
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::TokenLogprobs>>> prompt = 0;
  if (result.prompt_logprobs != nullptr && ticket == nullptr) {
    std::vector<flatbuffers::Offset<wire::TokenLogprobs>> entries;
    entries.reserve(result.prompt_logprobs->size());
    for (const model::TokenLogprobs& entry : *result.prompt_logprobs)
      entries.push_back(logprobs_to_wire(builder, entry));
    prompt = builder.CreateVector(entries);
  }
  builder.Finish(
      wire::CreatePrefillDone(
          builder, job.request_id, job.attempt, tokens, result.first, finish_text, sampling,
          name_space, layout, frames, static_cast<uint64_t>(result.forward_seconds * 1e6), replica,
          level_text, reused, static_cast<uint32_t>(job.blend ? job.recomputed : 0), checked,
          static_cast<float>(kl), top1, logprobs, signed_ticket,
          finish == wire::FinishReason::None ? flatbuffers::Optional<wire::FinishReason>() : finish,
          level, prompt),
      wire::PrefillJobIdentifier());
  return wire::encode(wire::MessageType::PrefillDone, builder, std::move(bulk));
}

void JobResults::put_snapshots(const Job& job, uint64_t sequence_id,
                               const std::shared_ptr<std::vector<uint8_t>>& exported,
                               const float* logits) {
  if (job.store_levels == 0) return;
  const size_t block_bytes = worker_.forward->kv_block_bytes();
  const uint64_t model_id = reuse_model_key(worker_.model->model_id());
  const uint64_t ns = model::namespace_id(job.cache_namespace);
  const std::vector<uint64_t> chain = reuse::block_chain(job.tokens, model_id, ns);
  flatbuffers::FlatBufferBuilder builder(1024);
  std::vector<flatbuffers::Offset<wire::SnapshotEntry>> entries;
  std::vector<flatbuffers::Offset<wire::BulkFrame>> frames;
  std::vector<zmq::message_t> bulk;
  auto add = [&](uint64_t key, wire::SnapshotKind kind, zmq::message_t frame) {
    entries.push_back(wire::CreateSnapshotEntry(builder, key, kind));
    frames.push_back(wire::CreateBulkFrame(
        builder, frame.size(),
        wire::checksum({static_cast<const uint8_t*>(frame.data()), frame.size()})));
    bulk.push_back(std::move(frame));
  };
  if (job.store_levels & reuse::kPrefix) {
    for (size_t b = job.reused / model::kBlockTokens; b < chain.size(); ++b)
      add(reuse::block_entry(chain[b]), wire::SnapshotKind::Block,
          view(exported, b * block_bytes, block_bytes));
  }
  if (job.store_levels & reuse::kFull) {
    reuse::PromptRecord record;
    record.logits.assign(logits, logits + worker_.model->config().vocab_size);
    if (job.tokens.size() % model::kBlockTokens != 0) {
      const auto* tail = exported->data() + chain.size() * block_bytes;
      record.tail_kv.assign(reinterpret_cast<const char*>(tail), block_bytes);
    }
    const std::string bytes = reuse::encode(record);
    add(reuse::prompt_entry(reuse::prompt_key(job.tokens, chain, model_id, ns)),
        wire::SnapshotKind::Prompt, zmq::message_t(bytes.data(), bytes.size()));
  }
  if (job.store_levels & reuse::kApproximateLevels) {
    // The prompt's activation signature (the probe's index), pooled over what this prefill
    // computed: the same function the probe applies at lookup.
    reuse::SignatureRecord record;
    record.cache_namespace = job.cache_namespace;
    record.tokens = job.tokens;
    record.signature = signatures_.signature(sequence_id);
    record.expert_sets = signatures_.expert_sets(sequence_id);
    for (const auto& [block, sums] : signatures_.block_sums(sequence_id))
      if (std::all_of(sums.tokens.begin(), sums.tokens.end(),
                      [](int64_t n) { return n == model::kBlockTokens; }))
        record.block_sums.emplace_back(static_cast<uint32_t>(block), sums);
    if (!record.signature.empty()) {
      const std::string bytes = reuse::encode(record);
      add(reuse::signature_entry(reuse::prompt_key(job.tokens, chain, model_id, ns)),
          wire::SnapshotKind::Signature, zmq::message_t(bytes.data(), bytes.size()));
    }
  }
  if (entries.empty()) return;
  const Route& store = job.store_route;
  builder.Finish(wire::CreateSnapshotPut(builder, builder.CreateVector(entries),
                                         builder.CreateVector(frames), job.request_id, job.attempt,
                                         store.empty() ? 0 : builder.CreateVector(store.ticket)),
                 wire::PrefillJobIdentifier());
  std::vector<zmq::message_t> put =
      wire::encode(wire::MessageType::SnapshotPut, builder, std::move(bulk));
  // Straight to the probe that owns the namespace; a hub without routes (`moeline load`, an
  // older gateway) takes them itself. A put that cannot go is lost as cache, nothing more.
  if (!store.empty()) {
    if (!worker_.peers->send(store.to, std::move(put))) metrics_.puts_dropped->inc();
  } else if (job.decode_route.empty()) {
    worker_.link->send(std::move(put));
  }
}

}  // namespace moeline::stages::prefill
