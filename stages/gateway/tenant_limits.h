#pragma once
// Fair shares between tenants at the gateway's intake: a cap on each tenant's requests in flight
// and a token bucket on the prompt tokens it may submit per second. A tenant over either limit is
// answered Overloaded; the others are served as before. Metrics per tenant (bounded: past
// kMaxTenantLabels distinct tenants, the rest are counted under "other").
//
// Not thread-safe: the gateway's loop owns it.

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "stages/runtime/metrics.h"

namespace moeline::stages {

struct TenantLimits {
  uint32_t max_in_flight = 0;      // 0: no limit
  double prompt_tokens_per_s = 0;  // 0: no limit; the bucket holds one second's worth
};

inline constexpr size_t kMaxTenantLabels = 256;

class TenantLimiter {
 public:
  explicit TenantLimiter(runtime::Registry& metrics) : metrics_(metrics) {}
  // Admits one request of `prompt_tokens` (counted in flight until release()), or says why not.
  std::optional<std::string> admit(const std::string& tenant, const TenantLimits& limits,
                                   size_t prompt_tokens, double now_s);
  void release(const std::string& tenant);
  uint32_t in_flight(const std::string& tenant) const;

 private:
  struct State {
    uint32_t in_flight = 0;
    double tokens = 0;  // the bucket; may go below 0 after a prompt larger than a second's worth
    double updated_s = -1;
    runtime::Gauge* in_flight_gauge = nullptr;
    runtime::Counter *admitted = nullptr, *refused = nullptr;
  };
  State& state(const std::string& tenant);

  runtime::Registry& metrics_;
  std::map<std::string, State> tenants_;
  size_t labelled_ = 0;
};

}  // namespace moeline::stages
