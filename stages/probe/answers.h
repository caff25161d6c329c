#pragma once
// The probe's answers to a ProbeJob, encoded and sent through the PlanRouter (to prefill's
// intake, decode's, or the gateway): a finished completion to replay (result, or response reuse),
// a full hit's first token and KV, a blend's KV and mask, or a plan with the cached prefix's KV.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "model/kv_cache.h"
#include "model/model.h"
#include "reuse/records.h"
#include "reuse/snapshot_store.h"
#include "schemas/wire.h"
#include "stages/probe/approximate_lookup.h"
#include "stages/probe/routing.h"
#include "stages/runtime/link.h"

namespace moeline::stages {

class ProbeAnswers {
 public:
  using Clock = std::chrono::steady_clock;

  ProbeAnswers(const model::Model& model, PlanRouter& router, runtime::HubLink& link,
               std::string replica, double recompute_fraction)
      : model_(model),
        router_(router),
        link_(link),
        replica_(std::move(replica)),
        recompute_fraction_(recompute_fraction),
        block_bytes_(model::KvCache::bytes_per_token(model.config()) * model::kBlockTokens) {
    for (int64_t eos : model.config().eos_token_ids) eos_.push_back(static_cast<int32_t>(eos));
  }

  // `approximate`: response reuse (the donor's answer), else the prompt's own result.
  void answer_result(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                     const reuse::ResultRecord& result,
                     const ApproximateResult* approximate = nullptr);
  // False where the request's structured output cannot be set up here (the job then goes on).
  bool answer_full(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                   const model::SamplingParams& sampling, const reuse::PromptRecord& prompt,
                   std::vector<reuse::Value> blocks);
  // `prefix`: the exact prefix's blocks; `affinity`: the key that sends related jobs to one
  // prefill replica.
  void send_blend(const wire::ProbeJob& job, ApproximateResult& a, Clock::time_point start,
                  const std::vector<reuse::Value>& prefix, uint64_t affinity);
  // `level`: Prefix (with `blocks`) or None; `prefix_key`: the last reused block's key.
  void send_plan(const wire::ProbeJob& job, wire::ReuseLevel level,
                 const std::vector<reuse::Value>& blocks, uint64_t prefix_key,
                 const ApproximateResult& a, Clock::time_point start);

 private:
  flatbuffers::Offset<wire::KvLayout> layout(flatbuffers::FlatBufferBuilder& builder,
                                             size_t blocks) const;

  const model::Model& model_;
  PlanRouter& router_;
  runtime::HubLink& link_;
  std::string replica_;
  double recompute_fraction_;
  size_t block_bytes_;
  std::vector<int32_t> eos_;
};

}  // namespace moeline::stages
