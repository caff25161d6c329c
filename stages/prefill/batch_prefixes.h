#pragma once
// The reused KV of one prefill batch: each job's sequence starts holding its cached prefix (or its
// blend's exact prefix), imported into the cache a run of blocks at a time. Jobs of one batch that
// reuse the same prefix — exact prefix hits, blends from one donor over one template — share its
// blocks; the batch holds a reference to each until it ends (the destructor gives them back).

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/kv_cache.h"
#include "stages/common/worker.h"
#include "stages/prefill/job.h"

namespace moeline::stages::prefill {

class BatchPrefixes {
 public:
  BatchPrefixes(ComputeWorker& worker, uint64_t& next_sequence_id)
      : worker_(worker), next_sequence_id_(next_sequence_id) {}
  ~BatchPrefixes();
  BatchPrefixes(const BatchPrefixes&) = delete;
  BatchPrefixes& operator=(const BatchPrefixes&) = delete;

  // A new sequence for `job` holding its reused prefix's KV; null when the cache has no block
  // left or the import failed, and then import_error() says why (empty: for want of blocks).
  std::unique_ptr<model::Sequence> start(const Job& job);
  const std::string& import_error() const { return import_error_; }

 private:
  ComputeWorker& worker_;
  uint64_t& next_sequence_id_;
  std::unordered_map<uint64_t, int32_t> shared_;  // block key -> block
  std::vector<int32_t> held_;
  std::string import_error_;
};

}  // namespace moeline::stages::prefill
