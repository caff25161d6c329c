#pragma once
// Reads a PrefillJob into a Job, refusing what cannot run (the gateway validated the request, but
// nothing is trusted for arriving here): an empty or over-long prompt, token ids out of the
// vocabulary, invalid sampling. Reused KV that does not fit this replica exactly — a prefix's or a
// blend's — is not refused but dropped: the job is computed in full, never from KV it cannot trust.

#include <cstdint>

#include "base/status.h"
#include "stages/common/worker.h"
#include "stages/prefill/job.h"
#include "stages/prefill/prefill_metrics.h"

namespace moeline::stages::prefill {

class JobIntake {
 public:
  JobIntake(ComputeWorker& worker, PrefillMetrics& metrics, int64_t context)
      : worker_(worker), metrics_(metrics), context_(context) {}

  // The job, with its reused KV moved out of `message`; an error (InvalidArgument) for a job that
  // cannot run.
  Expected<Job> read(wire::Message& message);

 private:
  void accept_prefix(const wire::PrefillJob& wire_job, wire::Message& message, Job& job);
  void accept_blend(const wire::PrefillJob& wire_job, wire::Message& message, Job& job);

  ComputeWorker& worker_;
  PrefillMetrics& metrics_;
  int64_t context_;
};

}  // namespace moeline::stages::prefill
