#include "reuse/approximate.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

namespace moeline::reuse {
namespace {

std::string alphanumeric_lower(const std::string& text) {
  std::string out;
  for (unsigned char c : text)
    if (std::isalnum(c) || c >= 0x80) out.push_back(static_cast<char>(std::tolower(c)));
  return out;
}

bool is_negation(const std::string& core) {
  static const std::unordered_set<std::string> words = {"not",    "no",      "never",   "none",
                                                        "nobody", "nothing", "neither", "nor",
                                                        "cannot", "without", "nt"};
  if (words.count(core)) return true;
  return core.size() > 2 && core.compare(core.size() - 2, 2, "nt") == 0 &&
         (core == "dont" || core == "doesnt" || core == "didnt" || core == "isnt" ||
          core == "arent" || core == "wasnt" || core == "werent" || core == "cant" ||
          core == "wont" || core == "couldnt" || core == "shouldnt" || core == "wouldnt" ||
          core == "hasnt" || core == "havent");
}

// Tokens of `a` that `b` lacks (as a multiset).
std::vector<int32_t> minus(std::span<const int32_t> a, std::span<const int32_t> b) {
  std::map<int32_t, int> counts;
  for (int32_t t : b) ++counts[t];
  std::vector<int32_t> out;
  for (int32_t t : a) {
    auto it = counts.find(t);
    if (it != counts.end() && it->second > 0) {
      --it->second;
    } else {
      out.push_back(t);
    }
  }
  return out;
}

}  // namespace

const char* difference_name(DifferenceKind kind) {
  switch (kind) {
    case DifferenceKind::kNone:
      return "none";
    case DifferenceKind::kFormat:
      return "format";
    case DifferenceKind::kContent:
      return "content";
    case DifferenceKind::kName:
      return "name";
    case DifferenceKind::kNegation:
      return "negation";
    case DifferenceKind::kNumber:
      return "number";
  }
  return "?";
}

double changed_fraction(std::span<const int32_t> query, std::span<const int32_t> donor) {
  const size_t total = query.size() + donor.size();
  if (total == 0) return 0;
  return static_cast<double>(minus(query, donor).size() + minus(donor, query).size()) /
         static_cast<double>(total);
}

DifferenceKind classify_difference(std::span<const int32_t> query, std::span<const int32_t> donor,
                                   const std::function<std::string(int32_t)>& text_of) {
  std::vector<int32_t> differing = minus(query, donor);
  const std::vector<int32_t> donor_only = minus(donor, query);
  if (differing.empty() && donor_only.empty()) return DifferenceKind::kNone;
  differing.insert(differing.end(), donor_only.begin(), donor_only.end());

  bool number = false, negation = false, name = false;
  for (int32_t token : differing) {
    const std::string text = text_of(token);
    const std::string core = alphanumeric_lower(text);
    if (std::any_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); }))
      number = true;
    if (is_negation(core)) negation = true;
    auto first = std::find_if(text.begin(), text.end(),
                              [](unsigned char c) { return std::isalpha(c) || c >= 0x80; });
    if (first != text.end() && std::isupper(static_cast<unsigned char>(*first))) name = true;
  }
  if (number) return DifferenceKind::kNumber;
  if (negation) return DifferenceKind::kNegation;
  // Formatting only: the same letters and digits once case, spacing and punctuation are dropped
  // (token boundaries may differ, so compare whole texts).
  std::string query_text, donor_text;
  for (int32_t t : query) query_text += text_of(t);
  for (int32_t t : donor) donor_text += text_of(t);
  if (alphanumeric_lower(query_text) == alphanumeric_lower(donor_text))
    return DifferenceKind::kFormat;
  return name ? DifferenceKind::kName : DifferenceKind::kContent;
}

double wilson_upper(uint64_t failures, uint64_t trials) {
  if (trials == 0) return 1.0;
  constexpr double z = 1.6448536269514722;  // one-sided 95%
  const double n = static_cast<double>(trials);
  const double p = static_cast<double>(failures) / n;
  const double z2 = z * z;
  const double centre = p + z2 / (2 * n);
  const double spread = z * std::sqrt(p * (1 - p) / n + z2 / (4 * n * n));
  return std::min(1.0, (centre + spread) / (1 + z2 / n));
}

DecisionRule::DecisionRule(DecisionOptions options) : options_(options), random_(options.seed) {
  if (!(options.threshold > -1.0f && options.threshold <= 1.0f))
    throw std::invalid_argument("approximate threshold must be in (-1, 1]");
  if (!(options.max_error > 0 && options.max_error <= 1))
    throw std::invalid_argument("approximate max error (delta) must be in (0, 1]");
  if (!(options.shadow_fraction >= 0 && options.shadow_fraction <= 1))
    throw std::invalid_argument("shadow fraction must be in [0, 1]");
  if (!(options.bin_width > 0)) throw std::invalid_argument("bin width must be > 0");
}

namespace {
// Upper edges of the changed-share buckets; the last bucket is everything above.
constexpr double kChangedEdges[] = {0.02, 0.05, 0.1, 0.25};
constexpr int kChangedBuckets = 5;
}  // namespace

const char* reuse_mode_name(ReuseMode mode) {
  return mode == ReuseMode::kBlend ? "blend" : "response";
}

// A cell is one int (it travels in plans and quality records):
// ((mode * kinds + kind) * buckets + changed bucket) * 1000 + similarity bin.
int DecisionRule::cell_of(float score, DifferenceKind kind, double changed, ReuseMode mode) const {
  const double above = std::max(0.0, static_cast<double>(score) - options_.threshold);
  const int bin = std::min(999, static_cast<int>(std::floor(above / options_.bin_width)));
  int bucket = 0;
  while (bucket < kChangedBuckets - 1 && changed > kChangedEdges[bucket]) ++bucket;
  const int neighbourhood = static_cast<int>(mode) * kDifferenceKinds + static_cast<int>(kind);
  return (neighbourhood * kChangedBuckets + bucket) * 1000 + bin;
}

std::string DecisionRule::cell_name(int cell) const {
  const double low = options_.threshold + (cell % 1000) * options_.bin_width;
  const int bucket = (cell / 1000) % kChangedBuckets;
  const int neighbourhood = cell / 1000 / kChangedBuckets;
  const auto kind = static_cast<DifferenceKind>(neighbourhood % kDifferenceKinds);
  const auto mode = static_cast<ReuseMode>(neighbourhood / kDifferenceKinds);
  char text[112];
  if (bucket < kChangedBuckets - 1) {
    std::snprintf(text, sizeof(text), "%s/%s/changed<=%.2f/cos>=%.3f", reuse_mode_name(mode),
                  difference_name(kind), kChangedEdges[bucket], low);
  } else {
    std::snprintf(text, sizeof(text), "%s/%s/changed>%.2f/cos>=%.3f", reuse_mode_name(mode),
                  difference_name(kind), kChangedEdges[kChangedBuckets - 2], low);
  }
  return text;
}

double DecisionRule::error_bound(int cell) const {
  // The cell's own evidence, and — assuming a more similar candidate of the same kind and size of
  // change is at least as safe as a less similar one — the evidence of this cell and every less
  // similar bin of its neighbourhood pooled, whose rate bounds this cell's too. The tighter wins,
  // unless the cell has failed checks itself.
  auto own = cells_.find(cell);
  const double bound =
      own == cells_.end() ? 1.0 : wilson_upper(own->second.failures, own->second.checks);
  // A bin that has failed itself is judged on its own evidence.
  if (own != cells_.end() && own->second.failures > 0) return bound;
  const int first = cell - cell % 1000;
  Counts pooled;
  for (auto it = cells_.lower_bound(first); it != cells_.end() && it->first <= cell; ++it) {
    pooled.checks += it->second.checks;
    pooled.failures += it->second.failures;
  }
  return std::min(bound, wilson_upper(pooled.failures, pooled.checks));
}

uint64_t DecisionRule::donor_key(uint64_t donor, int cell) {
  return donor * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(cell / 1000 / kChangedBuckets);
}

Decision DecisionRule::decide(float score, DifferenceKind kind, double changed, uint64_t donor,
                              ReuseMode mode) {
  Decision decision;
  decision.cell = cell_of(score, kind, changed, mode);
  decision.error_bound = error_bound(decision.cell);
  if (score < options_.threshold) {
    decision.reason = "below_threshold";
    return decision;
  }
  if (failed_donors_.count(donor_key(donor, decision.cell))) {
    decision.reason = "donor_failed_check";
    return decision;
  }
  // delta = 1 states no bound at all (evaluation and tests): every candidate is served.
  if (options_.max_error < 1 && decision.error_bound > options_.max_error) {
    // Not proven safe yet: computed in full, and compared (the evidence that may prove it).
    decision.action = Decision::kShadow;
    decision.reason = "error_bound";
    return decision;
  }
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  decision.action =
      uniform(random_) < options_.shadow_fraction ? Decision::kShadow : Decision::kServe;
  decision.reason = decision.action == Decision::kShadow ? "sampled" : "";
  return decision;
}

void DecisionRule::record(int cell, uint64_t donor, bool correct) {
  Counts& counts = cells_[cell];
  ++counts.checks;
  if (!correct) {
    ++counts.failures;
    failed_donors_.insert(donor_key(donor, cell));
  }
}

RollbackController::RollbackController(RollbackOptions options, double now_s)
    : options_(options), changed_at_(now_s) {}

void RollbackController::trim(std::deque<Event>& events, double since) {
  while (!events.empty() && events.front().at < since) events.pop_front();
}

double RollbackController::rate(const std::deque<Event>& events) {
  if (events.empty()) return 0;
  size_t yes = 0;
  for (const Event& e : events) yes += e.value ? 1 : 0;
  return static_cast<double>(yes) / static_cast<double>(events.size());
}

void RollbackController::on_lookup(double now_s, bool served) {
  if (!enabled_) return;
  lookups_.push_back({now_s, served});
  if (served) served_.push_back({now_s, true});
}

void RollbackController::on_shadow(double now_s, bool agreed) {
  if (!enabled_) return;
  checks_.push_back({now_s, agreed});
  if (baseline_checks_ < options_.min_checks) {
    ++baseline_checks_;
    baseline_agreed_ += agreed ? 1 : 0;
  }
}

void RollbackController::on_feedback(double now_s, bool negative) {
  if (enabled_ && negative) feedback_.push_back({now_s, true});
}

double RollbackController::hit_rate(double now_s) {
  trim(lookups_, now_s - options_.hit_window_s);
  return rate(lookups_);
}

std::optional<double> RollbackController::baseline() const {
  if (baseline_checks_ < options_.min_checks || baseline_checks_ == 0) return std::nullopt;
  return static_cast<double>(baseline_agreed_) / static_cast<double>(baseline_checks_);
}

std::optional<double> RollbackController::agreement(double now_s) {
  trim(checks_, now_s - options_.agreement_window_s);
  if (checks_.empty()) return std::nullopt;
  return rate(checks_);
}

std::optional<double> RollbackController::negative_rate(double now_s) {
  trim(feedback_, now_s - options_.feedback_window_s);
  trim(served_, now_s - options_.feedback_window_s);
  if (served_.empty()) return std::nullopt;
  return static_cast<double>(feedback_.size()) / static_cast<double>(served_.size());
}

void RollbackController::reset(double now_s) {
  lookups_.clear();
  checks_.clear();
  feedback_.clear();
  served_.clear();
  baseline_checks_ = baseline_agreed_ = 0;
  changed_at_ = now_s;
}

void RollbackController::set_enabled(double now_s, bool enabled, const std::string& reason) {
  if (enabled != enabled_) ++transitions_;
  enabled_ = enabled;
  reason_ = reason;
  reset(now_s);
}

bool RollbackController::update(double now_s) {
  if (!enabled_) {
    if (options_.probation_s > 0 && now_s - changed_at_ >= options_.probation_s) {
      set_enabled(now_s, true, "probation_passed");
      return true;
    }
    return false;
  }
  // "Stays below for the window": only once a whole window has passed since it was turned on.
  if (now_s - changed_at_ >= options_.hit_window_s) {
    const double hits = hit_rate(now_s);
    if (lookups_.size() >= options_.min_lookups && hits < options_.min_hit_rate) {
      set_enabled(now_s, false, "low_hit_rate");
      return true;
    }
  }
  if (auto base = baseline()) {
    auto current = agreement(now_s);
    if (current && checks_.size() >= options_.min_checks &&
        *base - *current > options_.max_agreement_drop) {
      set_enabled(now_s, false, "agreement_drop");
      return true;
    }
  }
  auto negative = negative_rate(now_s);
  if (negative && served_.size() >= options_.min_served &&
      *negative > options_.max_negative_feedback) {
    set_enabled(now_s, false, "negative_feedback");
    return true;
  }
  return false;
}

double softmax_kl(std::span<const float> p_logits, std::span<const float> q_logits) {
  const size_t n = std::min(p_logits.size(), q_logits.size());
  if (n == 0) return 0;
  const float p_max = *std::max_element(p_logits.begin(), p_logits.begin() + n);
  const float q_max = *std::max_element(q_logits.begin(), q_logits.begin() + n);
  double p_sum = 0, q_sum = 0;
  for (size_t i = 0; i < n; ++i) {
    p_sum += std::exp(static_cast<double>(p_logits[i] - p_max));
    q_sum += std::exp(static_cast<double>(q_logits[i] - q_max));
  }
  const double p_log_z = std::log(p_sum) + p_max, q_log_z = std::log(q_sum) + q_max;
  double kl = 0;
  for (size_t i = 0; i < n; ++i) {
    const double log_p = p_logits[i] - p_log_z, log_q = q_logits[i] - q_log_z;
    kl += std::exp(log_p) * (log_p - log_q);
  }
  return std::max(0.0, kl);
}

std::vector<int32_t> align_tokens(std::span<const int32_t> query, std::span<const int32_t> donor,
                                  size_t max_cells) {
  std::vector<int32_t> aligned(query.size(), -1);
  size_t prefix = 0;
  while (prefix < query.size() && prefix < donor.size() && query[prefix] == donor[prefix]) {
    aligned[prefix] = static_cast<int32_t>(prefix);
    ++prefix;
  }
  size_t suffix = 0;
  while (suffix < query.size() - prefix && suffix < donor.size() - prefix &&
         query[query.size() - 1 - suffix] == donor[donor.size() - 1 - suffix]) {
    aligned[query.size() - 1 - suffix] = static_cast<int32_t>(donor.size() - 1 - suffix);
    ++suffix;
  }
  const size_t n = query.size() - prefix - suffix, m = donor.size() - prefix - suffix;
  if (n == 0 || m == 0 || n * m > max_cells) return aligned;
  // Longest common subsequence of the middles, by dynamic programming (lengths of suffixes).
  std::vector<uint16_t> lengths((n + 1) * (m + 1), 0);
  auto at = [&](size_t i, size_t j) -> uint16_t& { return lengths[i * (m + 1) + j]; };
  for (size_t i = n; i-- > 0;)
    for (size_t j = m; j-- > 0;)
      at(i, j) = query[prefix + i] == donor[prefix + j]
                     ? static_cast<uint16_t>(at(i + 1, j + 1) + 1)
                     : std::max(at(i + 1, j), at(i, j + 1));
  for (size_t i = 0, j = 0; i < n && j < m;) {
    if (query[prefix + i] == donor[prefix + j]) {
      aligned[prefix + i] = static_cast<int32_t>(prefix + j);
      ++i, ++j;
    } else if (at(i + 1, j) >= at(i, j + 1)) {
      ++i;
    } else {
      ++j;
    }
  }
  return aligned;
}

}  // namespace moeline::reuse
