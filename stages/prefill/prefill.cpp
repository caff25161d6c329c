#include "stages/prefill/prefill.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>

#include "model/generator.h"
#include "model/prompt_logprobs.h"
#include "model/sampling.h"
#include "model/token_constraint.h"
#include "reuse/records.h"
#include "reuse/signature.h"
#include "stages/common/common.h"
#include "stages/common/worker.h"
#include "stages/prefill/batch_prefixes.h"
#include "stages/prefill/job.h"
#include "stages/prefill/job_intake.h"
#include "stages/prefill/prefill_metrics.h"
#include "stages/prefill/prefill_settings.h"
#include "stages/prefill/results.h"
#include "stages/runtime/dispatch.h"

namespace moeline::stages::prefill {
namespace {

// The stage: takes jobs (from the hub, or from a probe at its intake), runs them in batches as
// the token budget allows, and hands each result to JobResults.
class PrefillStage {
 public:
  explicit PrefillStage(const runtime::Config& config)
      : settings_(PrefillSettings::from(config)),
        worker_(config, "prefill", wire::StageKind::Prefill),
        drain_(config),
        metrics_(worker_.service.metrics) {
    const model::ModelConfig& cfg = worker_.model->config();
    context_ = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
    // Room for one full batch, or one prompt as long as the context, whichever is larger.
    const int64_t tokens = std::max(settings_.max_batch_tokens, context_);
    const auto blocks = static_cast<int32_t>(
        (tokens + model::kBlockTokens - 1) / model::kBlockTokens + settings_.queue_capacity);
    worker_.create_engine(blocks);
    worker_.open_intake(config);
    signatures_ = std::make_unique<reuse::SignatureAccumulator>(
        model::moe_layer_indices(cfg), std::max<int64_t>(1, cfg.num_experts), settings_.signatures);
    worker_.observers.add(signatures_.get());
    if (settings_.blend_select_layer < 0 || settings_.blend_select_layer >= cfg.num_layers)
      throw runtime::ConfigError("--blend-select-layer must be in [0, " +
                                 std::to_string(cfg.num_layers) + ")");
    for (int64_t eos : cfg.eos_token_ids) eos_.push_back(static_cast<int32_t>(eos));
    intake_ = std::make_unique<JobIntake>(worker_, metrics_, context_);
    results_ = std::make_unique<JobResults>(worker_, metrics_, *signatures_);
  }

  int run() {
    auto& log = worker_.service.log;
    log.info("started", {{"queue", settings_.queue_capacity},
                         {"max_batch_tokens", settings_.max_batch_tokens}});
    while (!runtime::StageService::stop_requested()) {
      worker_.service.tick();
      if (!worker_.maintain()) {
        log.error("exiting", {{"reason", worker_.exit_reason()}});
        return 3;
      }
      // Block briefly when idle; just drain when there is work.
      auto message = worker_.link->receive(queue_.empty() ? 50 : 0, &worker_.intake->socket());
      if (message) {
        worker_.service.guard("prefill", [&] { dispatch(*message); });
        continue;
      }
      if (auto job = worker_.intake->receive()) {
        worker_.service.guard("prefill", [&] { on_intake(*job); });
        continue;
      }
      const bool draining = drain_.active(*worker_.link, log);
      if (draining && drain_.expired()) {
        // What the grace period could not prefill goes back, to run on another replica.
        for (const Job& job : queue_) {
          hand_back(*worker_.link, job.request_id, job.attempt);
          metrics_.outcome(Outcome::kHandedBack).inc();
        }
        queue_.clear();
      }
      if (!queue_.empty()) run_batch();
      update_gauges();
      if (draining && drain_.idle(queue_.empty())) {
        log.info("drained", {{"handed_back", metrics_.outcome(Outcome::kHandedBack).value()}});
        return 0;
      }
    }
    log.info("stopped");
    return 0;
  }

 private:
  uint32_t free_credits() const {
    return settings_.queue_capacity > queue_.size()
               ? settings_.queue_capacity - static_cast<uint32_t>(queue_.size())
               : 0;
  }

  void update_gauges() {
    const model::BlockPool& pool = worker_.forward->blocks();
    const int32_t used = pool.capacity() - pool.free_blocks();
    metrics_.kv_used->set(used);
    metrics_.kv_free->set(pool.free_blocks());
    metrics_.queue_depth->set(static_cast<double>(queue_.size()));
    worker_.link->set_load(static_cast<uint32_t>(queue_.size()), 0, static_cast<uint32_t>(used),
                           static_cast<uint32_t>(pool.free_blocks()));
  }

  void dispatch(wire::Message& message) {
    if (worker_.handle(message, free_credits())) return;
    static constexpr runtime::HandlerTable<PrefillStage, 2, wire::Message&> kHandlers({
        {wire::MessageType::PrefillJob, &PrefillStage::accept},
        {wire::MessageType::CancelJob, &PrefillStage::on_cancel},
    });
    if (!kHandlers.dispatch(*this, message.type, message))
      worker_.service.log.warn("unexpected_message",
                               {{"type", wire::message_type_name(message.type)}});
  }

  // A job still queued is dropped; one in the running batch finishes (its result is ignored).
  void on_cancel(wire::Message& message) {
    const auto* cancel = message.as<wire::CancelJob>();
    auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Job& job) {
      return job.request_id == cancel->request_id() && job.attempt == cancel->attempt();
    });
    if (it == queue_.end()) return;
    queue_.erase(it);
    metrics_.outcome(Outcome::kCancelled).inc();
    worker_.link->grant(1);
  }

  // A job the probe sends straight here (with a cached prefix's KV), taken only with the ticket
  // the gateway signed for this replica.
  void on_intake(wire::Message& message) {
    if (message.type != wire::MessageType::PrefillJob)
      return worker_.intake->refuse(message.type, "not_taken_here");
    if (!runtime::has_valid_ticket(worker_.link->handover_key(), *message.as<wire::PrefillJob>()))
      return worker_.intake->refuse(message.type, "bad_ticket");
    accept(message);
  }

  void accept(wire::Message& message) {
    Expected<Job> job = intake_->read(message);
    if (!job) {
      const auto* wire_job = message.as<wire::PrefillJob>();
      Job refused;
      refused.request_id = wire_job->request_id();
      refused.attempt = wire_job->attempt();
      results_->fail(refused, wire::error_code_for(job.error().code), job.error().message);
      worker_.link->grant(1);
      return;
    }
    queue_.push_back(std::move(*job));
  }

  // Runs a blend job's blended prefill on `sequence` (holding the job's exact prefix, if any).
  // Served: finishes the job (true). Shadow: keeps the blend's logits and leaves the job to the
  // full batch (false); so does a blend that failed (computed in full instead).
  bool run_blend(Job& job, model::Sequence& sequence) {
    const size_t prefix_blocks = job.reused / model::kBlockTokens;
    model::Engine::BlendInput input{&sequence,
                                    std::span(job.tokens).subspan(job.reused),
                                    static_cast<const uint8_t*>(job.blend_kv.data()) +
                                        prefix_blocks * worker_.forward->kv_block_bytes(),
                                    std::span(job.blend_mask).subspan(job.reused),
                                    job.recompute_fraction,
                                    settings_.blend_select_layer};
    std::vector<float> logits;
    const auto start = std::chrono::steady_clock::now();
    moeline::Status status = worker_.engine->forward_blend(input, logits, job.recomputed);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    metrics_.blend_tokens->inc(static_cast<double>(job.tokens.size()));
    if (!status.ok()) {
      worker_.service.log.warn(
          "blend_failed", {{"request_id", job.request_id}, {"reason", status.error().message}});
      job.blend = job.shadow = false;
      job.reuse_level = job.reused > 0 ? wire::ReuseLevel::Prefix : wire::ReuseLevel::None;
      return false;
    }
    metrics_.blend_recomputed->inc(static_cast<double>(job.recomputed));
    if (job.shadow) {
      metrics_.blend_shadows->inc();
      job.blend_logits = std::move(logits);
      job.blend = false;
      return false;
    }
    metrics_.blend_jobs->inc();
    finish_job(job, sequence, logits.data(), seconds);
    return true;
  }

  // A job that asked for its prompt's log-probabilities runs alone, its prompt in chunks that
  // each give every position's logits (model/prompt_logprobs.h); it reuses nothing (the gateway
  // asks for no reuse, and a reused prefix is refused by score_prompt).
  void run_scored(const Job& job, model::Sequence& sequence) {
    model::PromptScore score;
    const auto start = std::chrono::steady_clock::now();
    const moeline::Status status = model::score_prompt(*worker_.forward, sequence, job.tokens,
                                                       job.sampling.top_logprobs, score);
    if (!status.ok())
      return results_->fail(job, wire::error_code_for(status.code()), status.error().message);
    metrics_.scored_tokens->inc(static_cast<double>(job.tokens.size()));
    finish_job(job, sequence, score.last_logits.data(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
               &score.logprobs);
  }

  void run_batch() {
    // FIFO: take jobs while the batch stays within the token budget (always at least one).
    std::vector<Job> batch;
    int64_t tokens = 0;
    while (!queue_.empty()) {
      const int64_t size = queue_.front().computed();
      if (!batch.empty() && tokens + size > settings_.max_batch_tokens) break;
      tokens += size;
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    const model::ModelConfig& cfg = worker_.model->config();
    model::BlockPool& pool = worker_.forward->blocks();
    const auto taken = static_cast<uint32_t>(batch.size());
    std::vector<std::unique_ptr<model::Sequence>> sequences;
    std::vector<model::SequenceInput> inputs;
    std::vector<Job> runnable;
    runnable.reserve(batch.size());
    BatchPrefixes prefixes(worker_, next_sequence_id_);
    for (Job& job : batch) {
      auto sequence = prefixes.start(job);
      if (sequence && job.blend) {
        const bool served = run_blend(job, *sequence);
        sequence->release(pool);
        if (served) continue;
        if (prefixes.import_error().empty())
          sequence = prefixes.start(job);  // a shadow (or a failed blend): computed in full too
      }
      if (job.reused > 0) metrics_.reused_tokens->inc(job.reused);
      if (!sequence || !sequence->reserve(pool, job.computed())) {
        // Cannot happen with the cache sized for a full batch; refuse rather than corrupt.
        if (sequence) sequence->release(pool);
        if (!prefixes.import_error().empty()) {
          results_->fail(job, wire::ErrorCode::Internal,
                         "reused KV not imported: " + prefixes.import_error());
        } else {
          results_->fail(job, wire::ErrorCode::Overloaded, "prefill KV cache full");
        }
        continue;
      }
      if (job.sampling.prompt_logprobs) {
        run_scored(job, *sequence);
        sequence->release(pool);
        continue;
      }
      if (job.store_levels & reuse::kApproximateLevels)
        signatures_->watch(sequence->id(), static_cast<int64_t>(job.reused), /*per_block=*/true);
      runnable.push_back(std::move(job));
      const Job& kept = runnable.back();
      inputs.push_back({sequence.get(), std::span(kept.tokens).subspan(kept.reused), true});
      sequences.push_back(std::move(sequence));
    }
    batch = std::move(runnable);
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> logits;
    moeline::Status status = worker_.forward->forward(inputs, logits);
    const auto done = std::chrono::steady_clock::now();
    metrics_.batch_size->observe(static_cast<double>(inputs.size()));
    metrics_.batch_tokens->observe(static_cast<double>(tokens));
    // The batch's credit rides on its first result.
    worker_.link->grant(taken);
    std::vector<FirstDraw> draws;
    if (status.ok()) draws = draw_first_tokens(batch, logits.data());
    for (size_t i = 0; i < inputs.size(); ++i) {
      Job& job = batch[i];
      if (!status.ok()) {
        results_->fail(job, wire::error_code_for(status.code()), status.error().message);
      } else {
        finish_job(job, *sequences[i], logits.data() + static_cast<int64_t>(i) * cfg.vocab_size,
                   std::chrono::duration<double>(done - start).count(), nullptr, &draws[i]);
      }
      signatures_->forget(sequences[i]->id());
      sequences[i]->release(pool);
    }
  }

  // A job's first token: its sampler (with the job's grammar, where it has one) and the token
  // drawn with it, or why none could be.
  struct FirstDraw {
    std::unique_ptr<model::Sampler> sampler;
    moeline::Status status;
    int32_t token = -1;
  };

  FirstDraw prepare_draw(const Job& job) const {
    const model::ModelConfig& cfg = worker_.model->config();
    FirstDraw draw;
    draw.sampler = std::make_unique<model::Sampler>(job.sampling);
    draw.sampler->set_prompt(job.tokens);
    draw.status = model::constrain_sampler(*draw.sampler, job.sampling, worker_.model->dir(),
                                           cfg.vocab_size, eos_);
    return draw;
  }

  // The batch's first tokens (job i's logits at row i), drawn as decode draws a step's
  // (model::sample_rows: on the pool's threads where several are heavy). The samplers are made
  // one after another (a grammar's compile reads the model's tokenizer).
  std::vector<FirstDraw> draw_first_tokens(const std::vector<Job>& batch, const float* logits) {
    std::vector<FirstDraw> draws;
    std::vector<model::Sampler*> samplers;
    for (const Job& job : batch) {
      draws.push_back(prepare_draw(job));
      samplers.push_back(draws.back().status.ok() ? draws.back().sampler.get() : nullptr);
    }
    std::vector<int32_t> tokens(draws.size(), -1);
    model::sample_rows(samplers, logits, worker_.model->config().vocab_size, worker_.pool.get(),
                       tokens);
    for (size_t i = 0; i < draws.size(); ++i) draws[i].token = tokens[i];
    return draws;
  }

  // `drawn`: the job's first token where the batch drew it; otherwise it is drawn here.
  void finish_job(const Job& job, const model::Sequence& sequence, const float* logits,
                  double forward_seconds,
                  const std::vector<model::TokenLogprobs>* prompt_logprobs = nullptr,
                  FirstDraw* drawn = nullptr) {
    const model::ModelConfig& cfg = worker_.model->config();
    FirstDraw own;
    if (drawn == nullptr) {
      own = prepare_draw(job);
      if (own.status.ok()) own.token = own.sampler->sample(logits, cfg.vocab_size);
      drawn = &own;
    }
    if (!drawn->status.ok())
      return results_->fail(job, wire::error_code_for(drawn->status.code()),
                            drawn->status.error().message);
    const int32_t first = drawn->token;
    const auto sampled = std::chrono::steady_clock::now();
    metrics_.ttft->observe(std::chrono::duration<double>(sampled - job.received).count());
    metrics_.tokens->inc(static_cast<double>(job.computed()));

    const std::string finish =
        model::finish_after(first, 1, static_cast<int64_t>(job.tokens.size()), job.sampling, eos_,
                            cfg.max_position_embeddings);

    // The prompt's KV, exported once: the decode handoff and the store's new blocks are views of
    // this one buffer (no copies).
    const size_t blocks = (job.tokens.size() + model::kBlockTokens - 1) / model::kBlockTokens;
    std::shared_ptr<std::vector<uint8_t>> exported;
    if (finish.empty() || job.store_levels != 0) {
      exported = std::make_shared<std::vector<uint8_t>>(blocks * worker_.forward->kv_block_bytes());
      const moeline::Status status = worker_.forward->export_kv(
          std::span(sequence.block_table()).first(blocks), exported->data());
      if (!status.ok())
        return results_->fail(job, wire::error_code_for(status.code()), status.error().message);
      // The store's entries go out first: a request that follows this one (the client may send
      // it as soon as it sees the first token) then finds them in the probe.
      results_->put_snapshots(job, sequence.id(), exported, logits);
    }

    if (!results_->deliver(job, {first, finish, forward_seconds, logits, prompt_logprobs},
                           exported))
      return;
    const double total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - job.received).count();
    metrics_.tpot->observe(total);
    metrics_.e2e->observe(total);
    metrics_.outcome(finish.empty() ? Outcome::kDone : Outcome::kFinished).inc();
  }

  PrefillSettings settings_;
  ComputeWorker worker_;
  Drain drain_;
  PrefillMetrics metrics_;
  int64_t context_ = 0;
  std::deque<Job> queue_;
  std::vector<int32_t> eos_;
  uint64_t next_sequence_id_ = 1;
  std::unique_ptr<reuse::SignatureAccumulator> signatures_;
  std::unique_ptr<JobIntake> intake_;
  std::unique_ptr<JobResults> results_;
};

int prefill_body(const runtime::Config& config) {
  return PrefillStage(config).run();
}

}  // namespace
}  // namespace moeline::stages::prefill

namespace moeline::stages {

int prefill_main(int argc, char** argv) {
  return run_stage("prefill", prefill::prefill_keys(), argc, argv, prefill::prefill_body);
}

}  // namespace moeline::stages
