#include "stages/decode/decode.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>

#include "model/generator.h"
#include "model/sampling.h"
#include "schemas/vocabulary.h"
#include "stages/common/common.h"
#include "stages/common/worker.h"
#include "stages/decode/decode_metrics.h"
#include "stages/decode/decode_settings.h"
#include "stages/decode/stream.h"
#include "stages/runtime/dispatch.h"

namespace moeline::stages::decode {
namespace {

class DecodeStage {
 public:
  explicit DecodeStage(const runtime::Config& config)
      : settings_(DecodeSettings::from(config)),
        worker_(config, "decode", wire::StageKind::Decode),
        drain_(config),
        metrics_(worker_.service.metrics) {
    const model::ModelConfig& cfg = worker_.model->config();
    context_ = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
    int64_t blocks = settings_.kv_blocks;
    if (blocks <= 0) {
      // Every slot can hold a sequence as long as the context, within the memory budget.
      const int64_t per_sequence = (context_ + model::kBlockTokens - 1) / model::kBlockTokens;
      const uint64_t budget = settings_.kv_bytes;
      const auto block_bytes = model::KvCache::bytes_per_token(cfg) * model::kBlockTokens;
      blocks = std::min<int64_t>(per_sequence * settings_.max_batch,
                                 static_cast<int64_t>(budget / block_bytes));
      blocks = std::max<int64_t>(blocks, per_sequence);
    }
    worker_.create_engine(static_cast<int32_t>(blocks));
    worker_.open_intake(config);
    for (int64_t eos : cfg.eos_token_ids) eos_.push_back(static_cast<int32_t>(eos));
  }

  int run() {
    auto& log = worker_.service.log;
    log.info("started", {{"max_batch", settings_.max_batch},
                         {"kv_blocks", worker_.forward->blocks().capacity()}});
    while (!runtime::StageService::stop_requested()) {
      worker_.service.tick();
      if (!worker_.maintain()) {
        log.error("exiting", {{"reason", worker_.exit_reason()}});
        return 3;
      }
      // Step boundary: take everything that arrived, admit what fits, run one step.
      const bool busy = !active_streams_.empty();
      bool first = true;
      while (auto message =
                 worker_.link->receive(first && !busy ? 50 : 0, &worker_.intake->socket())) {
        worker_.service.guard("decode", [&] { dispatch(*message); });
        first = false;
      }
      while (auto handover = worker_.intake->receive())
        worker_.service.guard("decode", [&] { on_handover(*handover); });
      // Draining: what was handed over before the hub knew still joins and runs. Past the grace
      // period what is held goes back to be decoded elsewhere, and so does whatever still
      // arrives. Either way the stage leaves only once it has held nothing for a moment, so a
      // hand-over already on its way is handed back rather than lost (which would cost the
      // request one of its retries).
      const bool draining = drain_.active(*worker_.link, log);
      if (draining && drain_.expired()) give_back_everything();
      admit();
      if (!active_streams_.empty()) step();
      update_gauges();
      if (draining && (drain_.idle(held() == 0) || drain_.overdue())) {
        log.info("drained", {{"handed_back", metrics_.handed_back->value()}});
        return 0;
      }
    }
    log.info("stopped");
    return 0;
  }

 private:
  uint32_t held() const { return static_cast<uint32_t>(active_streams_.size() + waiting_.size()); }
  uint32_t free_credits() const {
    return settings_.max_batch > held() ? settings_.max_batch - held() : 0;
  }

  void update_gauges() {
    const auto& pool = worker_.forward->blocks();
    metrics_.kv_used->set(pool.capacity() - pool.free_blocks());
    metrics_.kv_free->set(pool.free_blocks());
    metrics_.queue_depth->set(static_cast<double>(waiting_.size()));
    metrics_.active->set(static_cast<double>(active_streams_.size()));
    worker_.link->set_load(static_cast<uint32_t>(waiting_.size()),
                           static_cast<uint32_t>(active_streams_.size()),
                           static_cast<uint32_t>(pool.capacity() - pool.free_blocks()),
                           static_cast<uint32_t>(pool.free_blocks()));
  }

  void dispatch(wire::Message& message) {
    if (worker_.handle(message, free_credits())) return;
    static constexpr runtime::HandlerTable<DecodeStage, 2, wire::Message&> kHandlers({
        {wire::MessageType::PrefillDone, &DecodeStage::accept},
        {wire::MessageType::CancelJob, &DecodeStage::on_cancel},
    });
    if (!kHandlers.dispatch(*this, message.type, message))
      worker_.service.log.warn("unexpected_message",
                               {{"type", wire::message_type_name(message.type)}});
  }

  void on_cancel(wire::Message& message) {
    const auto* cancel = message.as<wire::CancelJob>();
    cancel_stream(cancel->request_id(), cancel->attempt());
  }

  void give_back(const Stream& stream) {
    hand_back(*worker_.link, stream.request_id, stream.attempt);
    metrics_.handed_back->inc();
  }

  void give_back_everything() {
    for (Stream& stream : active_streams_) {
      stream.sequence->release(worker_.forward->blocks());
      give_back(stream);
    }
    active_streams_.clear();
    for (const Stream& stream : waiting_) give_back(stream);
    waiting_.clear();
  }

  void job_failed(uint64_t request_id, uint32_t attempt, wire::ErrorCode code,
                  const std::string& text) {
    send_job_failed(*worker_.link, request_id, attempt, code, text);
    metrics_.outcome("failed").inc();
    worker_.service.log.warn("job_failed", {{"request_id", request_id}, {"reason", text}});
    worker_.link->grant(1);
  }

  // A prompt's KV straight from prefill: taken only with the ticket the gateway signed for this
  // replica (so only a hand-over the gateway arranged), then confirmed to the gateway.
  void on_handover(wire::Message& message) {
    if (message.type != wire::MessageType::PrefillDone) {
      metrics_.handovers_refused->inc();
      return worker_.intake->refuse(message.type, "not_taken_here");
    }
    const auto* done = message.as<wire::PrefillDone>();
    if (!runtime::has_valid_ticket(worker_.link->handover_key(), *done)) {
      metrics_.handovers_refused->inc();
      return worker_.intake->refuse(message.type, "bad_ticket");
    }
    const uint64_t request_id = done->request_id();
    const uint32_t attempt = done->attempt();
    auto same = [&](const Stream& s) { return s.request_id == request_id && s.attempt == attempt; };
    if (std::any_of(waiting_.begin(), waiting_.end(), same) ||
        std::any_of(active_streams_.begin(), active_streams_.end(), same)) {
      metrics_.handovers_refused->inc();
      return worker_.intake->refuse(message.type, "duplicate");
    }
    if (!accept_stream(message)) return;
    metrics_.handovers->inc();
    flatbuffers::FlatBufferBuilder builder(64);
    builder.Finish(wire::CreateHandoverAccepted(builder, request_id, attempt),
                   wire::PrefillJobIdentifier());
    worker_.link->send(wire::encode(wire::MessageType::HandoverAccepted, builder));
  }

  void accept(wire::Message& message) { accept_stream(message); }

  // Queues the sequence to join the batch; false (and a JobFailed to the gateway) if it cannot.
  bool accept_stream(wire::Message& message) {
    const auto* done = message.as<wire::PrefillDone>();
    const uint64_t request_id = done->request_id();
    const uint32_t attempt = done->attempt();
    auto read = read_stream(message, worker_, context_);
    if (auto* refused = std::get_if<StreamRefusal>(&read)) {
      job_failed(request_id, attempt, refused->code, refused->text);
      return false;
    }
    waiting_.push_back(std::move(std::get<Stream>(read)));
    return true;
  }

  // FIFO admission: the head waits for room rather than being overtaken by smaller sequences, so
  // a long request cannot starve.
  void admit() {
    model::BlockPool& pool = worker_.forward->blocks();
    while (!waiting_.empty()) {
      Stream& stream = waiting_.front();
      if (blocks_for(stream, context_) > pool.free_blocks()) break;
      stream.sequence->reserve(pool, reserve_tokens(stream, context_));
      const size_t blocks = (stream.prompt.size() + model::kBlockTokens - 1) / model::kBlockTokens;
      const moeline::Status imported = worker_.forward->import_kv(
          std::span(stream.sequence->block_table()).first(blocks), stream.handoff.bulk[0].data());
      if (!imported.ok()) {
        stream.sequence->release(pool);
        job_failed(stream.request_id, stream.attempt, wire::error_code_for(imported.code()),
                   imported.error().message);
        waiting_.pop_front();
        continue;
      }
      stream.sequence->commit(stream.prompt);
      stream.handoff = wire::Message{};
      stream.last_token = Clock::now();
      active_streams_.push_back(std::move(stream));
      waiting_.pop_front();
    }
  }

  void cancel_stream(uint64_t request_id, uint32_t attempt) {
    auto matches = [&](const Stream& s) {
      return s.request_id == request_id && s.attempt == attempt;
    };
    for (auto it = active_streams_.begin(); it != active_streams_.end(); ++it) {
      if (!matches(*it)) continue;
      it->sequence->release(worker_.forward->blocks());
      active_streams_.erase(it);
      metrics_.outcome("cancelled").inc();
      worker_.link->grant(1);
      return;
    }
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      if (!matches(*it)) continue;
      waiting_.erase(it);
      metrics_.outcome("cancelled").inc();
      worker_.link->grant(1);
      return;
    }
  }

  // Each active stream's next token from this step's logits (model::sample_rows: on the pool's
  // threads where several draws are heavy).
  void draw_tokens(int64_t vocab) {
    samplers_.clear();
    for (Stream& stream : active_streams_) samplers_.push_back(stream.sampler.get());
    drawn_.resize(samplers_.size());
    model::sample_rows(samplers_, logits_.data(), vocab, worker_.pool.get(), drawn_);
  }

  void step() {
    const model::ModelConfig& cfg = worker_.model->config();
    inputs_.clear();
    for (Stream& stream : active_streams_)
      inputs_.push_back({stream.sequence.get(), std::span(&stream.next_token, 1), true});
    const auto start = Clock::now();
    moeline::Status status = worker_.forward->forward(inputs_, logits_);
    if (!status.ok()) {
      // Refuse every sequence of the step rather than stream garbage.
      for (Stream& stream : active_streams_) {
        stream.sequence->release(worker_.forward->blocks());
        job_failed(stream.request_id, stream.attempt, wire::error_code_for(status.code()),
                   status.error().message);
      }
      active_streams_.clear();
      return;
    }
    draw_tokens(cfg.vocab_size);
    flatbuffers::FlatBufferBuilder builder(64 + active_streams_.size() * 48);
    std::vector<flatbuffers::Offset<wire::TokenUpdate>> updates;
    std::vector<Stream> still;
    uint32_t finished = 0;
    const auto now = Clock::now();
    for (size_t i = 0; i < active_streams_.size(); ++i) {
      Stream& stream = active_streams_[i];
      const float* row = logits_.data() + static_cast<int64_t>(i) * cfg.vocab_size;
      const int32_t token = drawn_[i];
      ++stream.generated;
      stream.next_token = token;
      metrics_.tpot->observe(std::chrono::duration<double>(now - stream.last_token).count());
      if (stream.generated == 2)
        metrics_.ttft->observe(std::chrono::duration<double>(now - stream.joined).count());
      stream.last_token = now;
      const char* finish =
          model::finish_after(token, stream.generated, static_cast<int64_t>(stream.prompt.size()),
                              stream.sampling, eos_, cfg.max_position_embeddings);
      auto finish_text = builder.CreateString(finish);
      auto logprobs = logprobs_to_wire(builder, row, cfg.vocab_size, token, stream.sampling);
      // Typed on the last token only (schema 1.9; the string stays for older gateways).
      flatbuffers::Optional<wire::FinishReason> typed;
      if (auto parsed = wire::parse_finish_reason(finish);
          parsed && *parsed != wire::FinishReason::None)
        typed = *parsed;
      updates.push_back(wire::CreateTokenUpdate(builder, stream.request_id, stream.attempt, token,
                                                finish_text, logprobs, typed));
      if (*finish != '\0') {
        stream.sequence->release(worker_.forward->blocks());
        metrics_.outcome(finish).inc();
        metrics_.e2e->observe(std::chrono::duration<double>(now - stream.joined).count());
        ++finished;
      } else {
        still.push_back(std::move(stream));
      }
    }
    const auto step_us = std::chrono::duration_cast<std::chrono::microseconds>(now - start).count();
    builder.Finish(wire::CreateTokenBatch(builder, builder.CreateVector(updates),
                                          static_cast<uint32_t>(inputs_.size()),
                                          static_cast<uint32_t>(step_us)),
                   wire::PrefillJobIdentifier());
    // The finished sequences' credit rides on the batch that finishes them.
    worker_.link->grant(finished);
    worker_.link->send(wire::encode(wire::MessageType::TokenBatch, builder));
    metrics_.batch_size->observe(static_cast<double>(inputs_.size()));
    metrics_.step->observe(static_cast<double>(step_us) * 1e-6);
    metrics_.tokens->inc(static_cast<double>(inputs_.size()));
    active_streams_ = std::move(still);
  }

  DecodeSettings settings_;
  ComputeWorker worker_;
  Drain drain_;
  DecodeMetrics metrics_;
  int64_t context_ = 0;
  std::vector<int32_t> eos_;
  std::deque<Stream> waiting_;
  std::vector<Stream> active_streams_;
  std::vector<model::SequenceInput> inputs_;
  std::vector<float> logits_;
  std::vector<int32_t> drawn_;             // this step's token of each active stream
  std::vector<model::Sampler*> samplers_;  // their samplers, in the same order
};

int decode_body(const runtime::Config& config) {
  return DecodeStage(config).run();
}

}  // namespace
}  // namespace moeline::stages::decode

namespace moeline::stages {

int decode_main(int argc, char** argv) {
  return run_stage("decode", decode::decode_keys(), argc, argv, decode::decode_body);
}

}  // namespace moeline::stages
