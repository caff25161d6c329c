#pragma once
// `moeline stack up|status|down`: a local stack as processes over ipc:// in a run directory.
//
// `up` starts a supervisor (a daemon, its log in RUN/supervisor.log) that starts the gateway,
// probe, offload manager, N prefill and M decode processes (logs in RUN/logs/), restarts any that
// dies (and any whose /healthz reports a stalled loop), and stops them all on SIGTERM. `up` returns
// once every stage answers /healthz, printing the client endpoint. RUN/stack.json describes the
// stack (endpoint, stages, pids, HTTP ports, restarts) for `status` and for tools.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moeline::stages {
int stack_command(int argc, char** argv);
// The /healthz body (JSON) of one stage of the stack in `run_dir`; null when the stack or the
// stage is not running or does not answer.
nlohmann::json stack_stage_detail(const std::filesystem::path& run_dir, const std::string& stage);
// `count` ports free now on 127.0.0.1, all different and outside the kernel's ephemeral range
// where it has room (so no outgoing connection can take one before the stages bind it): each
// stays bound until every one is chosen. Throws when none can be had.
std::vector<int> free_loopback_ports(int count);
}  // namespace moeline::stages
