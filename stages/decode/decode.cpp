#include "stages/decode/decode.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>

#include "model/generator.h"
#include "model/sampling.h"
#include "stages/common/common.h"
#include "stages/common/worker.h"
#include "stages/runtime/dispatch.h"

namespace moeline::stages {
namespace {

using Clock = std::chrono::steady_clock;

struct Stream {
  uint64_t request_id = 0;
  uint32_t attempt = 0;
  std::vector<int32_t> prompt;
  int32_t next_token = 0;
  int64_t generated = 1;  // the first token came from prefill
  model::SamplingParams sampling;
  std::unique_ptr<model::Sequence> sequence;
  std::unique_ptr<model::Sampler> sampler;
  Clock::time_point joined, last_token;
  wire::Message handoff;  // kept until admitted (its bulk frame holds the KV)
};

class DecodeStage {
 public:
  explicit DecodeStage(const runtime::Config& config)
      : worker_(config, "decode", wire::StageKind::Decode),
        drain_(config),
        max_batch_(static_cast<uint32_t>(config.integer("max-batch"))),
        metrics_(worker_.service.metrics) {
    const model::ModelConfig& cfg = worker_.model->config();
    context_ = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
    int64_t blocks = config.integer("kv-blocks");
    if (blocks <= 0) {
      // Every slot can hold a sequence as long as the context, within the memory budget.
      const int64_t per_sequence = (context_ + model::kBlockTokens - 1) / model::kBlockTokens;
      const auto budget = runtime::parse_bytes(config.text("kv-bytes"));
      const auto block_bytes = model::KvCache::bytes_per_token(cfg) * model::kBlockTokens;
      blocks =
          std::min<int64_t>(per_sequence * max_batch_, static_cast<int64_t>(budget / block_bytes));
      blocks = std::max<int64_t>(blocks, per_sequence);
    }
    worker_.create_engine(static_cast<int32_t>(blocks));
    worker_.open_intake(config);
    for (int64_t eos : cfg.eos_token_ids) eos_.push_back(static_cast<int32_t>(eos));
    kv_used_ = &metrics_.gauge("moeline_decode_kv_blocks", "KV blocks", {{"state", "used"}});
    kv_free_ = &metrics_.gauge("moeline_decode_kv_blocks", "KV blocks", {{"state", "free"}});
    queue_depth_ =
        &metrics_.gauge("moeline_decode_queue_depth", "Sequences waiting for KV room to join");
    active_ = &metrics_.gauge("moeline_decode_active_sequences", "Sequences in the running batch");
    batch_size_ = &metrics_.histogram("moeline_decode_batch_size", "Sequences per decode step",
                                      runtime::size_buckets());
    step_ = &metrics_.histogram("moeline_decode_step_seconds", "One decode step (forward+sample)",
                                runtime::latency_buckets());
    ttft_ = &metrics_.histogram("moeline_decode_ttft_seconds",
                                "Handoff received to the second token (first decoded here)",
                                runtime::latency_buckets());
    tpot_ = &metrics_.histogram("moeline_decode_time_per_output_token_seconds",
                                "Time between a sequence's tokens", runtime::latency_buckets());
    e2e_ = &metrics_.histogram("moeline_decode_e2e_seconds", "Handoff received to last token",
                               runtime::latency_buckets());
    for (const char* outcome : {"stop", "length", "failed", "cancelled"})
      outcomes_[outcome] = &metrics_.counter("moeline_decode_requests_total",
                                             "Sequences by outcome", {{"outcome", outcome}});
    tokens_total_ = &metrics_.counter("moeline_decode_tokens_total", "Tokens generated");
    handed_back_ = &metrics_.counter("moeline_decode_handed_back_total",
                                     "Sequences given back to the gateway by a drain");
    handovers_ = &metrics_.counter("moeline_decode_handovers_total",
                                   "Sequences prefill handed over directly, by outcome",
                                   {{"outcome", "accepted"}});
    handovers_refused_ = &metrics_.counter("moeline_decode_handovers_total",
                                           "Sequences prefill handed over directly, by outcome",
                                           {{"outcome", "refused"}});
  }

  int run() {
    auto& log = worker_.service.log;
    log.info("started",
             {{"max_batch", max_batch_}, {"kv_blocks", worker_.forward->blocks().capacity()}});
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
      admit();
      if (!active_streams_.empty()) step();
      update_gauges();
      // Draining: what was handed over before the hub knew still joins and runs (the stage
      // leaves once it has held nothing for a moment, so a hand-over already on its way is not
      // lost); at the end of the grace period what is left goes back to be decoded elsewhere.
      if (drain_.active(*worker_.link, log) &&
          (drain_.idle(active_streams_.empty() && waiting_.empty()) || drain_.expired())) {
        for (Stream& stream : active_streams_) {
          stream.sequence->release(worker_.forward->blocks());
          give_back(stream);
        }
        for (const Stream& stream : waiting_) give_back(stream);
        waiting_.clear();
        log.info("drained", {{"handed_back", handed_back_->value()}});
        active_streams_.clear();
        return 0;
      }
    }
    log.info("stopped");
    return 0;
  }

 private:
  uint32_t held() const { return static_cast<uint32_t>(active_streams_.size() + waiting_.size()); }
  uint32_t free_credits() const { return max_batch_ > held() ? max_batch_ - held() : 0; }

  void update_gauges() {
    const auto& pool = worker_.forward->blocks();
    kv_used_->set(pool.capacity() - pool.free_blocks());
    kv_free_->set(pool.free_blocks());
    queue_depth_->set(static_cast<double>(waiting_.size()));
    active_->set(static_cast<double>(active_streams_.size()));
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
    handed_back_->inc();
  }

  void job_failed(uint64_t request_id, uint32_t attempt, wire::ErrorCode code,
                  const std::string& text) {
    flatbuffers::FlatBufferBuilder builder(256);
    builder.Finish(
        wire::CreateJobFailed(builder, request_id, attempt, code, builder.CreateString(text)),
        wire::PrefillJobIdentifier());
    worker_.link->send(wire::encode(wire::MessageType::JobFailed, builder));
    outcomes_["failed"]->inc();
    worker_.service.log.warn("job_failed", {{"request_id", request_id}, {"reason", text}});
    worker_.link->grant(1);
  }

  // A prompt's KV straight from prefill: taken only with the ticket the gateway signed for this
  // replica (so only a hand-over the gateway arranged), then confirmed to the gateway.
  void on_handover(wire::Message& message) {
    if (message.type != wire::MessageType::PrefillDone) {
      handovers_refused_->inc();
      return worker_.intake->refuse(message.type, "not_taken_here");
    }
    const auto* done = message.as<wire::PrefillDone>();
    if (!runtime::has_valid_ticket(worker_.link->handover_key(), *done)) {
      handovers_refused_->inc();
      return worker_.intake->refuse(message.type, "bad_ticket");
    }
    const uint64_t request_id = done->request_id();
    const uint32_t attempt = done->attempt();
    auto same = [&](const Stream& s) { return s.request_id == request_id && s.attempt == attempt; };
    if (std::any_of(waiting_.begin(), waiting_.end(), same) ||
        std::any_of(active_streams_.begin(), active_streams_.end(), same)) {
      handovers_refused_->inc();
      return worker_.intake->refuse(message.type, "duplicate");
    }
    if (!accept_stream(message)) return;
    handovers_->inc();
    flatbuffers::FlatBufferBuilder builder(64);
    builder.Finish(wire::CreateHandoverAccepted(builder, request_id, attempt),
                   wire::PrefillJobIdentifier());
    worker_.link->send(wire::encode(wire::MessageType::HandoverAccepted, builder));
  }

  void accept(wire::Message& message) { accept_stream(message); }

  // Queues the sequence to join the batch; false (and a JobFailed to the gateway) if it cannot.
  bool accept_stream(wire::Message& message) {
    const auto* done = message.as<wire::PrefillDone>();
    const auto* layout = done->layout();
    const size_t prompt = done->tokens() ? done->tokens()->size() : 0;
    const size_t blocks = (prompt + model::kBlockTokens - 1) / model::kBlockTokens;
    std::string problem;
    if (auto bad = wire::check_bulk(done->frames(), message.bulk))
      problem = *bad;
    else if (!kv_layout_matches(layout, worker_.model->config(), blocks))
      problem = "KV layout does not match this decode replica's cache";
    else if (message.bulk.size() != 1 ||
             message.bulk[0].size() != blocks * worker_.forward->kv_block_bytes())
      problem = "KV frame has the wrong size";
    else if (prompt == 0 || static_cast<int64_t>(prompt) >= context_)
      problem = "a prompt of " + std::to_string(prompt) + " tokens does not fit the context of " +
                std::to_string(context_);
    else if (moeline::Status valid = from_wire(done->sampling()).validate(); !valid.ok())
      problem = valid.error().message;
    else if (done->first_token() < 0 || done->first_token() >= worker_.model->config().vocab_size)
      problem = "first token " + std::to_string(done->first_token()) + " is outside the vocabulary";
    if (!problem.empty()) {
      job_failed(done->request_id(), done->attempt(), wire::ErrorCode::MalformedMessage, problem);
      return false;
    }

    Stream stream;
    stream.request_id = done->request_id();
    stream.attempt = done->attempt();
    stream.prompt.assign(done->tokens()->begin(), done->tokens()->end());
    stream.next_token = done->first_token();
    stream.sampling = from_wire(done->sampling());
    stream.sequence = std::make_unique<model::Sequence>(
        stream.request_id, worker_.model->model_id(),
        model::namespace_id(done->cache_namespace() ? done->cache_namespace()->str() : ""));
    stream.sampler = std::make_unique<model::Sampler>(stream.sampling);
    stream.sampler->set_prompt(stream.prompt);
    // The first token was drawn by prefill from the same generator.
    stream.sampler->resume(std::span(&stream.next_token, 1));
    stream.joined = Clock::now();
    if (blocks_for(stream) > worker_.forward->blocks().capacity()) {
      job_failed(stream.request_id, stream.attempt, wire::ErrorCode::Overloaded,
                 "sequence needs more KV blocks than this decode replica has");
      return false;
    }
    stream.handoff = std::move(message);
    waiting_.push_back(std::move(stream));
    return true;
  }

  int64_t reserve_tokens(const Stream& stream) const {
    // max_tokens is clamped before the sum: a request may ask for 2^63 - 1 tokens.
    return std::min<int64_t>(static_cast<int64_t>(stream.prompt.size()) +
                                 std::min<int64_t>(stream.sampling.max_tokens, context_),
                             context_);
  }
  int32_t blocks_for(const Stream& stream) const {
    return static_cast<int32_t>((reserve_tokens(stream) + model::kBlockTokens - 1) /
                                model::kBlockTokens);
  }

  // FIFO admission: the head waits for room rather than being overtaken by smaller sequences, so
  // a long request cannot starve.
  void admit() {
    model::BlockPool& pool = worker_.forward->blocks();
    while (!waiting_.empty()) {
      Stream& stream = waiting_.front();
      if (blocks_for(stream) > pool.free_blocks()) break;
      stream.sequence->reserve(pool, reserve_tokens(stream));
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
      outcomes_["cancelled"]->inc();
      worker_.link->grant(1);
      return;
    }
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      if (!matches(*it)) continue;
      waiting_.erase(it);
      outcomes_["cancelled"]->inc();
      worker_.link->grant(1);
      return;
    }
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
    flatbuffers::FlatBufferBuilder builder(64 + active_streams_.size() * 48);
    std::vector<flatbuffers::Offset<wire::TokenUpdate>> updates;
    std::vector<Stream> still;
    uint32_t finished = 0;
    const auto now = Clock::now();
    for (size_t i = 0; i < active_streams_.size(); ++i) {
      Stream& stream = active_streams_[i];
      const float* row = logits_.data() + static_cast<int64_t>(i) * cfg.vocab_size;
      const int32_t token = stream.sampler->sample(row, cfg.vocab_size);
      ++stream.generated;
      stream.next_token = token;
      tpot_->observe(std::chrono::duration<double>(now - stream.last_token).count());
      if (stream.generated == 2)
        ttft_->observe(std::chrono::duration<double>(now - stream.joined).count());
      stream.last_token = now;
      const char* finish =
          model::finish_after(token, stream.generated, static_cast<int64_t>(stream.prompt.size()),
                              stream.sampling, eos_, cfg.max_position_embeddings);
      auto finish_text = builder.CreateString(finish);
      auto logprobs = logprobs_to_wire(builder, row, cfg.vocab_size, token, stream.sampling);
      updates.push_back(wire::CreateTokenUpdate(builder, stream.request_id, stream.attempt, token,
                                                finish_text, logprobs));
      if (*finish != '\0') {
        stream.sequence->release(worker_.forward->blocks());
        outcomes_[finish]->inc();
        e2e_->observe(std::chrono::duration<double>(now - stream.joined).count());
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
    worker_.link->send(wire::encode(wire::MessageType::TokenBatch, builder));
    batch_size_->observe(static_cast<double>(inputs_.size()));
    step_->observe(static_cast<double>(step_us) * 1e-6);
    tokens_total_->inc(static_cast<double>(inputs_.size()));
    active_streams_ = std::move(still);
    worker_.link->grant(finished);
  }

  ComputeWorker worker_;
  Drain drain_;
  runtime::Counter *handed_back_ = nullptr, *handovers_ = nullptr, *handovers_refused_ = nullptr;
  uint32_t max_batch_;
  int64_t context_ = 0;
  runtime::Registry& metrics_;
  std::vector<int32_t> eos_;
  std::deque<Stream> waiting_;
  std::vector<Stream> active_streams_;
  std::vector<model::SequenceInput> inputs_;
  std::vector<float> logits_;
  runtime::Gauge *kv_used_, *kv_free_, *queue_depth_, *active_;
  runtime::Histogram *batch_size_, *step_, *ttft_, *tpot_, *e2e_;
  runtime::Counter* tokens_total_;
  std::map<std::string, runtime::Counter*> outcomes_;
};

std::vector<runtime::ConfigKey> decode_keys() {
  std::vector<runtime::ConfigKey> keys = compute_keys();
  for (const runtime::ConfigKey& key : intake_keys()) keys.push_back(key);
  keys.push_back({"max-batch", "64", "sequences in the running batch (its credit)"});
  keys.push_back({"kv-blocks", "0",
                  "KV cache blocks (0: enough for max-batch full contexts, "
                  "within --kv-bytes)"});
  keys.push_back({"kv-bytes", "2GiB", "memory budget for the KV cache when --kv-blocks is 0"});
  return keys;
}

int decode_body(const runtime::Config& config) {
  return DecodeStage(config).run();
}

}  // namespace

int decode_main(int argc, char** argv) {
  return run_stage("decode", decode_keys(), argc, argv, decode_body);
}

}  // namespace moeline::stages
