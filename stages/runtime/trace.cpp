#include "stages/runtime/trace.h"

#include <atomic>
#include <chrono>

namespace moeline::runtime {
namespace {

std::atomic<bool> tracing{false};

template <class Table>
void trace_job(const Logger& log, const wire::Message& message, const char* via) {
  const auto* table = message.as<Table>();
  if (table->request_id() == 0) return;
  trace_message(log, wire::message_type_name(message.type), table->request_id(), table->attempt(),
                via);
}

}  // namespace

void set_request_tracing(bool on) {
  tracing.store(on);
}

bool request_tracing() {
  return tracing.load(std::memory_order_relaxed);
}

void trace_message(const Logger& log, const char* type, uint64_t request_id, uint32_t attempt,
                   const char* via) {
  if (!request_tracing()) return;
  const auto unix_us = std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  log.info("trace", {{"message", type},
                     {"request_id", request_id},
                     {"attempt", attempt},
                     {"via", via},
                     {"unix_us", static_cast<int64_t>(unix_us)}});
}

void trace_received(const Logger& log, const wire::Message& message, const char* via) {
  if (!request_tracing()) return;
  switch (message.type) {
    case wire::MessageType::ProbeJob:
      return trace_job<wire::ProbeJob>(log, message, via);
    case wire::MessageType::ProbePlan:
      return trace_job<wire::ProbePlan>(log, message, via);
    case wire::MessageType::PrefillJob:
      return trace_job<wire::PrefillJob>(log, message, via);
    case wire::MessageType::PrefillDone:
      return trace_job<wire::PrefillDone>(log, message, via);
    case wire::MessageType::JobFailed:
      return trace_job<wire::JobFailed>(log, message, via);
    case wire::MessageType::CancelJob:
      return trace_job<wire::CancelJob>(log, message, via);
    case wire::MessageType::SnapshotPut:
      return trace_job<wire::SnapshotPut>(log, message, via);
    case wire::MessageType::HandoverAccepted:
      return trace_job<wire::HandoverAccepted>(log, message, via);
    case wire::MessageType::TokenBatch: {
      const auto* batch = message.as<wire::TokenBatch>();
      if (batch->updates() != nullptr)
        for (const wire::TokenUpdate* update : *batch->updates())
          trace_message(log, "TokenBatch", update->request_id(), update->attempt(), via);
      return;
    }
    default:
      return;  // not a request's message (hellos, credits, expert traffic, control)
  }
}

}  // namespace moeline::runtime
