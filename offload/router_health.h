#pragma once
// Router health from the router observers' reports (stages/README.md, "Metrics"): per layer, the
// tokens each expert received, the load-imbalance index (std/mean of those counts), the router's
// confidence (mean over tokens of ln(top-1 / top-2 probability), the gap of the two logits) and the
// router's time. Counts decay by `decay` per report, so the state follows the recent traffic
// (about 1 / (1 - decay) reports) rather than everything since start.
//
// A layer is critical when its imbalance reaches `imbalance_critical`; a warning when it reaches
// `imbalance_warning` or its confidence falls below `confidence_warning`. Skewed routing makes a
// few experts hot (offload helps, one expert's compute becomes the bottleneck); low confidence
// means routing flips on small changes (prefetch predictions and reuse signatures degrade). A state
// is entered at its threshold and left only once the measure has cleared it by `hysteresis` (a
// share of the threshold), so that a layer hovering at one does not flip, and log, every report.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moeline::offload {

struct RouterHealthOptions {
  double imbalance_warning = 0.4;
  double imbalance_critical = 0.5;
  double confidence_warning = 1.5;
  double decay = 0.95;
  double min_tokens = 64;  // a layer is judged once this many (decayed) tokens were seen
  double hysteresis = 0.1;
};

enum class HealthState : uint8_t { kOk, kWarning, kCritical };
const char* health_state_name(HealthState state);

struct LayerHealth {
  std::vector<double> counts;                                 // decayed tokens per expert
  double tokens = 0, confidence_sum = 0, router_seconds = 0;  // decayed
  uint64_t total_tokens = 0;
  double total_router_seconds = 0;
  double imbalance() const;
  double confidence() const { return tokens > 0 ? confidence_sum / tokens : 0.0; }
  HealthState state = HealthState::kOk;
  std::string reason;  // why not ok
};

class RouterHealth {
 public:
  RouterHealth(int layers, int experts, RouterHealthOptions options);
  // One report: counts [layers * experts]; the rest per layer (may be empty: an older peer).
  // Returns the layers whose state changed.
  std::vector<int> add(std::span<const uint64_t> counts, std::span<const uint64_t> layer_tokens,
                       std::span<const double> confidence_sum,
                       std::span<const double> router_seconds);
  const std::vector<LayerHealth>& layers() const { return layers_; }
  const RouterHealthOptions& options() const { return options_; }
  int experts() const { return experts_; }

 private:
  RouterHealthOptions options_;
  int experts_;
  std::vector<LayerHealth> layers_;
};

}  // namespace moeline::offload
