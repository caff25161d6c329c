#pragma once
// The guards of approximate reuse (stages/README.md, "Exact reuse"): what may be served when a
// prompt's nearest cached neighbour is not the same prompt.
//
// - classify_difference: how two prompts differ, by the tokens one has and the other lacks —
//   only formatting (case, spacing, punctuation), numbers, negations, names, or other words. A
//   changed number or a "not" flips an answer while barely moving an activation signature, so the
//   decision rule learns separately for each kind of difference.
// - DecisionRule: candidates are taken at signature cosine >= threshold; a candidate is served
//   only while the one-sided 95% upper confidence bound (Wilson) of the false-reuse rate of its
//   neighbourhood — the cell (mode of reuse, kind of difference, share of the prompt changed,
//   similarity bin) — is at most delta. A cell also borrows the evidence of the less similar bins
//   of its mode, kind and size of change (pooled with its own), on the assumption that a more
//   similar candidate is not less safe: a bin proven safe vouches for the bins above it, never for
//   those below. The counts come from shadow checks: every candidate not served is computed in full
//   anyway and compared (free evidence), and a fraction of served hits is computed in full too. A
//   donor that once failed a check is never served again for that mode and kind of difference
//   (per-entry learning).
// - RollbackController: turns approximate reuse off when, over its windows, the served hit rate
//   stays under its floor, the shadow agreement drops below its baseline, or negative feedback
//   on reused answers passes its ceiling; off until an operator turns it on or a probation passes.
// - align_tokens: which donor position each token of a new prompt can take its KV from (blended
//   reuse): common prefix, common suffix, and a longest common subsequence in between.
//
// Not thread-safe: each lives in one stage's loop. Times are passed in (tests drive them).

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

namespace moeline::reuse {

enum class DifferenceKind : uint8_t { kNone, kFormat, kContent, kName, kNegation, kNumber };
const char* difference_name(DifferenceKind kind);
inline constexpr int kDifferenceKinds = 6;

// What a hit serves: the donor's finished answer (response), or the donor's KV under a partial
// recomputation (blend). They fail differently — a blend recomputes the changed tokens, a response
// cannot — so the rule learns them apart.
enum class ReuseMode : uint8_t { kResponse, kBlend };
const char* reuse_mode_name(ReuseMode mode);

// The share of the two prompts' tokens that the other lacks (multiset symmetric difference over
// both lengths): a changed word is 1/4 of a short prompt and 1/100 of a long one.
double changed_fraction(std::span<const int32_t> query, std::span<const int32_t> donor);

// `text_of` decodes one token id to its text.
DifferenceKind classify_difference(std::span<const int32_t> query, std::span<const int32_t> donor,
                                   const std::function<std::string(int32_t)>& text_of);

struct DecisionOptions {
  float threshold = 0.93f;  // candidate at cosine >= threshold
  double max_error = 0.01;  // delta: bound on the false-reuse rate of what is served (1: none)
  double shadow_fraction = 0.05;  // of served hits, also computed in full
  double bin_width = 0.01;        // similarity bins of a cell
  uint64_t seed = 0x5eed;
};

struct Decision {
  enum Action : uint8_t { kReject, kServe, kShadow } action = kReject;
  // The cell's estimate: the upper confidence bound of its false-reuse rate.
  double error_bound = 1.0;
  int cell = 0;
  const char* reason = "";  // why not served
};

class DecisionRule {
 public:
  explicit DecisionRule(DecisionOptions options);
  // `score` is the candidate's cosine (>= threshold); `changed`: changed_fraction of the pair.
  Decision decide(float score, DifferenceKind kind, double changed, uint64_t donor, ReuseMode mode);
  // A shadow check's outcome for a candidate of that cell and donor.
  void record(int cell, uint64_t donor, bool correct);

  int cell_of(float score, DifferenceKind kind, double changed, ReuseMode mode) const;
  double error_bound(int cell) const;
  struct Counts {
    uint64_t checks = 0, failures = 0;
  };
  const std::map<int, Counts>& cells() const { return cells_; }
  std::string cell_name(int cell) const;
  const DecisionOptions& options() const { return options_; }

 private:
  // A donor and a mode and kind of difference (the cell's), as one key.
  static uint64_t donor_key(uint64_t donor, int cell);
  DecisionOptions options_;
  std::map<int, Counts> cells_;
  std::unordered_set<uint64_t> failed_donors_;
  std::mt19937_64 random_;
};

// The one-sided upper confidence bound (Wilson score, z = 1.645: 95%) of a failure rate.
double wilson_upper(uint64_t failures, uint64_t trials);

struct RollbackOptions {
  double hit_window_s = 300;         // served hit rate over this window...
  double min_hit_rate = 0.05;        // ...must not stay under this
  uint64_t min_lookups = 20;         // (judged only with at least this many lookups)
  double agreement_window_s = 300;   // shadow agreement over this window...
  double max_agreement_drop = 0.03;  // ...must not fall this far below the baseline
  uint64_t min_checks = 20;          // (judged with this many checks; the baseline is the first)
  double feedback_window_s = 300;    // negative feedback over answers served by approximate
                                     // reuse, both over this window...
  double max_negative_feedback = 0.005;  // ...must not pass this share of reused answers
  uint64_t min_served = 20;              // (judged once this many were served in the window)
  double probation_s = 0;  // off for this long, then on again; 0: until an operator says so
};

class RollbackController {
 public:
  explicit RollbackController(RollbackOptions options, double now_s = 0);

  // A request that asked for approximate reuse was looked up (served: an approximate hit served).
  void on_lookup(double now_s, bool served);
  void on_shadow(double now_s, bool agreed);
  // Feedback on an answer served by approximate reuse (only negative feedback counts: the rate is
  // negative feedback over answers served, whether or not their users said anything).
  void on_feedback(double now_s, bool negative);
  // Evaluates the triggers and the probation; returns true when the state changed.
  bool update(double now_s);
  // An operator's switch: on (resets the windows and the baseline) or off.
  void set_enabled(double now_s, bool enabled, const std::string& reason);

  bool enabled() const { return enabled_; }
  const std::string& reason() const { return reason_; }
  double changed_at() const { return changed_at_; }
  uint64_t transitions() const { return transitions_; }
  double hit_rate(double now_s);
  std::optional<double> agreement(double now_s);
  std::optional<double> baseline() const;
  std::optional<double> negative_rate(double now_s);

 private:
  struct Event {
    double at;
    bool value;
  };
  static void trim(std::deque<Event>& events, double since);
  static double rate(const std::deque<Event>& events);
  void reset(double now_s);

  RollbackOptions options_;
  bool enabled_ = true;
  std::string reason_ = "initial";
  double changed_at_ = 0;
  uint64_t transitions_ = 0;
  std::deque<Event> lookups_, checks_, feedback_, served_;
  uint64_t baseline_checks_ = 0, baseline_agreed_ = 0;
};

// KL(p || q), in nats, of the softmax distributions of two logit vectors of one length: how far a
// reused first-token distribution (q) is from the one the full computation gives (p).
double softmax_kl(std::span<const float> p_logits, std::span<const float> q_logits);

// For each position of `query`, the position of `donor` holding the same token in the aligned
// region, or -1: the common prefix, the common suffix, and a longest common subsequence of what is
// between (skipped, all -1, when that middle is larger than max_cells to compare).
std::vector<int32_t> align_tokens(std::span<const int32_t> query, std::span<const int32_t> donor,
                                  size_t max_cells = size_t{4} << 20);

}  // namespace moeline::reuse
