#pragma once
// What leaves prefill for a job: its PrefillDone (to the gateway, and with the prompt's KV straight
// to the decode replica the gateway picked), its snapshot puts (straight to the probe that owns the
// namespace), or a JobFailed.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "reuse/signature.h"
#include "stages/common/worker.h"
#include "stages/prefill/job.h"
#include "stages/prefill/prefill_metrics.h"

namespace moeline::stages::prefill {

struct PrefillResult {
  int32_t first;
  std::string finish;  // "" while the sequence goes on, "stop" or "length"
  double forward_seconds;
  const float* logits;
  // Where the job asked (SamplingParams::prompt_logprobs): one per prompt token after the first.
  const std::vector<model::TokenLogprobs>* prompt_logprobs = nullptr;
};

class JobResults {
 public:
  JobResults(ComputeWorker& worker, PrefillMetrics& metrics,
             reuse::SignatureAccumulator& signatures)
      : worker_(worker), metrics_(metrics), signatures_(signatures) {}

  // Finished at its first token, or without a decode route (`moeline load`, an older gateway):
  // the PrefillDone goes to the hub, with the KV when the sequence goes on. Otherwise the gateway
  // hears first (it streams the first token and expects the decode replica), then the KV goes
  // straight to that replica with the ticket the gateway signed for it. False when that replica
  // did not take it (the job has failed: the gateway retries it).
  bool deliver(const Job& job, const PrefillResult& result,
               const std::shared_ptr<std::vector<uint8_t>>& exported);
  // The prompt's new blocks, its record and signature, as the job's store levels allow, from
  // the prompt's exported KV (`exported`) and first-token logits.
  void put_snapshots(const Job& job, uint64_t sequence_id,
                     const std::shared_ptr<std::vector<uint8_t>>& exported, const float* logits);
  void fail(const Job& job, wire::ErrorCode code, const std::string& text);

 private:
  // The PrefillDone of a job: with the prompt's KV (`exported`) when it is the hand-over to
  // decode (signed with `ticket`) or goes back to a hub without a decode route.
  std::vector<zmq::message_t> prefill_done(const Job& job, const PrefillResult& result,
                                           const std::shared_ptr<std::vector<uint8_t>>& exported,
                                           const std::vector<uint8_t>* ticket);

  ComputeWorker& worker_;
  PrefillMetrics& metrics_;
  reuse::SignatureAccumulator& signatures_;
};

}  // namespace moeline::stages::prefill
