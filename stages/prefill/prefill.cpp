#include "stages/prefill/prefill.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>

#include "model/generator.h"
#include "model/sampling.h"
#include "reuse/approximate.h"
#include "reuse/records.h"
#include "reuse/signature.h"
#include "stages/common/common.h"
#include "stages/common/worker.h"
#include "stages/runtime/dispatch.h"

namespace moeline::stages {
namespace {

// Where a job's bulk data goes (from the job's PeerRoute): empty endpoint, no route.
struct Route {
  std::string replica, endpoint, server_key;
  std::vector<uint8_t> ticket;
  static Route from(const wire::PeerRoute* route) {
    Route out;
    if (route == nullptr) return out;
    if (route->replica()) out.replica = route->replica()->str();
    if (route->endpoint()) out.endpoint = route->endpoint()->str();
    if (route->server_key()) out.server_key = route->server_key()->str();
    if (route->ticket()) out.ticket.assign(route->ticket()->begin(), route->ticket()->end());
    return out;
  }
  bool empty() const { return endpoint.empty(); }
};

struct Job {
  uint64_t request_id = 0;
  uint32_t attempt = 0;
  std::vector<int32_t> tokens;
  model::SamplingParams sampling;
  std::string cache_namespace;
  std::chrono::steady_clock::time_point received;
  // Prefix reuse: the first `reused` tokens' KV (whole blocks) came with the job.
  uint32_t reused = 0;
  std::string reuse_level;
  wire::AlignedFrame prefix_kv;
  uint32_t store_levels = 0;  // which entries to put back into the probe's store
  // Blended reuse: the prompt's blocks with a donor's KV where blend_mask is 1. A shadow job also
  // computes in full, serves that, and reports how the blend compared.
  bool blend = false, shadow = false;
  std::vector<uint8_t> blend_mask;
  float recompute_fraction = 0.15f;
  wire::AlignedFrame blend_kv;
  int64_t recomputed = 0;
  std::vector<float> blend_logits;  // a shadow job's blended first-token logits
  Route decode_route, store_route;  // empty decode route: the KV goes back in the PrefillDone
  int64_t computed() const { return static_cast<int64_t>(tokens.size()) - reused; }
};

class PrefillStage {
 public:
  explicit PrefillStage(const runtime::Config& config)
      : worker_(config, "prefill", wire::StageKind::Prefill),
        drain_(config),
        queue_capacity_(static_cast<uint32_t>(config.integer("queue"))),
        max_batch_tokens_(config.integer("max-batch-tokens")),
        metrics_(worker_.service.metrics) {
    const model::ModelConfig& cfg = worker_.model->config();
    context_ = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
    // Room for one full batch, or one prompt as long as the context, whichever is larger.
    const int64_t tokens = std::max(max_batch_tokens_, context_);
    const auto blocks = static_cast<int32_t>(
        (tokens + model::kBlockTokens - 1) / model::kBlockTokens + queue_capacity_);
    worker_.create_engine(blocks);
    worker_.open_intake(config);
    signature_options_ = signature_options(config);
    signatures_ = std::make_unique<reuse::SignatureAccumulator>(
        model::moe_layer_indices(cfg), std::max<int64_t>(1, cfg.num_experts), signature_options_);
    worker_.observers.add(signatures_.get());
    blend_select_layer_ = config.integer("blend-select-layer");
    if (blend_select_layer_ < 0 || blend_select_layer_ >= cfg.num_layers)
      throw runtime::ConfigError("--blend-select-layer must be in [0, " +
                                 std::to_string(cfg.num_layers) + ")");
    for (int64_t eos : cfg.eos_token_ids) eos_.push_back(static_cast<int32_t>(eos));
    kv_used_ = &metrics_.gauge("moeline_prefill_kv_blocks", "KV blocks", {{"state", "used"}});
    kv_free_ = &metrics_.gauge("moeline_prefill_kv_blocks", "KV blocks", {{"state", "free"}});
    queue_depth_ = &metrics_.gauge("moeline_prefill_queue_depth", "Jobs waiting for a batch");
    batch_size_ = &metrics_.histogram("moeline_prefill_batch_size", "Prompts per prefill batch",
                                      runtime::size_buckets());
    batch_tokens_ = &metrics_.histogram("moeline_prefill_batch_tokens", "Tokens per prefill batch",
                                        {16, 64, 256, 1024, 4096, 16384});
    ttft_ = &metrics_.histogram("moeline_prefill_ttft_seconds",
                                "Job received to first token sampled, in this stage",
                                runtime::latency_buckets());
    tpot_ = &metrics_.histogram("moeline_prefill_time_per_output_token_seconds",
                                "Prefill produces one token per job: equal to the job time",
                                runtime::latency_buckets());
    e2e_ = &metrics_.histogram("moeline_prefill_e2e_seconds", "Job received to PrefillDone sent",
                               runtime::latency_buckets());
    for (const char* outcome : {"done", "finished", "failed", "cancelled", "handed_back"})
      outcomes_[outcome] = &metrics_.counter("moeline_prefill_requests_total",
                                             "Prefill jobs by outcome", {{"outcome", outcome}});
    tokens_total_ = &metrics_.counter("moeline_prefill_tokens_total", "Prompt tokens prefilled");
    reused_tokens_total_ = &metrics_.counter("moeline_prefill_reused_tokens_total",
                                             "Prompt tokens whose KV came from the store");
    blend_jobs_ = &metrics_.counter("moeline_prefill_blend_jobs_total",
                                    "Blended prefills served (a donor's KV, part recomputed)");
    blend_recomputed_ = &metrics_.counter("moeline_prefill_blend_recomputed_tokens_total",
                                          "Tokens a blended prefill recomputed in every layer");
    blend_tokens_ = &metrics_.counter("moeline_prefill_blend_tokens_total",
                                      "Prompt tokens of blended prefills (served and shadowed)");
    shadow_jobs_ = &metrics_.counter("moeline_prefill_blend_shadow_total",
                                     "Blends also computed in full and compared");
    handover_failures_ = &metrics_.counter(
        "moeline_prefill_handover_failures_total",
        "Prompts whose KV the decode replica did not take (the gateway retries them)");
    puts_dropped_ = &metrics_.counter("moeline_prefill_snapshot_puts_dropped_total",
                                      "Snapshot puts the probe could not take (lost as cache)");
    blend_refused_ = &metrics_.counter("moeline_prefill_blend_refused_total",
                                       "Blend jobs whose KV did not fit (computed in full)");
  }

  int run() {
    auto& log = worker_.service.log;
    log.info("started", {{"queue", queue_capacity_}, {"max_batch_tokens", max_batch_tokens_}});
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
          outcomes_["handed_back"]->inc();
        }
        queue_.clear();
      }
      if (!queue_.empty()) run_batch();
      update_gauges();
      if (draining && drain_.idle(queue_.empty())) {
        log.info("drained", {{"handed_back", outcomes_["handed_back"]->value()}});
        return 0;
      }
    }
    log.info("stopped");
    return 0;
  }

 private:
  uint32_t free_credits() const {
    return queue_capacity_ > queue_.size() ? queue_capacity_ - static_cast<uint32_t>(queue_.size())
                                           : 0;
  }

  void update_gauges() {
    const model::BlockPool& pool = worker_.forward->blocks();
    const int32_t used = pool.capacity() - pool.free_blocks();
    kv_used_->set(used);
    kv_free_->set(pool.free_blocks());
    queue_depth_->set(static_cast<double>(queue_.size()));
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
  // A job the probe sends straight here (with a cached prefix's KV), taken only with the ticket
  // the gateway signed for this replica.
  void on_intake(wire::Message& message) {
    if (message.type != wire::MessageType::PrefillJob)
      return worker_.intake->refuse(message.type, "not_taken_here");
    if (!runtime::has_valid_ticket(worker_.link->handover_key(), *message.as<wire::PrefillJob>()))
      return worker_.intake->refuse(message.type, "bad_ticket");
    accept(message);
  }

  void on_cancel(wire::Message& message) {
    const auto* cancel = message.as<wire::CancelJob>();
    auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Job& job) {
      return job.request_id == cancel->request_id() && job.attempt == cancel->attempt();
    });
    if (it == queue_.end()) return;
    queue_.erase(it);
    outcomes_["cancelled"]->inc();
    worker_.link->grant(1);
  }

  void accept(wire::Message& message) {
    const wire::PrefillJob& wire_job = *message.as<wire::PrefillJob>();
    Job job;
    job.request_id = wire_job.request_id();
    job.attempt = wire_job.attempt();
    if (wire_job.tokens()) job.tokens.assign(wire_job.tokens()->begin(), wire_job.tokens()->end());
    job.sampling = from_wire(wire_job.sampling());
    job.cache_namespace = wire_job.cache_namespace() ? wire_job.cache_namespace()->str() : "";
    job.received = std::chrono::steady_clock::now();
    // The gateway validated the request; a job that still cannot run is refused, not run.
    const int64_t vocab = worker_.model->config().vocab_size;
    std::string problem;
    if (job.tokens.empty()) problem = "empty prompt";
    if (static_cast<int64_t>(job.tokens.size()) > context_)
      problem = "prompt of " + std::to_string(job.tokens.size()) +
                " tokens exceeds the context of " + std::to_string(context_);
    for (int32_t token : job.tokens)
      if (token < 0 || token >= vocab)
        problem = "token id " + std::to_string(token) + " out of range";
    if (moeline::Status status = job.sampling.validate(); !status.ok())
      problem = status.error().message;
    if (!problem.empty()) {
      fail(job, wire::ErrorCode::InvalidRequest, problem);
      worker_.link->grant(1);
      return;
    }
    job.store_levels = wire_job.store_levels();
    job.decode_route = Route::from(wire_job.decode_route());
    job.store_route = Route::from(wire_job.store_route());
    worker_.peers->prepare(job.store_route.endpoint, job.store_route.server_key);
    worker_.peers->prepare(job.decode_route.endpoint, job.decode_route.server_key);
    job.reuse_level = wire_job.reuse_level() ? wire_job.reuse_level()->str() : "";
    if (wire_job.reused_tokens() > 0 && job.reuse_level != "blend") {
      // A prefix that does not fit this replica's cache exactly is recomputed, never trusted.
      const uint32_t reused = wire_job.reused_tokens();
      const wire::KvLayout* layout = wire_job.layout();
      const bool usable =
          reused % model::kBlockTokens == 0 && reused < job.tokens.size() &&
          kv_layout_matches(layout, worker_.model->config(), reused / model::kBlockTokens) &&
          !wire::check_bulk(wire_job.frames(), message.bulk) && message.bulk.size() == 1 &&
          message.bulk[0].size() == layout->blocks() * worker_.forward->kv_block_bytes();
      if (usable) {
        job.reused = reused;
        job.prefix_kv = std::move(message.bulk[0]);
      } else {
        worker_.service.log.warn("prefix_refused", {{"request_id", job.request_id}});
        job.reuse_level = "none";
      }
    }
    if (job.reuse_level == "blend") accept_blend(wire_job, message, job);
    queue_.push_back(std::move(job));
  }

  // A blend whose KV does not fit this replica exactly is computed in full, never trusted.
  void accept_blend(const wire::PrefillJob& wire_job, wire::Message& message, Job& job) {
    if (!worker_.engine) {
      // Blended prefill is the CPU engine's; on a GPU the job is computed in full (its exact
      // prefix, if any, is not trusted alone: the frame's layout is the blend's).
      blend_refused_->inc();
      worker_.service.log.warn("blend_refused",
                               {{"request_id", job.request_id}, {"reason", "device"}});
      job.reuse_level = "none";
      return;
    }
    const wire::KvLayout* layout = wire_job.layout();
    const size_t blocks = (job.tokens.size() + model::kBlockTokens - 1) / model::kBlockTokens;
    // The frame holds every block of the prompt; the first reused_tokens (whole blocks) are an
    // exact prefix, imported and never recomputed.
    const uint32_t prefix = wire_job.reused_tokens();
    const bool usable =
        prefix % model::kBlockTokens == 0 && prefix < job.tokens.size() && wire_job.blend_mask() &&
        wire_job.blend_mask()->size() == job.tokens.size() &&
        kv_layout_matches(layout, worker_.model->config(), blocks) &&
        !wire::check_bulk(wire_job.frames(), message.bulk) && message.bulk.size() == 1 &&
        message.bulk[0].size() == blocks * worker_.forward->kv_block_bytes() &&
        wire_job.recompute_fraction() >= 0 && wire_job.recompute_fraction() <= 1;
    if (!usable) {
      blend_refused_->inc();
      worker_.service.log.warn("blend_refused", {{"request_id", job.request_id}});
      job.reuse_level = "none";
      return;
    }
    job.blend = true;
    job.shadow = wire_job.shadow();
    job.reused = prefix;
    job.blend_mask.assign(wire_job.blend_mask()->begin(), wire_job.blend_mask()->end());
    job.recompute_fraction = wire_job.recompute_fraction();
    job.blend_kv = std::move(message.bulk[0]);
    // What a blend computed is approximate: none of it goes into the exact store (a shadow job's
    // full computation does).
    if (!job.shadow) job.store_levels = 0;
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
                                    blend_select_layer_};
    std::vector<float> logits;
    const auto start = std::chrono::steady_clock::now();
    moeline::Status status = worker_.engine->forward_blend(input, logits, job.recomputed);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    blend_tokens_->inc(static_cast<double>(job.tokens.size()));
    if (!status.ok()) {
      worker_.service.log.warn(
          "blend_failed", {{"request_id", job.request_id}, {"reason", status.error().message}});
      job.blend = job.shadow = false;
      job.reuse_level = job.reused > 0 ? "prefix" : "none";
      return false;
    }
    blend_recomputed_->inc(static_cast<double>(job.recomputed));
    if (job.shadow) {
      shadow_jobs_->inc();
      job.blend_logits = std::move(logits);
      job.blend = false;
      return false;
    }
    blend_jobs_->inc();
    finish_job(job, sequence, logits.data(), seconds);
    return true;
  }

  void fail(const Job& job, wire::ErrorCode code, const std::string& text) {
    flatbuffers::FlatBufferBuilder builder(256);
    builder.Finish(wire::CreateJobFailed(builder, job.request_id, job.attempt, code,
                                         builder.CreateString(text)),
                   wire::PrefillJobIdentifier());
    worker_.link->send(wire::encode(wire::MessageType::JobFailed, builder));
    outcomes_["failed"]->inc();
    worker_.service.log.warn("job_failed", {{"request_id", job.request_id}, {"reason", text}});
  }

  void run_batch() {
    // FIFO: take jobs while the batch stays within the token budget (always at least one).
    std::vector<Job> batch;
    int64_t tokens = 0;
    while (!queue_.empty()) {
      const int64_t size = queue_.front().computed();
      if (!batch.empty() && tokens + size > max_batch_tokens_) break;
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
    // Reused blocks by key: jobs of one batch that reuse the same prefix — exact prefix hits, and
    // blends from one donor over one template — share its blocks. The batch holds a reference to
    // each until it ends (a blend's sequence is released before the next job runs).
    std::unordered_map<uint64_t, int32_t> shared;
    std::vector<int32_t> held;
    std::string kv_error;  // why start_sequence failed, when not for want of blocks
    auto start_sequence = [&](const Job& job) -> std::unique_ptr<model::Sequence> {
      const uint64_t ns = model::namespace_id(job.cache_namespace);
      auto sequence =
          std::make_unique<model::Sequence>(next_sequence_id_++, worker_.model->model_id(), ns);
      if (job.reused == 0) return sequence;
      const std::span<const int32_t> prefix(job.tokens.data(), job.reused);
      // A blend's frame starts with its exact prefix's blocks.
      const auto* source = static_cast<const uint8_t*>(
          job.blend_kv.size() > 0 ? job.blend_kv.data() : job.prefix_kv.data());
      const std::vector<uint64_t> chain = reuse::block_chain(prefix, worker_.model->model_id(), ns);
      // New blocks are imported a run at a time (a GPU's cache takes one copy per run).
      const size_t block_bytes = worker_.forward->kv_block_bytes();
      std::vector<int32_t> run;
      size_t run_start = 0;
      auto flush = [&] {
        const moeline::Status imported =
            worker_.forward->import_kv(run, source + run_start * block_bytes);
        if (!imported.ok()) {
          // No later job may share blocks whose KV did not arrive.
          std::erase_if(shared, [&](const auto& entry) {
            return std::find(run.begin(), run.end(), entry.second) != run.end();
          });
          kv_error = imported.error().message;
        }
        run.clear();
        return imported.ok();
      };
      auto abandon = [&] {
        sequence->release(pool);
        return std::unique_ptr<model::Sequence>();
      };
      for (size_t b = 0; b < chain.size(); ++b) {
        if (auto it = shared.find(chain[b]); it != shared.end()) {
          if (!flush()) return abandon();
          sequence->share_block(pool, it->second);
          continue;
        }
        std::optional<int32_t> block = pool.allocate();
        if (!block) {
          flush();
          return abandon();
        }
        if (run.empty()) run_start = b;
        run.push_back(*block);
        sequence->share_block(pool, *block);
        held.push_back(*block);
        shared[chain[b]] = *block;
      }
      if (!flush()) return abandon();
      sequence->commit(prefix);
      return sequence;
    };
    for (Job& job : batch) {
      kv_error.clear();
      auto sequence = start_sequence(job);
      if (sequence && job.blend) {
        const bool served = run_blend(job, *sequence);
        sequence->release(pool);
        if (served) continue;
        if (kv_error.empty())
          sequence = start_sequence(job);  // a shadow (or a failed blend): computed in full too
      }
      if (job.reused > 0) reused_tokens_total_->inc(job.reused);
      if (!sequence || !sequence->reserve(pool, job.computed())) {
        // Cannot happen with the cache sized for a full batch; refuse rather than corrupt.
        if (sequence) sequence->release(pool);
        if (!kv_error.empty()) {
          fail(job, wire::ErrorCode::Internal, "reused KV not imported: " + kv_error);
        } else {
          fail(job, wire::ErrorCode::Overloaded, "prefill KV cache full");
        }
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
    batch_size_->observe(static_cast<double>(inputs.size()));
    batch_tokens_->observe(static_cast<double>(tokens));
    for (size_t i = 0; i < inputs.size(); ++i) {
      Job& job = batch[i];
      if (!status.ok()) {
        fail(job, wire::error_code_for(status.code()), status.error().message);
      } else {
        finish_job(job, *sequences[i], logits.data() + static_cast<int64_t>(i) * cfg.vocab_size,
                   std::chrono::duration<double>(done - start).count());
      }
      signatures_->forget(sequences[i]->id());
      sequences[i]->release(pool);
    }
    for (int32_t block : held) pool.release(block);
    worker_.link->grant(taken);
  }

  void finish_job(const Job& job, const model::Sequence& sequence, const float* logits,
                  double forward_seconds) {
    const model::ModelConfig& cfg = worker_.model->config();
    model::Sampler sampler(job.sampling);
    sampler.set_prompt(job.tokens);
    const int32_t first = sampler.sample(logits, cfg.vocab_size);
    const auto sampled = std::chrono::steady_clock::now();
    ttft_->observe(std::chrono::duration<double>(sampled - job.received).count());
    tokens_total_->inc(static_cast<double>(job.computed()));

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
        return fail(job, wire::error_code_for(status.code()), status.error().message);
      // The store's entries go out first: a request that follows this one (the client may send
      // it as soon as it sees the first token) then finds them in the probe.
      put_snapshots(job, sequence.id(), exported, logits);
    }

    const PrefillResult result{first, finish, forward_seconds, logits};
    if (!finish.empty() || job.decode_route.empty()) {
      // Finished at its first token, or no decode route (`moeline load`, an older gateway): the
      // PrefillDone goes to the hub, with the KV when the sequence goes on.
      worker_.link->send(prefill_done(job, result, finish.empty() ? exported : nullptr, nullptr));
    } else {
      // The gateway hears first (it streams the first token and expects the decode replica), then
      // the KV goes straight to that replica, with the ticket the gateway signed for it.
      worker_.link->send(prefill_done(job, result, nullptr, nullptr));
      if (!worker_.peers->send(job.decode_route.endpoint, job.decode_route.server_key,
                               prefill_done(job, result, exported, &job.decode_route.ticket))) {
        handover_failures_->inc();
        fail(job, wire::ErrorCode::StageFailed,
             "decode replica " + job.decode_route.replica + " did not take the hand-over at " +
                 job.decode_route.endpoint);
        return;
      }
    }
    const double total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - job.received).count();
    tpot_->observe(total);
    e2e_->observe(total);
    outcomes_[finish.empty() ? "done" : "finished"]->inc();
  }

  struct PrefillResult {
    int32_t first;
    std::string finish;
    double forward_seconds;
    const float* logits;
  };

  // The PrefillDone of a job: with the prompt's KV (`exported`) when it is the hand-over to decode
  // (signed with `ticket`) or goes back to a hub without a decode route.
  std::vector<zmq::message_t> prefill_done(const Job& job, const PrefillResult& result,
                                           const std::shared_ptr<std::vector<uint8_t>>& exported,
                                           const std::vector<uint8_t>* ticket) {
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
    auto finish_text = builder.CreateString(result.finish);
    auto sampling = to_wire(builder, job.sampling);
    auto name_space = builder.CreateString(job.cache_namespace);
    auto replica = builder.CreateString(worker_.service.log.replica());
    auto level = builder.CreateString(job.blend ? "blend" : job.reused > 0 ? "prefix" : "");
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
    builder.Finish(
        wire::CreatePrefillDone(builder, job.request_id, job.attempt, tokens, result.first,
                                finish_text, sampling, name_space, layout, frames,
                                static_cast<uint64_t>(result.forward_seconds * 1e6), replica, level,
                                reused, static_cast<uint32_t>(job.blend ? job.recomputed : 0),
                                checked, static_cast<float>(kl), top1, logprobs, signed_ticket),
        wire::PrefillJobIdentifier());
    return wire::encode(wire::MessageType::PrefillDone, builder, std::move(bulk));
  }

  // What this prefill computed goes back to the probe's store: each new full block (prefix
  // reuse) and the prompt's first-token logits with its partial last block (full reuse).
  // A ZeroMQ message over part of a shared buffer; the buffer lives until its last view is sent.
  static zmq::message_t view(const std::shared_ptr<std::vector<uint8_t>>& buffer, size_t offset,
                             size_t bytes) {
    auto* keep = new std::shared_ptr<std::vector<uint8_t>>(buffer);
    return zmq::message_t(
        buffer->data() + offset, bytes,
        [](void*, void* hint) { delete static_cast<std::shared_ptr<std::vector<uint8_t>>*>(hint); },
        keep);
  }

  void put_snapshots(const Job& job, uint64_t sequence_id,
                     const std::shared_ptr<std::vector<uint8_t>>& exported, const float* logits) {
    if (job.store_levels == 0) return;
    const size_t block_bytes = worker_.forward->kv_block_bytes();
    const uint64_t model_id = worker_.model->model_id();
    const uint64_t ns = model::namespace_id(job.cache_namespace);
    const std::vector<uint64_t> chain = reuse::block_chain(job.tokens, model_id, ns);
    flatbuffers::FlatBufferBuilder builder(1024);
    std::vector<flatbuffers::Offset<wire::SnapshotEntry>> entries;
    std::vector<flatbuffers::Offset<wire::BulkFrame>> frames;
    std::vector<zmq::message_t> bulk;
    auto add = [&](uint64_t key, uint8_t kind, zmq::message_t frame) {
      entries.push_back(wire::CreateSnapshotEntry(builder, key, kind));
      frames.push_back(wire::CreateBulkFrame(
          builder, frame.size(),
          wire::checksum({static_cast<const uint8_t*>(frame.data()), frame.size()})));
      bulk.push_back(std::move(frame));
    };
    if (job.store_levels & reuse::kPrefix) {
      for (size_t b = job.reused / model::kBlockTokens; b < chain.size(); ++b)
        add(reuse::block_entry(chain[b]), 'B', view(exported, b * block_bytes, block_bytes));
    }
    if (job.store_levels & reuse::kFull) {
      reuse::PromptRecord record;
      record.logits.assign(logits, logits + worker_.model->config().vocab_size);
      if (job.tokens.size() % model::kBlockTokens != 0) {
        const auto* tail = exported->data() + chain.size() * block_bytes;
        record.tail_kv.assign(reinterpret_cast<const char*>(tail), block_bytes);
      }
      const std::string bytes = reuse::encode(record);
      add(reuse::prompt_entry(reuse::prompt_key(job.tokens, chain, model_id, ns)), 'P',
          zmq::message_t(bytes.data(), bytes.size()));
    }
    if (job.store_levels & reuse::kApproximateLevels) {
      // The prompt's activation signature (the probe's index), pooled over what this prefill
      // computed: the same function the probe applies at lookup.
      reuse::SignatureRecord record;
      record.cache_namespace = job.cache_namespace;
      record.tokens = job.tokens;
      record.signature = signatures_->signature(sequence_id);
      record.expert_sets = signatures_->expert_sets(sequence_id);
      for (const auto& [block, sums] : signatures_->block_sums(sequence_id))
        if (std::all_of(sums.tokens.begin(), sums.tokens.end(),
                        [](int64_t n) { return n == model::kBlockTokens; }))
          record.block_sums.emplace_back(static_cast<uint32_t>(block), sums);
      if (!record.signature.empty()) {
        const std::string bytes = reuse::encode(record);
        add(reuse::signature_entry(reuse::prompt_key(job.tokens, chain, model_id, ns)), 'S',
            zmq::message_t(bytes.data(), bytes.size()));
      }
    }
    if (entries.empty()) return;
    const Route& store = job.store_route;
    builder.Finish(
        wire::CreateSnapshotPut(builder, builder.CreateVector(entries),
                                builder.CreateVector(frames), job.request_id, job.attempt,
                                store.empty() ? 0 : builder.CreateVector(store.ticket)),
        wire::PrefillJobIdentifier());
    std::vector<zmq::message_t> put =
        wire::encode(wire::MessageType::SnapshotPut, builder, std::move(bulk));
    // Straight to the probe that owns the namespace; a hub without routes (`moeline load`, an
    // older gateway) takes them itself. A put that cannot go is lost as cache, nothing more.
    if (!store.empty()) {
      if (!worker_.peers->send(store.endpoint, store.server_key, std::move(put)))
        puts_dropped_->inc();
    } else if (job.decode_route.empty()) {
      worker_.link->send(std::move(put));
    }
  }

  ComputeWorker worker_;
  Drain drain_;
  uint32_t queue_capacity_;
  int64_t max_batch_tokens_;
  int64_t context_ = 0;
  runtime::Registry& metrics_;
  std::deque<Job> queue_;
  std::vector<int32_t> eos_;
  uint64_t next_sequence_id_ = 1;
  runtime::Gauge *kv_used_, *kv_free_, *queue_depth_;
  runtime::Histogram *batch_size_, *batch_tokens_, *ttft_, *tpot_, *e2e_;
  runtime::Counter *tokens_total_, *reused_tokens_total_, *blend_jobs_, *blend_recomputed_,
      *blend_tokens_, *shadow_jobs_, *blend_refused_, *handover_failures_, *puts_dropped_;
  reuse::SignatureOptions signature_options_;
  std::unique_ptr<reuse::SignatureAccumulator> signatures_;
  int64_t blend_select_layer_ = 1;
  std::map<std::string, runtime::Counter*> outcomes_;
};

std::vector<runtime::ConfigKey> prefill_keys() {
  std::vector<runtime::ConfigKey> keys = compute_keys();
  for (const runtime::ConfigKey& key : intake_keys()) keys.push_back(key);
  keys.push_back({"queue", "8", "jobs this replica accepts ahead of its batches (its credit)"});
  keys.push_back({"max-batch-tokens", "2048", "prompt tokens per prefill batch"});
  for (const runtime::ConfigKey& key : signature_keys()) keys.push_back(key);
  keys.push_back({"blend-select-layer", "1",
                  "blended reuse runs every token through this layer, then only the recomputed"});
  return keys;
}

int prefill_body(const runtime::Config& config) {
  return PrefillStage(config).run();
}

}  // namespace

int prefill_main(int argc, char** argv) {
  return run_stage("prefill", prefill_keys(), argc, argv, prefill_body);
}

}  // namespace moeline::stages
