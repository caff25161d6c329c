// The guards of approximate reuse: the kind of difference between two prompts, the decision
// rule's error bound, the rollback controller's triggers, and token alignment.
#include "reuse/approximate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

namespace moeline::reuse {
namespace {

// A toy vocabulary: token id -> text (spaces lead, as byte-level BPE decodes them).
const std::map<int32_t, std::string> kVocab = {
    {1, "What"}, {2, " is"},    {3, " the"}, {4, " capital"}, {5, " of"},    {6, " France"},
    {7, "?"},    {8, " Spain"}, {9, " not"}, {10, " 12"},     {11, " 13"},   {12, "what"},
    {13, " ?"},  {14, " city"}, {15, "!"},   {16, " isn't"},  {17, " river"}};

std::string text_of(int32_t token) {
  return kVocab.at(token);
}

DifferenceKind kind(std::vector<int32_t> a, std::vector<int32_t> b) {
  return classify_difference(a, b, text_of);
}

TEST(ClassifyDifference, NamesEachKind) {
  EXPECT_EQ(kind({1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5, 6, 7}), DifferenceKind::kNone);
  // Case and spacing only.
  EXPECT_EQ(kind({1, 2, 3, 4, 5, 6, 7}, {12, 2, 3, 4, 5, 6, 13}), DifferenceKind::kFormat);
  EXPECT_EQ(kind({1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5, 6, 15}), DifferenceKind::kFormat);
  EXPECT_EQ(kind({1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5, 8, 7}), DifferenceKind::kName);
  EXPECT_EQ(kind({1, 2, 3, 4, 5, 6, 7}, {1, 2, 9, 3, 4, 5, 6, 7}), DifferenceKind::kNegation);
  EXPECT_EQ(kind({1, 2, 3, 4, 5, 6, 7}, {1, 16, 3, 4, 5, 6, 7}), DifferenceKind::kNegation);
  EXPECT_EQ(kind({1, 2, 10, 7}, {1, 2, 11, 7}), DifferenceKind::kNumber);
  EXPECT_EQ(kind({1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 14, 5, 6, 7}), DifferenceKind::kContent);
  // A number outranks everything else that differs.
  EXPECT_EQ(kind({1, 2, 10, 6}, {1, 9, 11, 8}), DifferenceKind::kNumber);
}

TEST(ChangedFraction, CountsTheSymmetricDifferenceOverBothLengths) {
  EXPECT_DOUBLE_EQ(
      changed_fraction(std::vector<int32_t>{1, 2, 3, 4}, std::vector<int32_t>{1, 2, 3, 4}), 0.0);
  // One token replaced in 4: 2 of 8 tokens differ.
  EXPECT_DOUBLE_EQ(
      changed_fraction(std::vector<int32_t>{1, 2, 3, 4}, std::vector<int32_t>{1, 2, 3, 5}), 0.25);
  // One token inserted in 100.
  std::vector<int32_t> long_prompt(100, 7), longer = long_prompt;
  longer.push_back(8);
  EXPECT_NEAR(changed_fraction(longer, long_prompt), 1.0 / 201, 1e-12);
  EXPECT_DOUBLE_EQ(changed_fraction(std::vector<int32_t>{}, std::vector<int32_t>{}), 0.0);
}

TEST(Wilson, MatchesTheClosedForm) {
  EXPECT_DOUBLE_EQ(wilson_upper(0, 0), 1.0);
  // p = 0: z^2/(n + z^2); with z = 1.6449, n = 270 gives 0.00992.
  EXPECT_NEAR(wilson_upper(0, 270), 2.7055 / (270 + 2.7055), 1e-4);
  EXPECT_LT(wilson_upper(0, 270), 0.01);
  EXPECT_GT(wilson_upper(0, 260), 0.01);
  // p = 0.5, n = 100: 0.5 + 1.6449 * 0.05 to first order (0.5816 exactly).
  EXPECT_NEAR(wilson_upper(50, 100), 0.5806, 2e-3);
  EXPECT_GT(wilson_upper(1, 100), wilson_upper(0, 100));
}

TEST(DecisionRule, ShadowsUntilTheBoundIsProvenThenServes) {
  DecisionOptions options;
  options.shadow_fraction = 0;
  DecisionRule rule(options);
  const float score = 0.955f;
  Decision first = rule.decide(score, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse);
  EXPECT_EQ(first.action, Decision::kShadow);
  EXPECT_STREQ(first.reason, "error_bound");
  for (int i = 0; i < 300; ++i) rule.record(first.cell, 100 + i, true);
  Decision proven = rule.decide(score, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse);
  EXPECT_EQ(proven.action, Decision::kServe);
  EXPECT_LE(proven.error_bound, options.max_error);
  // Another kind of difference, another share of the prompt changed, or another similarity bin
  // has its own evidence.
  EXPECT_EQ(rule.decide(score, DifferenceKind::kNumber, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kShadow);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kFormat, 0.3, 1, ReuseMode::kResponse).action,
            Decision::kShadow);
  EXPECT_NE(rule.cell_of(score, DifferenceKind::kFormat, 0.01, ReuseMode::kResponse),
            rule.cell_of(score, DifferenceKind::kFormat, 0.03, ReuseMode::kResponse));
  EXPECT_EQ(rule.cell_of(score, DifferenceKind::kFormat, 0.01, ReuseMode::kResponse),
            rule.cell_of(score, DifferenceKind::kFormat, 0.02, ReuseMode::kResponse));
  EXPECT_EQ(rule.decide(0.935f, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kShadow);
  // Below the threshold: not a candidate.
  EXPECT_EQ(rule.decide(0.9f, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kReject);
  // Failures raise the bound past delta, and the donor that failed is never served again for
  // that kind of difference (another kind has nothing against it).
  rule.record(first.cell, 7, false);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kFormat, 0.01, 7, ReuseMode::kResponse).action,
            Decision::kReject);
  EXPECT_EQ(rule.decide(0.985f, DifferenceKind::kFormat, 0.01, 7, ReuseMode::kResponse).action,
            Decision::kReject);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kNumber, 0.01, 7, ReuseMode::kResponse).action,
            Decision::kShadow);
  for (int i = 0; i < 3; ++i) rule.record(first.cell, 8 + i, false);
  EXPECT_GT(rule.error_bound(first.cell), options.max_error);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kShadow);
}

TEST(DecisionRule, ABinBorrowsTheEvidenceOfLessSimilarBinsOnly) {
  DecisionOptions options;
  options.shadow_fraction = 0;
  DecisionRule rule(options);
  const int low = rule.cell_of(0.935f, DifferenceKind::kFormat, 0.01, ReuseMode::kResponse);
  for (int i = 0; i < 300; ++i) rule.record(low, 500 + i, true);
  // Proven at 0.93: 0.95 and 0.99 of the same kind and size of change are served too...
  EXPECT_EQ(rule.decide(0.955f, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kServe);
  EXPECT_EQ(rule.decide(0.995f, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kServe);
  // ...but another size of change is not, and evidence from above never vouches for below.
  EXPECT_EQ(rule.decide(0.955f, DifferenceKind::kFormat, 0.2, 1, ReuseMode::kResponse).action,
            Decision::kShadow);
  DecisionRule high_only(options);
  const int high = high_only.cell_of(0.995f, DifferenceKind::kFormat, 0.01, ReuseMode::kResponse);
  for (int i = 0; i < 300; ++i) high_only.record(high, 500 + i, true);
  EXPECT_EQ(high_only.decide(0.955f, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kShadow);
  // A bin that has failed itself is judged on its own evidence, however good its neighbourhood.
  const int middle = rule.cell_of(0.965f, DifferenceKind::kFormat, 0.01, ReuseMode::kResponse);
  for (int i = 0; i < 400; ++i) rule.record(middle, 900 + i, i != 0);
  EXPECT_GT(rule.error_bound(middle), options.max_error);
  EXPECT_EQ(rule.decide(0.965f, DifferenceKind::kFormat, 0.01, 2, ReuseMode::kResponse).action,
            Decision::kShadow);
}

TEST(DecisionRule, NamesItsCells) {
  DecisionRule rule(DecisionOptions{});
  EXPECT_EQ(
      rule.cell_name(rule.cell_of(0.955f, DifferenceKind::kNumber, 0.01, ReuseMode::kResponse)),
      "response/number/changed<=0.02/cos>=0.950");
  EXPECT_EQ(rule.cell_name(rule.cell_of(0.999f, DifferenceKind::kFormat, 0.5, ReuseMode::kBlend)),
            "blend/format/changed>0.25/cos>=0.990");
}

// A blend recomputes the changed tokens and a response cannot: evidence about one never serves
// the other, and a donor that failed as a response may still be blended.
TEST(DecisionRule, LearnsEachModeApart) {
  DecisionRule rule(DecisionOptions{.max_error = 0.05, .shadow_fraction = 0});
  const float score = 0.97f;
  const int blend = rule.cell_of(score, DifferenceKind::kNumber, 0.01, ReuseMode::kBlend);
  const int response = rule.cell_of(score, DifferenceKind::kNumber, 0.01, ReuseMode::kResponse);
  EXPECT_NE(blend, response);
  for (uint64_t donor = 100; donor < 200; ++donor) rule.record(blend, donor, true);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kNumber, 0.01, 1, ReuseMode::kBlend).action,
            Decision::kServe);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kNumber, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kShadow)
      << "blends proven safe say nothing of responses";
  rule.record(response, 1, false);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kNumber, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kReject);
  EXPECT_EQ(rule.decide(score, DifferenceKind::kNumber, 0.01, 1, ReuseMode::kBlend).action,
            Decision::kServe);
}

TEST(DecisionRule, SamplesShadowChecksAtTheConfiguredFraction) {
  DecisionOptions options;
  options.shadow_fraction = 0.2;
  DecisionRule rule(options);
  const int cell = rule.cell_of(0.97f, DifferenceKind::kFormat, 0.01, ReuseMode::kResponse);
  for (int i = 0; i < 1000; ++i) rule.record(cell, 1000 + i, true);
  int shadowed = 0;
  for (int i = 0; i < 5000; ++i)
    shadowed += rule.decide(0.97f, DifferenceKind::kFormat, 0.01, 1, ReuseMode::kResponse).action ==
                Decision::kShadow;
  // Binomial(5000, 0.2): sd 28; 6 sd either side.
  EXPECT_NEAR(shadowed, 1000, 170);
}

TEST(DecisionRule, DeltaOfOneStatesNoBound) {
  DecisionOptions options;
  options.max_error = 1;
  options.shadow_fraction = 0;
  DecisionRule rule(options);
  EXPECT_EQ(rule.decide(0.95f, DifferenceKind::kNumber, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kServe);
  // A donor that failed is still never served.
  rule.record(rule.cell_of(0.95f, DifferenceKind::kNumber, 0.01, ReuseMode::kResponse), 1, false);
  EXPECT_EQ(rule.decide(0.95f, DifferenceKind::kNumber, 0.01, 1, ReuseMode::kResponse).action,
            Decision::kReject);
}

TEST(DecisionRule, RefusesNonsenseOptions) {
  DecisionOptions bad;
  bad.max_error = 0;
  EXPECT_THROW(DecisionRule{bad}, std::invalid_argument);
  bad.max_error = 1.5;
  EXPECT_THROW(DecisionRule{bad}, std::invalid_argument);
  bad = {};
  bad.shadow_fraction = 1.5;
  EXPECT_THROW(DecisionRule{bad}, std::invalid_argument);
}

RollbackOptions short_windows() {
  RollbackOptions o;
  o.hit_window_s = 10;
  o.agreement_window_s = 10;
  o.feedback_window_s = 10;
  o.min_lookups = o.min_checks = o.min_served = 10;
  return o;
}

TEST(Rollback, LowHitRateForAWholeWindowTurnsItOff) {
  RollbackController c(short_windows(), 0);
  for (int i = 0; i < 50; ++i) c.on_lookup(i * 0.1, i % 50 == 0);  // 2% served
  EXPECT_FALSE(c.update(5));  // not yet a whole window since it was turned on
  EXPECT_TRUE(c.enabled());
  for (int i = 0; i < 50; ++i) c.on_lookup(5 + i * 0.1, false);
  EXPECT_TRUE(c.update(10.5));
  EXPECT_FALSE(c.enabled());
  EXPECT_EQ(c.reason(), "low_hit_rate");
  EXPECT_EQ(c.transitions(), 1u);
}

TEST(Rollback, EnoughHitsKeepItOn) {
  RollbackController c(short_windows(), 0);
  for (int i = 0; i < 100; ++i) c.on_lookup(i * 0.2, i % 10 == 0);  // 10% served
  EXPECT_FALSE(c.update(20));
  EXPECT_TRUE(c.enabled());
  // Too few lookups to judge: stays on.
  RollbackController quiet(short_windows(), 0);
  for (int i = 0; i < 5; ++i) quiet.on_lookup(i, false);
  EXPECT_FALSE(quiet.update(20));
}

TEST(Rollback, AgreementDropBelowBaselineTurnsItOff) {
  RollbackController c(short_windows(), 0);
  for (int i = 0; i < 10; ++i) c.on_shadow(i * 0.1, true);  // baseline 100%
  ASSERT_TRUE(c.baseline().has_value());
  EXPECT_DOUBLE_EQ(*c.baseline(), 1.0);
  EXPECT_FALSE(c.update(1));
  // 20 more checks, 2 disagreeing: agreement over the window 28/30 = 93.3%, 6.7 points down.
  for (int i = 0; i < 20; ++i) c.on_shadow(1 + i * 0.1, i % 10 != 0);
  EXPECT_TRUE(c.update(3));
  EXPECT_EQ(c.reason(), "agreement_drop");
}

TEST(Rollback, AgreementWithinThreePointsStaysOn) {
  RollbackController c(short_windows(), 0);
  for (int i = 0; i < 100; ++i) c.on_shadow(i * 0.05, i % 50 != 7);  // 98%, 2% everywhere
  EXPECT_FALSE(c.update(5));
}

TEST(Rollback, NegativeFeedbackTurnsItOffAndProbationBringsItBack) {
  RollbackOptions o = short_windows();
  o.probation_s = 30;
  RollbackController c(o, 0);
  // 400 answers served (and 5 lookups not served, which do not count).
  for (int i = 0; i < 400; ++i) c.on_lookup(i * 0.005, true);
  for (int i = 0; i < 5; ++i) c.on_lookup(2, false);
  for (int i = 0; i < 50; ++i) c.on_feedback(2, false);  // positive feedback does not dilute it
  c.on_feedback(2, true);
  c.on_feedback(2, true);  // 2 of 400 served = 0.5%: not above the ceiling
  EXPECT_FALSE(c.update(2));
  ASSERT_TRUE(c.negative_rate(2).has_value());
  EXPECT_DOUBLE_EQ(*c.negative_rate(2), 0.005);
  c.on_feedback(2.1, true);  // 3 of 400
  EXPECT_TRUE(c.update(2.1));
  EXPECT_EQ(c.reason(), "negative_feedback");
  EXPECT_FALSE(c.update(20));
  EXPECT_TRUE(c.update(32.2));
  EXPECT_TRUE(c.enabled());
  EXPECT_EQ(c.reason(), "probation_passed");
  EXPECT_EQ(c.transitions(), 2u);
}

TEST(Rollback, FeedbackIsJudgedOnlyWithEnoughServedAnswers) {
  RollbackController c(short_windows(), 0);
  for (int i = 0; i < 5; ++i) c.on_lookup(1, true);
  for (int i = 0; i < 5; ++i) c.on_feedback(1, true);
  EXPECT_FALSE(c.update(1)) << "5 served answers, min_served 10";
}

TEST(Rollback, OffStaysOffUntilAnOperatorTurnsItOn) {
  RollbackController c(short_windows(), 0);
  c.set_enabled(1, false, "operator");
  c.on_lookup(2, true);  // ignored while off
  EXPECT_FALSE(c.update(1000));
  EXPECT_FALSE(c.enabled());
  c.set_enabled(1001, true, "operator");
  EXPECT_TRUE(c.enabled());
  EXPECT_EQ(c.transitions(), 2u);
}

TEST(SoftmaxKl, MatchesTheClosedForm) {
  // p = softmax(0, 0) = (1/2, 1/2); q = softmax(ln 3, 0) = (3/4, 1/4):
  // KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
  const std::vector<float> p = {0.0f, 0.0f}, q = {std::log(3.0f), 0.0f};
  EXPECT_NEAR(softmax_kl(p, q), 0.5 * std::log(4.0 / 3.0), 1e-6);
  EXPECT_NEAR(softmax_kl(p, p), 0.0, 1e-12);
  // Shifting logits changes nothing (softmax is shift-invariant).
  const std::vector<float> shifted = {100.0f, 100.0f};
  EXPECT_NEAR(softmax_kl(shifted, q), 0.5 * std::log(4.0 / 3.0), 1e-5);
}

TEST(AlignTokens, PrefixSuffixAndCommonSubsequence) {
  const std::vector<int32_t> donor = {1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(align_tokens(std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7}, donor),
            (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  // A changed token in the middle: everything else aligned to its own position.
  EXPECT_EQ(align_tokens(std::vector<int32_t>{1, 2, 3, 9, 5, 6, 7}, donor),
            (std::vector<int32_t>{0, 1, 2, -1, 4, 5, 6}));
  // An inserted token shifts what follows.
  EXPECT_EQ(align_tokens(std::vector<int32_t>{1, 2, 9, 3, 4, 5, 6, 7}, donor),
            (std::vector<int32_t>{0, 1, -1, 2, 3, 4, 5, 6}));
  // Reordered middle: the longest common subsequence (3, 5; not the lone 2) keeps the most.
  EXPECT_EQ(align_tokens(std::vector<int32_t>{1, 3, 9, 5, 2, 7}, donor),
            (std::vector<int32_t>{0, 2, -1, 4, -1, 6}));
  EXPECT_EQ(align_tokens(std::vector<int32_t>{8, 8}, donor), (std::vector<int32_t>{-1, -1}));
  // Too large to compare: only prefix and suffix.
  EXPECT_EQ(align_tokens(std::vector<int32_t>{1, 9, 3, 9, 7}, donor, 4),
            (std::vector<int32_t>{0, -1, -1, -1, 6}));
}

}  // namespace
}  // namespace moeline::reuse
