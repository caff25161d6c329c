#include "vocabulary.h"

#include <array>
#include <utility>

namespace moeline::wire {
namespace {

template <class Enum, size_t N>
using Names = std::array<std::pair<Enum, std::string_view>, N>;

constexpr Names<ReuseLevel, 6> kReuseLevels{{{ReuseLevel::None, "none"},
                                             {ReuseLevel::Prefix, "prefix"},
                                             {ReuseLevel::Full, "full"},
                                             {ReuseLevel::Result, "result"},
                                             {ReuseLevel::Response, "response"},
                                             {ReuseLevel::Blend, "blend"}}};
constexpr Names<ApproximateOutcome, 8> kApproximateOutcomes{
    {{ApproximateOutcome::NotAsked, ""},
     {ApproximateOutcome::Response, "response"},
     {ApproximateOutcome::Blend, "blend"},
     {ApproximateOutcome::Shadow, "shadow"},
     {ApproximateOutcome::NoCandidate, "no_candidate"},
     {ApproximateOutcome::Rejected, "rejected"},
     {ApproximateOutcome::Disabled, "disabled"},
     {ApproximateOutcome::NotAllowed, "not_allowed"}}};
constexpr Names<ShadowMode, 3> kShadowModes{
    {{ShadowMode::None, ""}, {ShadowMode::Response, "response"}, {ShadowMode::Blend, "blend"}}};
constexpr Names<FinishReason, 4> kFinishReasons{{{FinishReason::None, ""},
                                                 {FinishReason::Stop, "stop"},
                                                 {FinishReason::Length, "length"},
                                                 {FinishReason::Cancelled, "cancelled"}}};

template <class Enum, size_t N>
std::string_view name_in(const Names<Enum, N>& names, Enum value) {
  for (const auto& [known, text] : names)
    if (known == value) return text;
  return "unknown";
}

template <class Enum, size_t N>
std::optional<Enum> parse_in(const Names<Enum, N>& names, std::string_view text) {
  for (const auto& [known, name] : names)
    if (name == text) return known;
  return std::nullopt;
}

}  // namespace

std::string_view name(ReuseLevel level) {
  return name_in(kReuseLevels, level);
}
std::string_view name(ApproximateOutcome outcome) {
  return name_in(kApproximateOutcomes, outcome);
}
std::string_view name(ShadowMode mode) {
  return name_in(kShadowModes, mode);
}
std::string_view name(FinishReason reason) {
  return name_in(kFinishReasons, reason);
}

std::optional<ReuseLevel> parse_reuse_level(std::string_view text) {
  // Writers of 1.0-1.8 left the level empty where nothing was reused.
  if (text.empty()) return ReuseLevel::None;
  return parse_in(kReuseLevels, text);
}
std::optional<ApproximateOutcome> parse_approximate_outcome(std::string_view text) {
  return parse_in(kApproximateOutcomes, text);
}
std::optional<ShadowMode> parse_shadow_mode(std::string_view text) {
  return parse_in(kShadowModes, text);
}
std::optional<FinishReason> parse_finish_reason(std::string_view text) {
  return parse_in(kFinishReasons, text);
}

PlanLabels::PlanLabels(flatbuffers::FlatBufferBuilder& builder, ReuseLevel level,
                       FinishReason finish, ApproximateOutcome outcome, ShadowMode shadow_mode)
    : level_(level),
      finish_(finish),
      outcome_(outcome),
      shadow_mode_(shadow_mode),
      level_text_(builder.CreateString(name(level))),
      finish_text_(builder.CreateString(name(finish))),
      outcome_text_(builder.CreateString(name(outcome))),
      shadow_mode_text_(builder.CreateString(name(shadow_mode))) {}

void PlanLabels::add_to(ProbePlanBuilder& plan) const {
  plan.add_reuse_level(level_text_);
  plan.add_finish_reason(finish_text_);
  plan.add_approximate(outcome_text_);
  plan.add_shadow_mode(shadow_mode_text_);
  plan.add_level(level_);
  if (finish_ != FinishReason::None) plan.add_finish(finish_);
  if (outcome_ != ApproximateOutcome::NotAsked) plan.add_outcome(outcome_);
  if (shadow_mode_ != ShadowMode::None) plan.add_shadow_of(shadow_mode_);
}

SnapshotKind snapshot_kind_of(const SnapshotEntry& entry) {
  switch (entry.kind()) {
    case SnapshotKind::Block:
    case SnapshotKind::Prompt:
    case SnapshotKind::Quality:
    case SnapshotKind::Result:
    case SnapshotKind::Signature:
      return entry.kind();
    case SnapshotKind::Unknown:
      break;
  }
  return SnapshotKind::Unknown;
}

}  // namespace moeline::wire
