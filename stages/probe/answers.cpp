#include "stages/probe/answers.h"

#include "model/generator.h"
#include "model/sampling.h"
#include "model/token_constraint.h"
#include "schemas/vocabulary.h"
#include "stages/common/common.h"
#include "stages/probe/stored_kv.h"

namespace moeline::stages {

flatbuffers::Offset<wire::KvLayout> ProbeAnswers::layout(flatbuffers::FlatBufferBuilder& builder,
                                                         size_t blocks) const {
  return kv_layout(builder, model_.config(), blocks);
}

// A finished completion to replay: the prompt's own (result level) or, for response reuse
// (`approximate` given), the donor's.
void ProbeAnswers::answer_result(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                                 const reuse::ResultRecord& result,
                                 const ApproximateResult* approximate) {
  flatbuffers::FlatBufferBuilder builder(256 + result.tokens.size() * 4);
  auto completion = builder.CreateVector(result.tokens);
  const wire::PlanLabels labels(
      builder, approximate ? wire::ReuseLevel::Response : wire::ReuseLevel::Result,
      wire::parse_finish_reason(result.finish_reason).value_or(wire::FinishReason::Stop),
      approximate ? approximate->outcome : wire::ApproximateOutcome::NotAsked);
  wire::ProbePlanBuilder plan(builder);
  plan.add_request_id(job.request_id());
  plan.add_attempt(job.attempt());
  labels.add_to(plan);
  if (!approximate) plan.add_reused_tokens(static_cast<uint32_t>(tokens.size()));
  plan.add_completion(completion);
  if (approximate) {
    plan.add_donor_key(approximate->donor);
    plan.add_similarity(approximate->similarity);
    plan.add_cell(approximate->cell);
  }
  builder.Finish(plan.Finish(), wire::PrefillJobIdentifier());
  link_.send(wire::encode(wire::MessageType::ProbePlan, builder));
}

// Blended reuse (served, or shadowed: prefill then also computes in full, serves that and
// reports how the blend compared): the prompt's blocks — the exact prefix's, then the donor's
// KV moved into place — and the mask. The affinity key (the exact prefix's last block, or the
// donor) sends jobs over one template, or from one donor, to one prefill replica.
void ProbeAnswers::send_blend(const wire::ProbeJob& job, ApproximateResult& a,
                              Clock::time_point start, const std::vector<reuse::Value>& prefix,
                              uint64_t affinity) {
  // The exact prefix's blocks replace the transplant's first blocks: prefill imports them as
  // they are and never recomputes them (and jobs over one template share them).
  std::vector<uint8_t>& kv = a.kv;
  for (size_t b = 0; b < prefix.size() && (b + 1) * block_bytes_ <= kv.size(); ++b)
    std::copy(prefix[b]->begin(), prefix[b]->end(), kv.begin() + b * block_bytes_);
  flatbuffers::FlatBufferBuilder builder(512 + a.mask.size());
  std::vector<zmq::message_t> bulk;
  bulk.emplace_back(kv.data(), kv.size());
  auto frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
      wire::CreateBulkFrame(builder, kv.size(), wire::checksum(kv))});
  auto kv_layout = layout(builder, kv.size() / block_bytes_);
  auto mask = builder.CreateVector(a.mask);
  const wire::PlanLabels labels(builder, wire::ReuseLevel::Blend, wire::FinishReason::None,
                                a.outcome, a.shadow_mode);
  const auto took = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
  wire::ProbePlanBuilder plan(builder);
  plan.add_request_id(job.request_id());
  plan.add_attempt(job.attempt());
  labels.add_to(plan);
  plan.add_reused_tokens(static_cast<uint32_t>(prefix.size() * model::kBlockTokens));
  plan.add_probe_us(static_cast<uint32_t>(took.count()));
  plan.add_frames(frames);
  plan.add_layout(kv_layout);
  plan.add_prefix_key(affinity);
  plan.add_donor_key(a.donor);
  plan.add_similarity(a.similarity);
  plan.add_cell(a.cell);
  plan.add_blend_mask(mask);
  plan.add_recompute_fraction(static_cast<float>(recompute_fraction_));
  plan.add_shadow_sampled(a.sampled);
  builder.Finish(plan.Finish(), wire::PrefillJobIdentifier());
  router_.send_plan(job, wire::encode(wire::MessageType::ProbePlan, builder, std::move(bulk)));
}

// A full hit: what prefill would have answered, from the store.
bool ProbeAnswers::answer_full(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                               const model::SamplingParams& sampling,
                               const reuse::PromptRecord& prompt,
                               std::vector<reuse::Value> blocks) {
  const model::ModelConfig& cfg = model_.config();
  model::Sampler sampler(sampling);
  sampler.set_prompt(tokens);
  if (!model::constrain_sampler(sampler, sampling, model_.dir(), cfg.vocab_size, eos_).ok())
    return false;
  const int32_t first = sampler.sample(prompt.logits.data(), cfg.vocab_size);
  const wire::FinishReason finish =
      wire::parse_finish_reason(model::finish_after(first, 1, static_cast<int64_t>(tokens.size()),
                                                    sampling, eos_, cfg.max_position_embeddings))
          .value_or(wire::FinishReason::Stop);
  zmq::message_t kv;  // shared by the messages that carry it (zmq_msg_copy: no copy)
  uint64_t sum = 0;
  const bool goes_on = finish == wire::FinishReason::None;
  if (goes_on) {
    if (!prompt.tail_kv.empty())
      blocks.push_back(std::make_shared<const std::string>(prompt.tail_kv));
    kv = concatenate(blocks, sum);
  }
  const size_t kv_blocks = blocks.size();
  // The PrefillDone with the KV (for decode, or a gateway without routes) or without it.
  auto build = [&](bool with_kv, const flatbuffers::Vector<uint8_t>* ticket) {
    flatbuffers::FlatBufferBuilder builder(512 + tokens.size() * 4);
    std::vector<zmq::message_t> bulk;
    flatbuffers::Offset<wire::KvLayout> kv_layout = 0;
    flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
    if (with_kv && goes_on) {
      bulk.emplace_back().copy(kv);
      frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
          wire::CreateBulkFrame(builder, kv.size(), sum)});
      kv_layout = layout(builder, kv_blocks);
    }
    auto token_vector = with_kv ? builder.CreateVector(tokens) : 0;
    auto finish_text = builder.CreateString(wire::name(finish));
    auto sampling_offset = to_wire(builder, sampling);
    auto name_space =
        builder.CreateString(job.cache_namespace() ? job.cache_namespace()->str() : "");
    auto replica = builder.CreateString(replica_);
    auto level = builder.CreateString(wire::name(wire::ReuseLevel::Full));
    auto logprobs =
        logprobs_to_wire(builder, prompt.logits.data(), cfg.vocab_size, first, sampling);
    auto ticket_vector = ticket ? builder.CreateVector(ticket->data(), ticket->size()) : 0;
    builder.Finish(
        wire::CreatePrefillDone(
            builder, job.request_id(), job.attempt(), token_vector, first, finish_text,
            sampling_offset, name_space, kv_layout, frames, 0, replica, level,
            static_cast<uint32_t>(tokens.size()), 0, false, 0.0f, false, logprobs, ticket_vector,
            goes_on ? flatbuffers::Optional<wire::FinishReason>() : finish, wire::ReuseLevel::Full),
        wire::PrefillJobIdentifier());
    return wire::encode(wire::MessageType::PrefillDone, builder, std::move(bulk));
  };
  router_.send_done(job, goes_on, build);
  return true;
}

// A plan that needs a forward pass: the cached prefix's KV (if any) for prefill to continue from,
// and for a shadow of response reuse the donor's answer to compare with.
void ProbeAnswers::send_plan(const wire::ProbeJob& job, wire::ReuseLevel level,
                             const std::vector<reuse::Value>& blocks, uint64_t prefix_key,
                             const ApproximateResult& a, Clock::time_point start) {
  const size_t reused_blocks = blocks.size();
  flatbuffers::FlatBufferBuilder builder(256);
  std::vector<zmq::message_t> bulk;
  flatbuffers::Offset<wire::KvLayout> kv_layout = 0;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
  if (reused_blocks > 0) {
    uint64_t sum = 0;
    bulk.push_back(concatenate(blocks, sum));
    frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
        wire::CreateBulkFrame(builder, bulk.back().size(), sum)});
    kv_layout = layout(builder, reused_blocks);
  }
  const auto reused = static_cast<uint32_t>(reused_blocks * model::kBlockTokens);
  const auto took = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
  flatbuffers::Offset<flatbuffers::Vector<int32_t>> completion = 0;
  if (a.outcome == wire::ApproximateOutcome::Shadow)
    completion = builder.CreateVector(a.donor_result.tokens);
  const wire::PlanLabels labels(builder, level, wire::FinishReason::None, a.outcome, a.shadow_mode);
  wire::ProbePlanBuilder plan(builder);
  plan.add_request_id(job.request_id());
  plan.add_attempt(job.attempt());
  labels.add_to(plan);
  plan.add_reused_tokens(reused);
  plan.add_probe_us(static_cast<uint32_t>(took.count()));
  if (!frames.IsNull()) plan.add_frames(frames);
  if (!kv_layout.IsNull()) plan.add_layout(kv_layout);
  if (!completion.IsNull()) plan.add_completion(completion);
  plan.add_prefix_key(prefix_key);
  plan.add_donor_key(a.donor);
  plan.add_similarity(a.similarity);
  plan.add_cell(a.cell);
  plan.add_shadow_sampled(a.sampled);
  builder.Finish(plan.Finish(), wire::PrefillJobIdentifier());
  router_.send_plan(job, wire::encode(wire::MessageType::ProbePlan, builder, std::move(bulk)));
}

}  // namespace moeline::stages
