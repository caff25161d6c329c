#include "reuse/policy.h"

#include <algorithm>

namespace moeline::reuse {

ReusePolicy::ReusePolicy(PolicySettings settings, double now_s)
    : settings_(std::move(settings)),
      default_levels_(settings_.default_levels),
      controller_(settings_.rollback, now_s) {
  if (!settings_.approximate_enabled) controller_.set_enabled(now_s, false, "configured_off");
}

std::optional<uint32_t> ReusePolicy::requested_levels(std::string_view reuse) {
  if (reuse.empty() || reuse == "exact") return kExactLevels;
  if (reuse == "none") return 0u;
  if (reuse == "approximate") return kAllLevels;
  if (reuse == "response") return kExactLevels | kResponse;
  if (reuse == "blend") return kExactLevels | kBlend;
  return std::nullopt;
}

std::string ReusePolicy::namespace_of(const std::string& tenant) const {
  const auto& shared = settings_.shared_tenants;
  return std::find(shared.begin(), shared.end(), tenant) != shared.end() ? "shared"
                                                                         : "tenant:" + tenant;
}

Admission ReusePolicy::admit(const std::string& tenant, uint32_t asked, bool deterministic,
                             bool logprobs) const {
  Admission out;
  out.cache_namespace = namespace_of(tenant);
  auto it = namespace_levels_.find(out.cache_namespace);
  out.namespace_levels = it == namespace_levels_.end() ? default_levels_ : it->second;
  out.allowed_levels = out.namespace_levels & asked;
  // A replayed completion is one sample of the request's distribution (the client must have
  // fixed it) and has no log-probabilities to report.
  if (!deterministic || logprobs) out.allowed_levels &= ~uint32_t{kResult | kResponse};
  if (asked & kApproximateLevels) {
    if (!(out.namespace_levels & asked & kApproximateLevels))
      out.approximate_refused = "not_allowed";
    else if (!controller_.enabled())
      out.approximate_refused = "disabled";
    if (!out.approximate_refused.empty()) out.allowed_levels &= ~kApproximateLevels;
  }
  return out;
}

void ReusePolicy::set_levels(const std::string& tenant, uint32_t levels) {
  if (tenant == "*") {
    default_levels_ = levels;
    namespace_levels_.clear();
    return;
  }
  namespace_levels_[namespace_of(tenant)] = levels;
}

bool ReusePolicy::set_enabled(double now_s, bool enabled) {
  if (enabled == controller_.enabled()) return false;
  controller_.set_enabled(now_s, enabled, "operator");
  return true;
}

void ReusePolicy::on_lookup(double now_s, const std::string& outcome) {
  controller_.on_lookup(now_s, outcome == "response" || outcome == "blend");
}

void ReusePolicy::on_shadow(double now_s, bool sampled, bool agreed) {
  if (sampled) controller_.on_shadow(now_s, agreed);
}

bool ReusePolicy::same_answer(std::span<const int32_t> computed,
                              std::span<const int32_t> donor) const {
  const size_t n = std::min(settings_.shadow_tokens, std::max(computed.size(), donor.size()));
  for (size_t i = 0; i < n; ++i)
    if (i >= computed.size() || i >= donor.size() || computed[i] != donor[i]) return false;
  return true;
}

void ReusePolicy::served_approximately(const std::string& client, uint64_t client_request_id) {
  if (!served_.insert({client, client_request_id}).second) return;
  served_order_.push_back({client, client_request_id});
  while (served_order_.size() > settings_.remembered_answers) {
    served_.erase(served_order_.front());
    served_order_.pop_front();
  }
}

std::optional<bool> ReusePolicy::on_feedback(double now_s, const std::string& client,
                                             uint64_t client_request_id, float score) {
  if (!served_.count({client, client_request_id})) return std::nullopt;
  const bool negative = score < 0;
  controller_.on_feedback(now_s, negative);
  return negative;
}

}  // namespace moeline::reuse
