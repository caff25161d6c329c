#include "stages/prefill/batch_prefixes.h"

#include <algorithm>
#include <optional>
#include <span>

#include "reuse/records.h"

namespace moeline::stages::prefill {

BatchPrefixes::~BatchPrefixes() {
  for (int32_t block : held_) worker_.forward->blocks().release(block);
}

std::unique_ptr<model::Sequence> BatchPrefixes::start(const Job& job) {
  import_error_.clear();
  model::BlockPool& pool = worker_.forward->blocks();
  const uint64_t ns = model::namespace_id(job.cache_namespace);
  auto sequence =
      std::make_unique<model::Sequence>(next_sequence_id_++, worker_.model->model_id(), ns);
  if (job.reused == 0) return sequence;
  const std::span<const int32_t> prefix(job.tokens.data(), job.reused);
  // A blend's frame starts with its exact prefix's blocks.
  const auto* source = static_cast<const uint8_t*>(job.blend_kv.size() > 0 ? job.blend_kv.data()
                                                                           : job.prefix_kv.data());
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
      std::erase_if(shared_, [&](const auto& entry) {
        return std::find(run.begin(), run.end(), entry.second) != run.end();
      });
      import_error_ = imported.error().message;
    }
    run.clear();
    return imported.ok();
  };
  auto abandon = [&] {
    sequence->release(pool);
    return std::unique_ptr<model::Sequence>();
  };
  for (size_t b = 0; b < chain.size(); ++b) {
    if (auto it = shared_.find(chain[b]); it != shared_.end()) {
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
    held_.push_back(*block);
    shared_[chain[b]] = *block;
  }
  if (!flush()) return abandon();
  sequence->commit(prefix);
  return sequence;
}

}  // namespace moeline::stages::prefill
