#pragma once
// `moeline gateway`: the client endpoint and the hub of the stack.
//
// Clients (DEALER) talk to its client ROUTER: it validates each GenerateRequest (prompt length,
// sampling parameters, tenant), tokenizes, assigns the request id and a deadline, and streams
// StreamEvents back: Accepted, text Deltas, then exactly one Finished (finish reason, usage,
// timings) or Error. Stage processes (DEALER) connect to its hub ROUTER; every job goes
// gateway -> probe -> gateway -> prefill -> gateway -> decode -> gateway, dispatched to the
// replica with the most credit. The gateway tracks which replica holds each request: when one
// dies (missed heartbeats) its requests are retried from the start — a retry is a new attempt;
// tokens the client already has are checked, not sent again — or, past the retry limit, ended
// with an explicit error. Nothing is left hanging: every request also has a deadline.
namespace moeline::stages {
int gateway_main(int argc, char** argv);
}
