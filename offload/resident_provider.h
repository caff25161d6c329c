#pragma once
// Every expert resident where the checkpoint is mapped: acquire() is a table lookup and release()
// does nothing. The table is built by the model loader; layers without experts have empty rows.

#include <vector>

#include "offload/expert_provider.h"

namespace moeline::offload {

class ResidentExpertProvider final : public ExpertProvider {
 public:
  explicit ResidentExpertProvider(std::vector<std::vector<ExpertWeights>> experts);

  int layers() const override { return static_cast<int>(experts_.size()); }
  int experts_per_layer() const override { return experts_per_layer_; }
  ExpertWeights acquire(int layer, int expert) override;
  void release(int layer, int expert) override;

 private:
  std::vector<std::vector<ExpertWeights>> experts_;
  int experts_per_layer_ = 0;
};

}  // namespace moeline::offload
