#pragma once
// `moeline stack up|status|down`: a local stack as processes over ipc:// in a run directory.
//
// `up` starts a supervisor (a daemon, its log in RUN/supervisor.log) that starts the gateway,
// probe, offload manager, N prefill and M decode processes (logs in RUN/logs/), restarts any that
// dies (and any whose /healthz reports a stalled loop), and stops them all on SIGTERM. `up` returns
// once every stage answers /healthz, printing the client endpoint. RUN/stack.json describes the
// stack (endpoint, stages, pids, HTTP ports, restarts) for `status` and for tools.
namespace moeline::stages {
int stack_command(int argc, char** argv);
}
