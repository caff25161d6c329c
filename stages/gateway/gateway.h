#pragma once
// `moeline gateway`: the client endpoint and the hub of the stack.
//
// Clients (DEALER) talk to its client ROUTER: it validates each GenerateRequest (prompt length,
// sampling parameters, tenant, API key), tokenizes, assigns the request id and a deadline, and
// streams StreamEvents back: Accepted, text Deltas, then exactly one Finished (finish reason,
// usage, timings) or Error. Stage processes (DEALER) connect to its hub ROUTER. The gateway
// brokers: it sends a request to the probe that owns its namespace together with the prefill and
// decode replicas it picked (routes with tickets to their intakes), and bulk data (KV, snapshot
// puts, usage reports) goes from stage to stage; the gateway receives the first token from
// prefill and the rest from decode. It tracks which replica holds each request: when one dies
// (missed heartbeats) or a hand-over is not confirmed, the request is retried from the start — a
// retry is a new attempt; tokens the client already has are checked, not sent again — or, past
// the retry limit, ended with an explicit error. Nothing is left hanging: every request also has
// a deadline. The parts: stages/README.md.
namespace moeline::stages {
int gateway_main(int argc, char** argv);
}
