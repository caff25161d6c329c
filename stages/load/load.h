#pragma once
// `moeline load`: a stage-level load generator. It drives the whole stack through the client SDK,
// or one stage alone: for --target prefill|decode it is itself the hub that stage connects to
// (it starts the stage process, answers its expert-plan request) and sends it synthetic jobs —
// prompts for prefill, prefilled sequences with synthetic KV for decode. At a set concurrency
// (closed loop) or request rate (open loop) for a set time, it prints throughput and TTFT,
// per-token and end-to-end latency percentiles as a table, or as JSON with --json.
namespace moeline::stages {
int load_command(int argc, char** argv);
}
