#pragma once
// Message dispatch through a table. A stage lists the message types it handles, each once, with
// the member function that handles it; any other type is unexpected, and the stage says so in one
// place, instead of a switch that names every type it ignores. The table is checked when it is
// compiled: a type that is not one the wire defines, or a type listed twice, is a compile error,
// and a type added to the schema without being added to kMessageTypes fails the static_assert.

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "schemas/wire.h"

namespace moeline::runtime {

inline constexpr wire::MessageType kMessageTypes[] = {
    wire::MessageType::Hello,
    wire::MessageType::HelloReply,
    wire::MessageType::Heartbeat,
    wire::MessageType::Credit,
    wire::MessageType::ErrorReply,
    wire::MessageType::GenerateRequest,
    wire::MessageType::CancelRequest,
    wire::MessageType::Feedback,
    wire::MessageType::StreamEvent,
    wire::MessageType::StreamEventBatch,
    wire::MessageType::ProbeJob,
    wire::MessageType::ProbePlan,
    wire::MessageType::PrefillJob,
    wire::MessageType::PrefillDone,
    wire::MessageType::TokenBatch,
    wire::MessageType::JobFailed,
    wire::MessageType::CancelJob,
    wire::MessageType::SnapshotPut,
    wire::MessageType::ExpertPlanRequest,
    wire::MessageType::ExpertPlan,
    wire::MessageType::ExpertUsage,
    wire::MessageType::ControlCommand,
    wire::MessageType::ControlReply,
    wire::MessageType::HandoverAccepted,
};
static_assert(std::size(kMessageTypes) ==
                  std::extent_v<std::remove_reference_t<decltype(wire::EnumValuesMessageType())>>,
              "a message type was added to schemas/common.fbs: list it in kMessageTypes");

constexpr bool is_message_type(wire::MessageType type) {
  for (wire::MessageType known : kMessageTypes)
    if (known == type) return true;
  return false;
}

// One row of a table: messages of `type` go to `handle`, called with the dispatch's arguments.
// A row names its handler: one with nullptr does not compile. (The table cannot check for a null
// handler itself: GCC does not evaluate a member pointer's comparison with null at compile time
// under -fsanitize=null, which `scripts/test --sanitize` builds with.)
template <class Owner, class... Args>
struct Route {
  using Handler = void (Owner::*)(Args...);
  constexpr Route() = default;
  constexpr Route(wire::MessageType route_type, Handler route_handle)
      : type(route_type), handle(route_handle) {}
  Route(wire::MessageType, std::nullptr_t) = delete;

  wire::MessageType type{};
  Handler handle = nullptr;
};

template <class Owner, std::size_t N, class... Args>
class HandlerTable {
 public:
  // consteval: a bad table does not compile (the throw is what the compiler reports).
  consteval HandlerTable(const Route<Owner, Args...> (&routes)[N]) {
    for (std::size_t i = 0; i < N; ++i) {
      // A row left out of the list has no type (nor a handler), and is refused here.
      if (!is_message_type(routes[i].type)) throw "HandlerTable: not a message type of the wire";
      for (std::size_t j = 0; j < i; ++j)
        if (routes[j].type == routes[i].type) throw "HandlerTable: a message type listed twice";
      routes_[i] = routes[i];
    }
  }

  // Calls the handler of `type`; false when the table has none (the message is unexpected here).
  template <class... CallArgs>
  bool dispatch(Owner& owner, wire::MessageType type, CallArgs&&... args) const {
    for (const Route<Owner, Args...>& route : routes_) {
      if (route.type != type) continue;
      (owner.*route.handle)(std::forward<CallArgs>(args)...);
      return true;
    }
    return false;
  }

  constexpr bool handles(wire::MessageType type) const {
    for (const Route<Owner, Args...>& route : routes_)
      if (route.type == type) return true;
    return false;
  }

 private:
  std::array<Route<Owner, Args...>, N> routes_{};
};

}  // namespace moeline::runtime
