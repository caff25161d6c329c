#pragma once
// Request tracing (--trace-requests): every stage logs each message of a request that it
// receives, one `event=trace` line with the message type, the request id and attempt, how it came
// (hub, link, intake, client) and the time in microseconds, so that one request's path can be
// read back in order across the processes' logs (docs/ARCHITECTURE.md counts the messages before
// the first token this way). Off by default: one line per message is for looking, not serving.

#include <cstdint>

#include "schemas/wire.h"
#include "stages/runtime/log.h"

namespace moeline::runtime {

void set_request_tracing(bool on);
bool request_tracing();
// The request(s) a received message belongs to, logged when tracing is on.
void trace_received(const Logger& log, const wire::Message& message, const char* via);
// A message the stage sent or received that the wire layer does not see as such (the gateway's
// client traffic).
void trace_message(const Logger& log, const char* type, uint64_t request_id, uint32_t attempt,
                   const char* via);

}  // namespace moeline::runtime
