#include "stages/gateway/tenant_limits.h"

#include <algorithm>

namespace moeline::stages {

TenantLimiter::State& TenantLimiter::state(const std::string& tenant) {
  auto [it, added] = tenants_.try_emplace(tenant);
  State& s = it->second;
  if (added) {
    // Tenant names are bounded in length but not in number: the label set must not grow with
    // whatever names clients send.
    const std::string label = labelled_ < kMaxTenantLabels ? tenant : "other";
    labelled_ += label != "other";
    s.in_flight_gauge = &metrics_.gauge("moeline_gateway_tenant_in_flight_requests",
                                        "Requests in flight per tenant", {{"tenant", label}});
    s.admitted = &metrics_.counter("moeline_gateway_tenant_requests_total",
                                   "Requests per tenant by admission result",
                                   {{"tenant", label}, {"result", "admitted"}});
    s.refused = &metrics_.counter("moeline_gateway_tenant_requests_total",
                                  "Requests per tenant by admission result",
                                  {{"tenant", label}, {"result", "over_limit"}});
  }
  return s;
}

std::optional<std::string> TenantLimiter::admit(const std::string& tenant,
                                                const TenantLimits& limits, size_t prompt_tokens,
                                                double now_s) {
  State& s = state(tenant);
  if (limits.max_in_flight > 0 && s.in_flight >= limits.max_in_flight) {
    s.refused->inc();
    return "tenant '" + tenant + "' has " + std::to_string(s.in_flight) +
           " requests in flight (its limit is " + std::to_string(limits.max_in_flight) + ")";
  }
  if (limits.prompt_tokens_per_s > 0) {
    if (s.updated_s < 0) s.tokens = limits.prompt_tokens_per_s;
    if (s.updated_s >= 0)
      s.tokens = std::min(limits.prompt_tokens_per_s,
                          s.tokens + (now_s - s.updated_s) * limits.prompt_tokens_per_s);
    s.updated_s = now_s;
    // One prompt larger than a second's worth passes when the bucket is full, then the tenant
    // waits out the debt: a limit must not make a long prompt impossible.
    if (s.tokens <= 0) {
      s.refused->inc();
      return "tenant '" + tenant + "' is over its limit of " +
             std::to_string(static_cast<int64_t>(limits.prompt_tokens_per_s)) +
             " prompt tokens per second";
    }
    s.tokens -= static_cast<double>(prompt_tokens);
  }
  ++s.in_flight;
  s.admitted->inc();
  s.in_flight_gauge->set(s.in_flight);
  return std::nullopt;
}

void TenantLimiter::release(const std::string& tenant) {
  auto it = tenants_.find(tenant);
  if (it == tenants_.end() || it->second.in_flight == 0) return;
  --it->second.in_flight;
  it->second.in_flight_gauge->set(it->second.in_flight);
}

uint32_t TenantLimiter::in_flight(const std::string& tenant) const {
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second.in_flight;
}

}  // namespace moeline::stages
