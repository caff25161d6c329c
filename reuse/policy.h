#pragma once
// The reuse policy a gateway applies: which levels of reuse each request may use (the levels of
// its tenant's namespace, what the request asked for, whether its answer can be replayed), the
// operator's changes to those levels, and approximate reuse's guards: the rollback controller,
// the shadow checks' agreement and the feedback on answers approximate reuse served. No sockets,
// no metrics: the gateway asks, and counts what the answers say.

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reuse/approximate.h"
#include "reuse/records.h"

namespace moeline::reuse {

struct PolicySettings {
  uint32_t default_levels = kExactLevels;  // --reuse-levels
  // Tenants that reuse each other's work (one namespace, "shared"); every other tenant has its
  // own ("tenant:NAME").
  std::vector<std::string> shared_tenants;
  RollbackOptions rollback;
  bool approximate_enabled = true;    // off: as if an operator had switched it off
  size_t shadow_tokens = 16;          // response reuse's shadow compares this many first tokens
  size_t remembered_answers = 65536;  // approximately served answers feedback may name
};

// What the policy decides for one request when the gateway takes it in.
struct Admission {
  std::string cache_namespace;
  uint32_t namespace_levels = 0;  // what the namespace allows (prefill stores for these)
  uint32_t allowed_levels = 0;    // what this request may use
  // Set when the request asked for approximate reuse and may not use it: "not_allowed" (its
  // namespace does not allow it) or "disabled" (the rollback controller or an operator).
  std::string approximate_refused;
};

class ReusePolicy {
 public:
  ReusePolicy(PolicySettings settings, double now_s);

  // What a request's `reuse` field opts into: "" or "exact", "none", "approximate", "response",
  // "blend"; nullopt for anything else.
  static std::optional<uint32_t> requested_levels(std::string_view reuse);

  // The namespace a tenant's cache entries live in: derived here, never named by a client.
  std::string namespace_of(const std::string& tenant) const;
  // `deterministic`: greedy, or a seed the client chose (a result can be replayed);
  // `logprobs`: the request wants log-probabilities (a replayed answer has none).
  Admission admit(const std::string& tenant, uint32_t asked, bool deterministic,
                  bool logprobs) const;

  // An operator's change, effective for the next request: one tenant's levels, or ("*") the
  // default for every tenant (forgetting per-tenant levels).
  void set_levels(const std::string& tenant, uint32_t levels);
  uint32_t default_levels() const { return default_levels_; }
  // Namespace -> levels an operator set.
  const std::map<std::string, uint32_t>& namespace_levels() const { return namespace_levels_; }
  const std::vector<std::string>& shared_tenants() const { return settings_.shared_tenants; }

  // Approximate reuse's switch. `update` evaluates the controller's triggers (true when it turned
  // approximate reuse on or off); `set_enabled` is an operator's switch (true when it changed).
  RollbackController& controller() { return controller_; }
  bool update(double now_s) { return controller_.update(now_s); }
  bool set_enabled(double now_s, bool enabled);

  // A probe looked up a request that asked for approximate reuse: `outcome` is what it did
  // ("response" and "blend" serve an approximate answer).
  void on_lookup(double now_s, const std::string& outcome);
  // A shadow check's result; `sampled`: of a hit the decision rule would have served (only those
  // say something about what is served: checks of unproven candidates fail often by design).
  void on_shadow(double now_s, bool sampled, bool agreed);
  // Response reuse's shadow: do the full computation's first tokens equal the donor's answer?
  bool same_answer(std::span<const int32_t> computed, std::span<const int32_t> donor) const;

  // An answer approximate reuse served to (client, client_request_id), which feedback may name.
  void served_approximately(const std::string& client, uint64_t client_request_id);
  // Feedback on a client's request: nullopt unless approximate reuse served it; else whether it
  // was negative (and counted by the controller).
  std::optional<bool> on_feedback(double now_s, const std::string& client,
                                  uint64_t client_request_id, float score);

 private:
  using Answer = std::pair<std::string, uint64_t>;
  PolicySettings settings_;
  uint32_t default_levels_;
  std::map<std::string, uint32_t> namespace_levels_;
  RollbackController controller_;
  std::set<Answer> served_;
  std::deque<Answer> served_order_;  // oldest first, to forget past remembered_answers
};

}  // namespace moeline::reuse
