// The gateway's reuse policy without a gateway: namespaces, the levels a request may use, an
// operator's changes, and approximate reuse's guards (controller, shadow checks, feedback).
#include "reuse/policy.h"

#include <gtest/gtest.h>

#include <vector>

namespace moeline::reuse {
namespace {

ReusePolicy make_policy(uint32_t default_levels = kAllLevels, bool approximate = true,
                        RollbackOptions rollback = {}) {
  PolicySettings settings;
  settings.default_levels = default_levels;
  settings.shared_tenants = {"docs", "wiki"};
  settings.rollback = rollback;
  settings.approximate_enabled = approximate;
  settings.shadow_tokens = 3;
  settings.remembered_answers = 2;
  return ReusePolicy(settings, 0);
}

TEST(ReusePolicy, RequestedLevelsNameEveryKnownValueAndRefuseOthers) {
  EXPECT_EQ(ReusePolicy::requested_levels(""), kExactLevels);
  EXPECT_EQ(ReusePolicy::requested_levels("exact"), kExactLevels);
  EXPECT_EQ(ReusePolicy::requested_levels("none"), 0u);
  EXPECT_EQ(ReusePolicy::requested_levels("approximate"), kAllLevels);
  EXPECT_EQ(ReusePolicy::requested_levels("response"), kExactLevels | kResponse);
  EXPECT_EQ(ReusePolicy::requested_levels("blend"), kExactLevels | kBlend);
  EXPECT_EQ(ReusePolicy::requested_levels("Exact"), std::nullopt);
  EXPECT_EQ(ReusePolicy::requested_levels("prefix"), std::nullopt);
}

TEST(ReusePolicy, NamespacesComeFromTheTenantNeverFromTheClient) {
  ReusePolicy policy = make_policy();
  EXPECT_EQ(policy.namespace_of("acme"), "tenant:acme");
  EXPECT_EQ(policy.namespace_of("docs"), "shared");
  EXPECT_EQ(policy.namespace_of("wiki"), "shared");
  // A tenant named like a namespace is still only its own.
  EXPECT_EQ(policy.namespace_of("shared"), "tenant:shared");
}

TEST(ReusePolicy, ARequestGetsWhatItAskedForWithinItsNamespace) {
  ReusePolicy policy = make_policy(kExactLevels);
  Admission a = policy.admit("acme", kExactLevels, true, false);
  EXPECT_EQ(a.cache_namespace, "tenant:acme");
  EXPECT_EQ(a.namespace_levels, kExactLevels);
  EXPECT_EQ(a.allowed_levels, kExactLevels);
  EXPECT_TRUE(a.approximate_refused.empty());
  EXPECT_EQ(policy.admit("acme", 0, true, false).allowed_levels, 0u);
}

TEST(ReusePolicy, ReplayedAnswersOnlyForDeterministicRequestsWithoutLogprobs) {
  ReusePolicy policy = make_policy();
  const uint32_t asked = kAllLevels;
  EXPECT_EQ(policy.admit("acme", asked, true, false).allowed_levels, kAllLevels);
  const uint32_t no_replay = kAllLevels & ~uint32_t{kResult | kResponse};
  EXPECT_EQ(policy.admit("acme", asked, false, false).allowed_levels, no_replay);
  EXPECT_EQ(policy.admit("acme", asked, true, true).allowed_levels, no_replay);
  // Not a refusal of approximate reuse: blending still applies.
  EXPECT_TRUE(policy.admit("acme", asked, false, false).approximate_refused.empty());
}

TEST(ReusePolicy, ApproximateReuseIsRefusedWhereNotAllowedOrSwitchedOff) {
  ReusePolicy exact_only = make_policy(kExactLevels);
  Admission a = exact_only.admit("acme", kAllLevels, true, false);
  EXPECT_EQ(a.approximate_refused, "not_allowed");
  EXPECT_EQ(a.allowed_levels, kExactLevels);

  ReusePolicy off = make_policy(kAllLevels, false);
  EXPECT_FALSE(off.controller().enabled());
  EXPECT_EQ(off.controller().reason(), "configured_off");
  a = off.admit("acme", kAllLevels, true, false);
  EXPECT_EQ(a.approximate_refused, "disabled");
  EXPECT_EQ(a.allowed_levels, kExactLevels);
  // Exact reuse asked for alone is not an approximate refusal.
  EXPECT_TRUE(off.admit("acme", kExactLevels, true, false).approximate_refused.empty());

  EXPECT_TRUE(off.set_enabled(10, true));
  EXPECT_FALSE(off.set_enabled(11, true));  // no change
  EXPECT_EQ(off.controller().reason(), "operator");
  EXPECT_EQ(off.admit("acme", kAllLevels, true, false).allowed_levels, kAllLevels);
}

TEST(ReusePolicy, AnOperatorSetsOneTenantOrEveryTenant) {
  ReusePolicy policy = make_policy(kExactLevels);
  policy.set_levels("acme", kPrefix);
  policy.set_levels("docs", kAllLevels);
  EXPECT_EQ(policy.admit("acme", kAllLevels, true, false).allowed_levels, kPrefix);
  EXPECT_EQ(policy.admit("wiki", kAllLevels, true, false).allowed_levels, kAllLevels)
      << "a shared tenant's levels are the shared namespace's";
  EXPECT_EQ(policy.admit("other", kAllLevels, true, false).allowed_levels, kExactLevels);
  EXPECT_EQ(policy.namespace_levels().size(), 2u);
  policy.set_levels("*", kFull);
  EXPECT_EQ(policy.default_levels(), kFull);
  EXPECT_TRUE(policy.namespace_levels().empty()) << "the default replaces per-tenant levels";
  EXPECT_EQ(policy.admit("acme", kAllLevels, true, false).allowed_levels, kFull);
}

TEST(ReusePolicy, ShadowAnswersAgreeOnTheirFirstTokens) {
  ReusePolicy policy = make_policy();  // compares 3 tokens
  const std::vector<int32_t> donor = {5, 6, 7, 8};
  EXPECT_TRUE(policy.same_answer(std::vector<int32_t>{5, 6, 7, 9}, donor));
  EXPECT_FALSE(policy.same_answer(std::vector<int32_t>{5, 6, 1}, donor));
  EXPECT_FALSE(policy.same_answer(std::vector<int32_t>{5, 6}, donor)) << "a shorter answer";
  EXPECT_TRUE(policy.same_answer(std::vector<int32_t>{5, 6}, std::vector<int32_t>{5, 6}));
  EXPECT_FALSE(policy.same_answer({}, donor));
}

TEST(ReusePolicy, OnlySampledShadowChecksReachTheController) {
  RollbackOptions rollback;
  rollback.min_checks = 4;
  rollback.agreement_window_s = 100;
  ReusePolicy policy = make_policy(kAllLevels, true, rollback);
  for (int i = 0; i < 10; ++i) policy.on_shadow(1, false, false);
  EXPECT_FALSE(policy.controller().agreement(1).has_value()) << "unsampled checks count";
  for (int i = 0; i < 4; ++i) policy.on_shadow(2, true, true);
  ASSERT_TRUE(policy.controller().agreement(2).has_value());
  EXPECT_DOUBLE_EQ(*policy.controller().agreement(2), 1.0);
}

TEST(ReusePolicy, LookupsThatServeNothingRollApproximateReuseBack) {
  RollbackOptions rollback;
  rollback.min_lookups = 5;
  rollback.min_hit_rate = 0.5;
  rollback.hit_window_s = 10;
  ReusePolicy policy = make_policy(kAllLevels, true, rollback);
  for (int i = 0; i < 4; ++i) policy.on_lookup(11, "no_candidate");
  policy.on_lookup(11, "blend");  // one served of five: under half
  EXPECT_FALSE(policy.update(5)) << "judged only once a whole window has passed";
  EXPECT_TRUE(policy.update(12));
  EXPECT_FALSE(policy.controller().enabled());
  EXPECT_EQ(policy.controller().reason(), "low_hit_rate");
  EXPECT_EQ(policy.admit("acme", kAllLevels, true, false).approximate_refused, "disabled");
}

TEST(ReusePolicy, FeedbackCountsOnlyForAnswersApproximateReuseServed) {
  ReusePolicy policy = make_policy();
  EXPECT_EQ(policy.on_feedback(1, "client-a", 7, -1), std::nullopt);
  policy.served_approximately("client-a", 7);
  EXPECT_EQ(policy.on_feedback(1, "client-b", 7, -1), std::nullopt) << "another client's id";
  EXPECT_EQ(policy.on_feedback(1, "client-a", 7, -1), std::optional<bool>(true));
  EXPECT_EQ(policy.on_feedback(1, "client-a", 7, 0.5f), std::optional<bool>(false));
  // Remembers the last 2 answers: the oldest is forgotten.
  policy.served_approximately("client-a", 8);
  policy.served_approximately("client-a", 8);  // once is enough
  policy.served_approximately("client-a", 9);
  EXPECT_EQ(policy.on_feedback(1, "client-a", 7, -1), std::nullopt);
  EXPECT_TRUE(policy.on_feedback(1, "client-a", 8, -1).has_value());
  EXPECT_TRUE(policy.on_feedback(1, "client-a", 9, -1).has_value());
}

}  // namespace
}  // namespace moeline::reuse
