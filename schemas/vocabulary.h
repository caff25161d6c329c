#pragma once
// The typed values of schema 1.9 (reuse level, approximate outcome, shadow mode, finish reason)
// and the strings they replace. A 1.9 writer sets both the typed field and the deprecated string
// (readers of 1.8 and older read the string); a reader takes the typed field where the writer set
// it and the string otherwise (the golden buffers of 1.0-1.8, and stages of those versions).
// A value the reader does not know (a newer writer's, or a hostile peer's) reads as the default —
// None or NotAsked — never as an index into anything.
//
// Thread-safety: free functions, no shared state.

#include <flatbuffers/flatbuffers.h>

#include <optional>
#include <string_view>

#include "client_generated.h"
#include "common_generated.h"
#include "pipeline_generated.h"

namespace moeline::wire {

// The names are the strings of schema 1.0-1.8, which metrics, logs, the HTTP front and the SDKs'
// results keep using: "none", "prefix", ...; NotAsked, ShadowMode::None and FinishReason::None are
// "".
std::string_view name(ReuseLevel level);
std::string_view name(ApproximateOutcome outcome);
std::string_view name(ShadowMode mode);
std::string_view name(FinishReason reason);

// The value a string names, or nullopt for a string that names none.
std::optional<ReuseLevel> parse_reuse_level(std::string_view text);
std::optional<ApproximateOutcome> parse_approximate_outcome(std::string_view text);
std::optional<ShadowMode> parse_shadow_mode(std::string_view text);
std::optional<FinishReason> parse_finish_reason(std::string_view text);

namespace detail {
inline std::string_view text_of(const flatbuffers::String* s) {
  return s ? s->string_view() : std::string_view{};
}
template <class Enum, class Parse>
Enum typed_or_text(flatbuffers::Optional<Enum> typed, const flatbuffers::String* text,
                   Parse parse) {
  if (typed.has_value()) {
    const auto raw = static_cast<int>(*typed);
    return raw >= static_cast<int>(Enum::MIN) && raw <= static_cast<int>(Enum::MAX) ? *typed
                                                                                    : Enum{};
  }
  return parse(text_of(text)).value_or(Enum{});
}
}  // namespace detail

// A message's reuse level: Usage, ProbePlan, PrefillJob, PrefillDone.
template <class Table>
ReuseLevel reuse_level_of(const Table& t) {
  return detail::typed_or_text(t.level(), t.reuse_level(), parse_reuse_level);
}
// A message's approximate outcome: Usage, ProbePlan.
template <class Table>
ApproximateOutcome approximate_outcome_of(const Table& t) {
  return detail::typed_or_text(t.outcome(), t.approximate(), parse_approximate_outcome);
}
inline ShadowMode shadow_mode_of(const ProbePlan& plan) {
  return detail::typed_or_text(plan.shadow_of(), plan.shadow_mode(), parse_shadow_mode);
}
// A message's finish reason: StreamEvent, ProbePlan, PrefillDone, TokenUpdate.
template <class Table>
FinishReason finish_reason_of(const Table& t) {
  return detail::typed_or_text(t.finish(), t.finish_reason(), parse_finish_reason);
}

// A ProbePlan's typed values and their deprecated strings, for a plan being built: the strings are
// created at construction (FlatBuffers builds no string inside a table), add_to() adds all eight.
class PlanLabels {
 public:
  PlanLabels(flatbuffers::FlatBufferBuilder& builder, ReuseLevel level,
             FinishReason finish = FinishReason::None,
             ApproximateOutcome outcome = ApproximateOutcome::NotAsked,
             ShadowMode shadow_mode = ShadowMode::None);
  void add_to(ProbePlanBuilder& plan) const;

 private:
  ReuseLevel level_;
  FinishReason finish_;
  ApproximateOutcome outcome_;
  ShadowMode shadow_mode_;
  flatbuffers::Offset<flatbuffers::String> level_text_, finish_text_, outcome_text_,
      shadow_mode_text_;
};

// A snapshot entry's kind, or Unknown for a byte that names none.
SnapshotKind snapshot_kind_of(const SnapshotEntry& entry);

}  // namespace moeline::wire
