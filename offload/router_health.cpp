#include "offload/router_health.h"

#include <cmath>
#include <cstdio>

namespace moeline::offload {

const char* health_state_name(HealthState state) {
  switch (state) {
    case HealthState::kOk:
      return "ok";
    case HealthState::kWarning:
      return "warning";
    case HealthState::kCritical:
      return "critical";
  }
  return "?";
}

double LayerHealth::imbalance() const {
  if (counts.empty()) return 0;
  double mean = 0;
  for (double c : counts) mean += c;
  mean /= static_cast<double>(counts.size());
  if (mean <= 0) return 0;
  double variance = 0;
  for (double c : counts) variance += (c - mean) * (c - mean);
  variance /= static_cast<double>(counts.size());
  return std::sqrt(variance) / mean;
}

RouterHealth::RouterHealth(int layers, int experts, RouterHealthOptions options)
    : options_(options), experts_(experts), layers_(static_cast<size_t>(layers)) {
  for (LayerHealth& layer : layers_) layer.counts.assign(static_cast<size_t>(experts), 0.0);
}

std::vector<int> RouterHealth::add(std::span<const uint64_t> counts,
                                   std::span<const uint64_t> layer_tokens,
                                   std::span<const double> confidence_sum,
                                   std::span<const double> router_seconds) {
  std::vector<int> changed;
  const double d = options_.decay;
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerHealth& h = layers_[l];
    uint64_t routed = 0;
    for (size_t e = 0; e < h.counts.size(); ++e) {
      const size_t i = l * h.counts.size() + e;
      const uint64_t c = i < counts.size() ? counts[i] : 0;
      h.counts[e] = h.counts[e] * d + static_cast<double>(c);
      routed += c;
    }
    if (routed == 0 && (l >= layer_tokens.size() || layer_tokens[l] == 0)) continue;  // no MoE
    const uint64_t tokens = l < layer_tokens.size() ? layer_tokens[l] : 0;
    h.tokens = h.tokens * d + static_cast<double>(tokens);
    h.confidence_sum = h.confidence_sum * d + (l < confidence_sum.size() ? confidence_sum[l] : 0.0);
    const double seconds = l < router_seconds.size() ? router_seconds[l] : 0.0;
    h.router_seconds = h.router_seconds * d + seconds;
    h.total_tokens += tokens;
    h.total_router_seconds += seconds;

    HealthState state = HealthState::kOk;
    std::string reason;
    double seen = 0;
    for (double c : h.counts) seen += c;
    if (seen >= options_.min_tokens) {
      // A state already held is kept until its measure clears the threshold by the hysteresis.
      const double lower = 1 - options_.hysteresis, raise = 1 + options_.hysteresis;
      const double critical =
          options_.imbalance_critical * (h.state == HealthState::kCritical ? lower : 1);
      const double warning = options_.imbalance_warning * (h.state != HealthState::kOk ? lower : 1);
      const double confident =
          options_.confidence_warning * (h.state != HealthState::kOk ? raise : 1);
      char text[96];
      const double imbalance = h.imbalance();
      if (imbalance >= critical) {
        state = HealthState::kCritical;
        std::snprintf(text, sizeof(text), "imbalance %.2f >= %.2f", imbalance, critical);
        reason = text;
      } else if (imbalance >= warning) {
        state = HealthState::kWarning;
        std::snprintf(text, sizeof(text), "imbalance %.2f >= %.2f", imbalance, warning);
        reason = text;
      }
      if (h.tokens >= options_.min_tokens && h.confidence() < confident) {
        if (state == HealthState::kOk) state = HealthState::kWarning;
        std::snprintf(text, sizeof(text), "%sconfidence %.2f < %.2f", reason.empty() ? "" : "; ",
                      h.confidence(), confident);
        reason += text;
      }
    }
    if (state != h.state) changed.push_back(static_cast<int>(l));
    h.state = state;
    h.reason = reason;
  }
  return changed;
}

}  // namespace moeline::offload
