#include "stages/stack/stack.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "base/environment.h"
#include "cli/args.h"
#include "stages/runtime/config.h"
#include "stages/runtime/log.h"
#include "stages/runtime/security.h"

namespace moeline::stages {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    R"(usage: moeline stack up --model DIR --run-dir DIR [--prefill N] [--decode M] [--probe P]
                        [--config FILE]
                        [--threads T] [--timeout-s S]
       moeline stack status --run-dir DIR [--json]
       moeline stack down --run-dir DIR

up       start gateway, probe, offload manager, N prefill and M decode processes over ipc:// in
         DIR, and the HTTP API, supervised (a stage that dies is restarted); returns when all are healthy and
         prints the client endpoint
status   each stage's pid, health and restarts (exit 1 when the stack is not healthy)
down     stop every stage and the supervisor

  --model DIR       checkpoint folder (default: $MOELINE_MODEL, else the embedded demo model)
  --run-dir DIR     sockets, logs and stack.json go here
  --prefill N       prefill processes (default 1)
  --decode M        decode processes (default 1)
  --probe P         probe processes (default 1): they shard the namespaces by consistent hashing,
                    each with its own store (probe-0, probe-1, ...; one probe is named "probe")
  --config FILE     stage config file passed to every stage (see `moeline <stage> --help`)
  --threads T       compute threads per prefill/decode process (default: cores / (N + M))
  --quant-math exact|fast
                    GGUF models' quantized weights: fast (default; 8-bit activations, integer
                    dot products) or exact (dequantized to F32)
  --bf16-math exact|fast
                    BF16 weights: exact (default; widened to F32) or fast (activations rounded
                    to BF16, the CPU's BF16 dot products where it has AVX512_BF16)
  --timeout-s S     how long `up` waits for the stack to be healthy (default 120)
  --stall-silence-s S
                    a stage whose liveness file goes unwritten longer than this (stopped,
                    wedged) at three checks a second apart is killed and restarted (default 2)
  --expert-budget SIZE
                    keep the experts in one host pool of SIZE shared by every prefill and decode
                    process (a share of the experts, "25%", or a size, "512MiB"); experts are
                    read from the checkpoint on demand. Default: each process maps them all
  --device cpu|cuda|cuda:N
                    where prefill and decode compute (default cpu); cuda needs a build with nvcc
                    and a GPU, shared by every prefill and decode process
  --device-expert-budget SIZE
                    with --device cuda: expert bytes each process keeps on the GPU ("50%",
                    "8GiB"); the rest is copied in from the host pool on demand. Default: all
  --transport ipc|tcp
                    ipc (default): sockets in DIR, which only its owner may enter (mode 0700);
                    tcp: loopback tcp:// with CurveZMQ, keys made in DIR/keys (moeline keys),
                    clients give --server-key DIR/keys/gateway.pub
  --curve on|off    with --transport tcp: off runs it open, without Curve (to measure what Curve
                    costs; anyone who reaches the ports may join)
  --api-keys FILE   the gateway requires API keys from this file (moeline keys add); without
                    it the stack is open: clients name their tenant and may run operator commands
  --http-port N|0|off
                    the OpenAI-compatible HTTP API (`moeline http`, a client of the gateway) on
                    this port (default 8000; 0: any free port; off: none); its URL is in
                    stack.json ("http") and `stack status`
  --http-bind ADDR  the address it listens on (default 127.0.0.1)
  --metrics-port-base N
                    each stage's /metrics, /livez and /readyz on port N + i, i its place in
                    `stack status` (gateway, probes, offload, http, prefills, decodes); default
                    0: any free port. Either way DIR/prometheus_targets.json lists them for
                    Prometheus (file_sd_configs), rewritten when a restarted stage moves
  --metrics-bind ADDR
                    the address of those ports (default 127.0.0.1)
)";

struct StageProcess {
  std::string name;   // gateway, probe, offload, prefill-0, decode-1, ...
  std::string stage;  // the subcommand
  std::vector<std::string> args;
  pid_t pid = 0;
  int restarts = 0;
  std::vector<Clock::time_point> recent_starts;
  Clock::time_point restart_at{};
  int stalled_checks = 0;
};

std::atomic<bool> g_stop{false};
void on_signal(int) {
  g_stop.store(true);
}

std::string self_exe() {
  std::error_code ec;
  fs::path path = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "moeline" : path.string();
}

bool alive(pid_t pid) {
  return pid > 0 && ::kill(pid, 0) == 0;
}

int read_port(const fs::path& file) {
  std::ifstream in(file);
  int port = 0;
  in >> port;
  return in ? port : 0;
}

// GET /healthz: 200, 503 (the stage answers but is not ready or has stalled), or -1 (no answer).
int health(int port, std::string* body = nullptr) {
  if (port <= 0) return -1;
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(0, 500'000);
  client.set_read_timeout(1, 0);
  auto response = client.Get("/healthz");
  if (!response) return -1;
  if (body) *body = response->body;
  return response->status;
}

class Supervisor {
 public:
  Supervisor(fs::path run_dir, std::vector<StageProcess> stages, nlohmann::json access,
             std::chrono::seconds stall_silence)
      : run_dir_(std::move(run_dir)),
        stages_(std::move(stages)),
        access_(std::move(access)),
        stall_silence_(stall_silence),
        log_("stack", "supervisor") {}

  int run() {
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, nullptr);
    sigaction(SIGINT, &action, nullptr);
    for (StageProcess& stage : stages_) start(stage);
    write_state();
    auto last_health = Clock::now();
    while (!g_stop.load()) {
      int status = 0;
      pid_t pid;
      while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
        for (StageProcess& stage : stages_) {
          if (stage.pid != pid) continue;
          log_.error("stage_exited", {{"stage", stage.name},
                                      {"pid", static_cast<int64_t>(pid)},
                                      {"code", WIFEXITED(status) ? WEXITSTATUS(status) : -1},
                                      {"signal", WIFSIGNALED(status) ? WTERMSIG(status) : 0}});
          stage.pid = 0;
          schedule_restart(stage);
        }
      }
      const auto now = Clock::now();
      for (StageProcess& stage : stages_) {
        if (stage.pid == 0 && now >= stage.restart_at) {
          ++stage.restarts;
          start(stage);
          write_state();
        }
      }
      if (now - last_health > std::chrono::seconds(1)) {
        last_health = now;
        check_stalls();
        write_targets();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    stop_all();
    return 0;
  }

 private:
  void schedule_restart(StageProcess& stage) {
    // Restart at once, but back off when a stage keeps dying (a bad config, a missing model).
    const auto now = Clock::now();
    std::erase_if(stage.recent_starts,
                  [&](Clock::time_point t) { return now - t > std::chrono::seconds(30); });
    stage.restart_at = stage.recent_starts.size() >= 5 ? now + std::chrono::seconds(5) : now;
  }

  // A stage whose loop stalled (past its watchdog) or that stopped updating its liveness file
  // (SIGSTOP, a wedged process) for longer than --stall-silence-s, three checks a second apart in
  // a row, is killed; waitpid then restarts it.
  // The check reads "<name>.port.alive" in the run directory (mode 0700), not the HTTP port: a
  // port any local user can fill with slow connections must not get a healthy stage killed. A
  // stage without the file yet is still starting (loading its model) and is left alone.
  void check_stalls() {
    for (StageProcess& stage : stages_) {
      if (stage.pid == 0) continue;
      const fs::path alive = run_dir_ / (stage.name + ".port.alive");
      std::error_code ec;
      const auto written = fs::last_write_time(alive, ec);
      if (ec) continue;
      const auto age = fs::file_time_type::clock::now() - written;
      std::ifstream in(alive);
      const nlohmann::json state = nlohmann::json::parse(in, nullptr, false);
      const bool loop_stalled = state.is_object() && state.value("ready", false) &&
                                state.value("loop_idle_ms", 0) > state.value("watchdog_ms", 30000);
      const bool silent = age > stall_silence_;
      const bool stalled = loop_stalled || silent;
      const int code = silent ? -1 : 503;
      stage.stalled_checks = stalled ? stage.stalled_checks + 1 : 0;
      if (stage.stalled_checks >= 3) {
        log_.error("stage_stalled", {{"stage", stage.name},
                                     {"pid", static_cast<int64_t>(stage.pid)},
                                     {"health", code == -1 ? "no answer" : "loop stalled"}});
        ::kill(stage.pid, SIGKILL);  // waitpid sees it and restarts it
        stage.stalled_checks = 0;
      }
    }
  }

  void start(StageProcess& stage) {
    fs::remove(run_dir_ / (stage.name + ".port"));
    fs::remove(run_dir_ / (stage.name + ".port.alive"));
    const std::string log_file = (run_dir_ / "logs" / (stage.name + ".log")).string();
    const std::string exe = self_exe();
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
        ::close(fd);
      }
      ::setpgid(0, 0);
      std::vector<std::string> args = {exe, stage.stage};
      args.insert(args.end(), stage.args.begin(), stage.args.end());
      args.push_back("--port-file");
      args.push_back((run_dir_ / (stage.name + ".port")).string());
      args.push_back("--replica");
      args.push_back(stage.name);
      std::vector<char*> argv;
      for (std::string& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      ::execv(exe.c_str(), argv.data());
      std::perror("exec moeline");
      ::_exit(127);
    }
    stage.pid = pid;
    stage.stalled_checks = 0;
    stage.recent_starts.push_back(Clock::now());
    log_.info(
        "stage_started",
        {{"stage", stage.name}, {"pid", static_cast<int64_t>(pid)}, {"restarts", stage.restarts}});
  }

  void stop_all() {
    // SIGTERM drains: compute stages finish what they hold (--drain-grace-ms, 30 s by default)
    // while the gateway still collects their results, then each exits.
    log_.info("stopping", {{"stages", stages_.size()}});
    for (StageProcess& stage : stages_)
      if (stage.pid > 0) ::kill(stage.pid, SIGTERM);
    const auto until = Clock::now() + std::chrono::seconds(40);
    while (Clock::now() < until) {
      bool any = false;
      for (StageProcess& stage : stages_) {
        if (stage.pid > 0 && ::waitpid(stage.pid, nullptr, WNOHANG) == stage.pid) stage.pid = 0;
        any = any || stage.pid > 0;
      }
      if (!any) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (StageProcess& stage : stages_) {
      if (stage.pid > 0) {
        log_.warn("stage_killed", {{"stage", stage.name}});
        ::kill(stage.pid, SIGKILL);
        ::waitpid(stage.pid, nullptr, 0);
        stage.pid = 0;
      }
    }
    write_state();
    fs::remove(run_dir_ / "supervisor.pid");
    log_.info("stopped");
  }

  void write_state() {
    nlohmann::json state = access_;
    state["supervisor_pid"] = ::getpid();
    state["stages"] = nlohmann::json::array();
    for (const StageProcess& stage : stages_)
      state["stages"].push_back({{"name", stage.name},
                                 {"stage", stage.stage},
                                 {"pid", stage.pid},
                                 {"restarts", stage.restarts},
                                 {"port_file", (run_dir_ / (stage.name + ".port")).string()},
                                 {"log", (run_dir_ / "logs" / (stage.name + ".log")).string()}});
    const fs::path temporary = run_dir_ / "stack.json.tmp";
    std::ofstream(temporary) << state.dump(2) << '\n';
    fs::rename(temporary, run_dir_ / "stack.json");
  }

  // DIR/prometheus_targets.json for Prometheus's file_sd_configs: one target per stage whose
  // port file exists (the stage is serving), labelled with the stage's name and kind; rewritten
  // (atomically) only when a stage's port changes, so Prometheus reloads it only then.
  void write_targets() {
    const std::string host = access_.value("metrics_bind", std::string("127.0.0.1"));
    const std::string address = host == "0.0.0.0" || host == "::" ? "127.0.0.1" : host;
    nlohmann::json targets = nlohmann::json::array();
    for (const StageProcess& stage : stages_) {
      const int port = read_port(run_dir_ / (stage.name + ".port"));
      if (stage.pid == 0 || port <= 0) continue;
      targets.push_back({{"targets", {address + ":" + std::to_string(port)}},
                         {"labels", {{"stage", stage.name}, {"stage_kind", stage.stage}}}});
    }
    if (targets == last_targets_) return;
    const fs::path temporary = run_dir_ / "prometheus_targets.json.tmp";
    std::ofstream(temporary) << targets.dump(2) << '\n';
    fs::rename(temporary, run_dir_ / "prometheus_targets.json");
    last_targets_ = std::move(targets);
  }

  fs::path run_dir_;
  std::vector<StageProcess> stages_;
  nlohmann::json last_targets_;
  nlohmann::json access_;  // endpoints, transport, keys: written into stack.json
  std::chrono::seconds stall_silence_;
  runtime::Logger log_;
};

pid_t supervisor_pid(const fs::path& run_dir) {
  std::ifstream in(run_dir / "supervisor.pid");
  pid_t pid = 0;
  in >> pid;
  return in && alive(pid) ? pid : 0;
}

struct StageHealth {
  std::string name;
  int pid = 0, restarts = 0, http = 0, port = 0;
  nlohmann::json detail;  // the /healthz body, when it is JSON
};

std::vector<StageHealth> stage_health(const fs::path& run_dir) {
  std::ifstream in(run_dir / "stack.json");
  if (!in) return {};
  nlohmann::json state = nlohmann::json::parse(in, nullptr, false);
  std::vector<StageHealth> out;
  if (!state.is_object()) return out;
  for (const auto& stage : state["stages"]) {
    StageHealth h;
    h.name = stage.value("name", "");
    h.pid = stage.value("pid", 0);
    h.restarts = stage.value("restarts", 0);
    h.port = read_port(stage.value("port_file", ""));
    std::string body;
    h.http = alive(h.pid) ? health(h.port, &body) : -1;
    h.detail = nlohmann::json::parse(body, nullptr, false);
    out.push_back(h);
  }
  return out;
}

int up(int argc, char** argv) {
  std::vector<runtime::ConfigKey> keys = {
      {"model", "", "checkpoint folder"},
      {"run-dir", "", "run directory"},
      {"prefill", "1", "prefill processes"},
      {"decode", "1", "decode processes"},
      {"probe", "1", "probe processes"},
      {"threads", "0", "threads per compute process"},
      {"quant-math", "fast", "exact or fast"},
      {"bf16-math", "exact", "exact or fast"},
      {"timeout-s", "120", "seconds to wait for health"},
      {"stall-silence-s", "2",
       "a stage whose liveness file is older than this at three checks a second apart is killed "
       "and restarted"},
      {"expert-budget", "", "host expert pool size"},
      {"device", "cpu", "where prefill and decode compute"},
      {"device-expert-budget", "", "GPU expert cache size"},
      {"transport", "ipc", "ipc or tcp"},
      {"curve", "on", "on or off (tcp only)"},
      {"api-keys", "", "the gateway's API keys file"},
      {"http-port", "8000",
       "the OpenAI-compatible HTTP API's port (0: any free "
       "port; off: no HTTP stage)"},
      {"http-bind", "127.0.0.1", "the HTTP API's address"},
      {"metrics-port-base", "0", "first of the stages' metrics ports (0: any free)"},
      {"metrics-bind", "127.0.0.1", "the stages' metrics address"},
      {"stage-config", "", ""}};
  // --config is the stage config file, passed through: take it out before parsing.
  std::string stage_config;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
      stage_config = argv[++i];
      continue;
    }
    rest.push_back(argv[i]);
  }
  runtime::Config config =
      runtime::Config::load("stack", keys, static_cast<int>(rest.size()), rest.data());
  if (config.text("run-dir").empty()) throw runtime::ConfigError("--run-dir is required");
  std::string model = config.text("model");
  if (model.empty()) {
    const char* env = env::get(env::kModel);
    model = env != nullptr && *env != '\0' ? env : MOELINE_DEFAULT_MODEL;
  }
  if (!fs::exists(model)) throw runtime::ConfigError("model " + model + " does not exist");
  const int prefill = static_cast<int>(config.integer("prefill"));
  const int decode = static_cast<int>(config.integer("decode"));
  if (prefill < 1 || decode < 1) throw runtime::ConfigError("--prefill and --decode must be >= 1");
  const int probes = static_cast<int>(config.integer("probe"));
  if (probes < 1 || probes > 64) throw runtime::ConfigError("--probe must be in [1, 64]");
  if (!stage_config.empty() && !fs::exists(stage_config))
    throw runtime::ConfigError("config file " + stage_config + " does not exist");
  const int64_t stall_silence_s = config.integer("stall-silence-s");
  if (stall_silence_s < 1 || stall_silence_s > 3600)
    throw runtime::ConfigError("--stall-silence-s must be 1 to 3600, got " +
                               std::to_string(stall_silence_s));
  int threads = static_cast<int>(config.integer("threads"));
  if (threads <= 0)
    threads =
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / (prefill + decode));

  const std::string transport = config.text("transport");
  if (transport != "ipc" && transport != "tcp")
    throw runtime::ConfigError("--transport must be ipc or tcp");
  if (!config.text("api-keys").empty() && !fs::exists(config.text("api-keys")))
    throw runtime::ConfigError("--api-keys " + config.text("api-keys") + " does not exist");
  const fs::path run_dir = fs::absolute(config.text("run-dir"));
  fs::create_directories(run_dir / "logs");
  // The run directory holds the ipc:// sockets, the logs and the keys: its owner's alone.
  fs::permissions(run_dir, fs::perms::owner_all, fs::perm_options::replace);
  if (pid_t pid = supervisor_pid(run_dir))
    throw std::runtime_error("a stack is already running in " + run_dir.string() +
                             " (supervisor pid " + std::to_string(pid) + "); stack down first");
  fs::remove(run_dir / "stack.json");
  nlohmann::json access = {{"transport", transport}};
  std::string hub, endpoint;
  // Loopback ports chosen together, so that they differ: asked for one at a time, the kernel once
  // gave the hub and the client endpoint the same port, and the gateway could not start. The
  // third is the HTTP front's when it asks for any port.
  const std::vector<int> ports = free_loopback_ports(3);
  std::vector<std::string> common = {"--model", fs::absolute(model).string()};
  if (transport == "ipc") {
    // ipc:// paths are limited to ~107 bytes by the socket address.
    hub = "ipc://" + (run_dir / "hub.sock").string();
    endpoint = "ipc://" + (run_dir / "client.sock").string();
    if (endpoint.size() > 100) throw runtime::ConfigError("--run-dir path is too long for ipc://");
  } else {
    // Loopback tcp:// with Curve: the path a multi-host deployment takes, keys made here.
    hub = "tcp://127.0.0.1:" + std::to_string(ports[0]);
    endpoint = "tcp://127.0.0.1:" + std::to_string(ports[1]);
    if (config.text("curve") == "on") {
      const fs::path keys_dir = run_dir / "keys";
      runtime::init_key_directory(keys_dir, false);  // kept across `stack up`s of this directory
      common.insert(common.end(), {"--curve-dir", keys_dir.string()});
      access["server_key"] = (keys_dir / "gateway.pub").string();
    } else if (config.text("curve") != "off") {
      throw runtime::ConfigError("--curve must be on or off");
    }
    access["curve"] = config.text("curve") == "on";
  }
  access["endpoint"] = endpoint;
  access["hub"] = hub;
  access["api_keys"] = config.text("api-keys").empty()
                           ? nlohmann::json(nullptr)
                           : nlohmann::json(fs::absolute(config.text("api-keys")).string());
  access["open"] = config.text("api-keys").empty();
  if (!stage_config.empty()) {
    common.push_back("--config");
    common.push_back(fs::absolute(stage_config).string());
  }
  // Every process of the hub computes with the same arithmetic (part of the settings hash).
  const std::vector<std::string> arithmetic = {"--quant-math", config.text("quant-math"),
                                               "--bf16-math", config.text("bf16-math")};
  auto worker = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = common;
    args.push_back("--hub");
    args.push_back(hub);
    args.insert(args.end(), arithmetic.begin(), arithmetic.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  std::vector<StageProcess> stages;
  std::vector<std::string> gateway_args = common;
  gateway_args.insert(gateway_args.end(), arithmetic.begin(), arithmetic.end());
  gateway_args.insert(gateway_args.end(), {"--client-bind", endpoint, "--hub-bind", hub});
  if (!config.text("api-keys").empty())
    gateway_args.insert(gateway_args.end(),
                        {"--api-keys", fs::absolute(config.text("api-keys")).string()});
  stages.push_back({"gateway", "gateway", gateway_args});
  // The probes' snapshot stores keep their disk tiers in the run directory, one each (they shard
  // the namespaces): they survive restarts. One probe keeps the names of a single-probe stack.
  for (int i = 0; i < probes; ++i) {
    const std::string name = probes == 1 ? "probe" : "probe-" + std::to_string(i);
    const fs::path store = run_dir / (probes == 1 ? std::string("store") : "store-" + name);
    stages.push_back({name, "probe", worker({"--store-path", store.string()})});
  }
  // The node's expert pool: the offload manager creates it, the compute processes attach to it.
  std::vector<std::string> offload_args;
  if (!config.text("expert-budget").empty())
    offload_args = {"--expert-budget", config.text("expert-budget")};
  stages.push_back({"offload", "offload", worker(offload_args)});
  std::vector<std::string> compute_args = {"--threads", std::to_string(threads), "--device",
                                           config.text("device")};
  if (!config.text("device-expert-budget").empty()) {
    if (config.text("device") == "cpu")
      throw runtime::ConfigError("--device-expert-budget needs --device cuda");
    compute_args.insert(compute_args.end(),
                        {"--device-expert-budget", config.text("device-expert-budget")});
  }
  // The OpenAI-compatible HTTP front: a client of the gateway like any other.
  if (config.text("http-port") != "off") {
    int port = 0;
    try {
      port = std::stoi(config.text("http-port"));
    } catch (const std::exception&) {
      port = -1;
    }
    if (port < 0 || port > 65535)
      throw runtime::ConfigError("--http-port must be a port number, 0 or off");
    if (port == 0) port = ports[2];
    const std::string listen = config.text("http-bind") + ":" + std::to_string(port);
    std::vector<std::string> http_args = common;
    http_args.insert(http_args.end(), {"--gateway", endpoint, "--listen", listen});
    if (!config.text("api-keys").empty())  // for what it answers itself (models, tokenize)
      http_args.insert(http_args.end(),
                       {"--api-keys", fs::absolute(config.text("api-keys")).string()});
    stages.push_back({"http", "http", http_args});
    access["http"] = "http://" + listen;
  }
  for (int i = 0; i < prefill; ++i)
    stages.push_back({"prefill-" + std::to_string(i), "prefill", worker(compute_args)});
  for (int i = 0; i < decode; ++i)
    stages.push_back({"decode-" + std::to_string(i), "decode", worker(compute_args)});

  // Stable metrics ports: stage i at base + i, in the order `stack status` lists them.
  const int64_t port_base = config.integer("metrics-port-base");
  const int64_t last_port = port_base + static_cast<int64_t>(stages.size()) - 1;
  if (port_base < 0 || (port_base > 0 && (port_base < 1024 || last_port > 65535)))
    throw runtime::ConfigError("--metrics-port-base must be 0 or a port in [1024, " +
                               std::to_string(65535 - stages.size() + 1) + "]");
  for (size_t i = 0; i < stages.size(); ++i)
    stages[i].args.insert(stages[i].args.end(),
                          {"--http", config.text("metrics-bind") + ":" +
                                         std::to_string(port_base == 0 ? 0 : port_base + i)});
  access["metrics_bind"] = config.text("metrics-bind");

  std::cout.flush();
  const pid_t child = ::fork();
  if (child < 0) throw std::runtime_error("fork failed");
  if (child == 0) {
    ::setsid();
    const int fd =
        ::open((run_dir / "supervisor.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
    std::ofstream(run_dir / "supervisor.pid") << ::getpid() << '\n';
    ::_exit(Supervisor(run_dir, std::move(stages), access,
                       std::chrono::seconds(config.integer("stall-silence-s")))
                .run());
  }

  const auto until = Clock::now() + std::chrono::seconds(config.integer("timeout-s"));
  while (Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    int status = 0;
    if (::waitpid(child, &status, WNOHANG) == child)
      throw std::runtime_error("the supervisor exited; see " +
                               (run_dir / "supervisor.log").string());
    auto health = stage_health(run_dir);
    if (health.empty()) continue;
    // A stage that keeps dying while the stack starts will not come up by waiting: say why now.
    for (const StageHealth& h : health) {
      if (h.restarts < 3) continue;
      const fs::path log = run_dir / "logs" / (h.name + ".log");
      std::cerr << "moeline: error: stage " << h.name << " exited " << h.restarts + 1
                << " times while the stack started; the end of " << log.string() << ":\n";
      std::ifstream in(log);
      std::vector<std::string> lines;
      for (std::string line; std::getline(in, line);) lines.push_back(line);
      for (size_t i = lines.size() > 8 ? lines.size() - 8 : 0; i < lines.size(); ++i)
        std::cerr << "  " << lines[i] << '\n';
      ::kill(child, SIGTERM);
      ::waitpid(child, nullptr, 0);
      return 1;
    }
    bool all = true;
    for (const StageHealth& h : health) all = all && h.http == 200;
    if (all) {
      std::cout << endpoint << std::endl;
      std::cerr << "moeline: stack up in " << run_dir.string() << ": " << health.size()
                << " stages healthy (gateway, probe, offload, " << prefill << " prefill, " << decode
                << " decode" << (access.contains("http") ? ", http" : "") << ")\n";
      if (access.contains("http"))
        std::cerr << "moeline: OpenAI-compatible API at " << access["http"].get<std::string>()
                  << "/v1\n";
      return 0;
    }
  }
  std::cerr << "moeline: error: the stack did not become healthy within "
            << config.integer("timeout-s") << " s; stages:\n";
  for (const StageHealth& h : stage_health(run_dir))
    std::cerr << "  " << h.name << " pid=" << h.pid << " http=" << h.http
              << " log=" << (run_dir / "logs" / (h.name + ".log")).string() << '\n';
  ::kill(child, SIGTERM);
  return 1;
}

int status(int argc, char** argv) {
  std::vector<runtime::ConfigKey> keys = {{"run-dir", "", "run directory"},
                                          {"json", "false", "JSON output", true}};
  runtime::Config config = runtime::Config::load("stack", keys, argc, argv);
  if (config.text("run-dir").empty()) throw runtime::ConfigError("--run-dir is required");
  const fs::path run_dir = fs::absolute(config.text("run-dir"));
  const pid_t supervisor = supervisor_pid(run_dir);
  auto health = stage_health(run_dir);
  bool healthy = supervisor != 0 && !health.empty();
  nlohmann::json out = {{"run_dir", run_dir.string()},
                        {"supervisor_pid", supervisor},
                        {"endpoint", "ipc://" + (run_dir / "client.sock").string()},
                        {"stages", nlohmann::json::array()}};
  // Every endpoint and who may use it, as `stack up` recorded them.
  std::ifstream state_file(run_dir / "stack.json");
  const nlohmann::json state = nlohmann::json::parse(state_file, nullptr, false);
  if (state.is_object())
    for (const char* key :
         {"transport", "endpoint", "hub", "http", "server_key", "api_keys", "open"})
      if (state.contains(key)) out[key] = state[key];
  out["endpoints"] = {{"client", out["endpoint"]},
                      {"hub", out.value("hub", nlohmann::json())},
                      {"http", out.value("http", nlohmann::json())}};
  // Each stage's own endpoints besides the hub link (its intake, where peers send it bulk data
  // directly), as its /healthz advertises them.
  nlohmann::json intakes = nlohmann::json::object();
  for (const StageHealth& h : health) {
    healthy = healthy && h.http == 200;
    if (h.detail.is_object() && h.detail.contains("endpoints") &&
        h.detail["endpoints"].is_object() && h.detail["endpoints"].contains("intake"))
      intakes[h.name] = h.detail["endpoints"]["intake"];
    if (h.name == "offload" && h.detail.is_object() && h.detail.contains("expert_pool"))
      out["expert_pool"] = h.detail["expert_pool"];
    out["stages"].push_back({{"name", h.name},
                             {"pid", h.pid},
                             {"restarts", h.restarts},
                             {"http_port", h.port},
                             {"healthy", h.http == 200}});
  }
  out["endpoints"]["intakes"] = intakes;
  out["healthy"] = healthy;
  // The gateway knows whether approximate reuse is on (the rollback controller's state).
  for (const StageHealth& h : health)
    if (h.name == "gateway" && h.detail.is_object() && h.detail.contains("approximate"))
      out["approximate"] = h.detail["approximate"];
  if (config.flag("json")) {
    std::cout << out.dump(2) << '\n';
  } else if (supervisor == 0) {
    std::cout << "no stack running in " << run_dir.string() << '\n';
  } else {
    std::cout << "stack in " << run_dir.string() << " (supervisor " << supervisor << "), endpoint "
              << out["endpoint"].get<std::string>() << '\n';
    if (out.contains("http") && out["http"].is_string())
      std::cout << "OpenAI-compatible API: " << out["http"].get<std::string>() << "/v1\n";
    std::printf("%-12s %8s %8s %10s %s\n", "stage", "pid", "restarts", "http", "health");
    for (const StageHealth& h : health)
      std::printf("%-12s %8d %8d %10d %s\n", h.name.c_str(), h.pid, h.restarts, h.port,
                  h.http == 200 ? "ok" : (h.http == -1 ? "down" : "unhealthy"));
    if (out.contains("expert_pool") && out["expert_pool"].is_object()) {
      const nlohmann::json& p = out["expert_pool"];
      std::cout << "expert pool: " << p.value("name", "") << ", " << p.value("slots", 0)
                << " slots, hit ratio " << p.value("hit_ratio", 0.0) << ", " << p.value("loads", 0)
                << " loads\n";
    }
    if (out.value("open", true))
      std::cout << "access: open (no API keys): any client that reaches the endpoint names its "
                   "own tenant and may run operator commands\n";
    else
      std::cout << "access: API keys (" << out.value("api_keys", std::string()) << ")\n";
    if (out.contains("approximate")) {
      const nlohmann::json& a = out["approximate"];
      std::cout << "approximate reuse: " << (a.value("enabled", false) ? "on" : "off") << " ("
                << a.value("reason", "") << ")\n";
    }
  }
  return healthy ? 0 : 1;
}

int down(int argc, char** argv) {
  std::vector<runtime::ConfigKey> keys = {{"run-dir", "", "run directory"}};
  runtime::Config config = runtime::Config::load("stack", keys, argc, argv);
  if (config.text("run-dir").empty()) throw runtime::ConfigError("--run-dir is required");
  const fs::path run_dir = fs::absolute(config.text("run-dir"));
  const pid_t supervisor = supervisor_pid(run_dir);
  if (supervisor == 0) {
    std::cout << "no stack running in " << run_dir.string() << '\n';
    return 0;
  }
  ::kill(supervisor, SIGTERM);
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (alive(supervisor) && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (alive(supervisor)) {
    std::cerr << "moeline: error: the supervisor (pid " << supervisor
              << ") did not stop within 60 s\n";
    return 1;
  }
  std::cout << "stack in " << run_dir.string() << " stopped\n";
  return 0;
}

}  // namespace

nlohmann::json stack_stage_detail(const std::filesystem::path& run_dir, const std::string& stage) {
  for (const StageHealth& h : stage_health(fs::absolute(run_dir)))
    if (h.name == stage && h.detail.is_object()) return h.detail;
  return nullptr;
}

namespace {

// The kernel's ephemeral range, from which it gives every outgoing connection its local port.
std::pair<int, int> ephemeral_port_range() {
  std::ifstream file("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (file >> low >> high && 0 < low && low <= high && high <= 65535) return {low, high};
  return {32768, 60999};  // Linux's default
}

// Binds `fd` to 127.0.0.1:`port` (0: any port the kernel picks); the bound port, or 0.
int bind_loopback(int fd, int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t size = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) != 0)
    return 0;
  return ntohs(address.sin_port);
}

}  // namespace

std::vector<int> free_loopback_ports(int count) {
  // Chosen outside the ephemeral range: a port from it can be handed to an outgoing connection
  // between the choice and the gateway's bind (CI saw a gateway restart on "Address already in
  // use" until the test gave up), and a stage connecting to a hub port of that range before the
  // hub listens can even be connected to itself. Ports below the range are never given out by
  // the kernel; only a listener started by hand can take one, which the bind here rules out.
  const auto [ephemeral_low, ephemeral_high] = ephemeral_port_range();
  std::vector<std::pair<int, int>> ranges;  // [first, last] to choose from
  if (ephemeral_low > 10'000 + 1'000) ranges.emplace_back(10'000, ephemeral_low - 1);
  if (ephemeral_high < 65'535 - 1'000) ranges.emplace_back(ephemeral_high + 1, 65'535);
  std::mt19937 rng(std::random_device{}());
  std::vector<int> sockets, ports;
  auto close_all = [&] {
    for (const int fd : sockets) ::close(fd);
  };
  while (static_cast<int>(ports.size()) < count) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
      close_all();
      throw std::runtime_error("cannot open a socket to find a free port");
    }
    sockets.push_back(fd);
    int port = 0;
    for (int attempt = 0; attempt < 64 && port == 0 && !ranges.empty(); ++attempt) {
      const auto [first, last] = ranges[rng() % ranges.size()];
      port = bind_loopback(fd, std::uniform_int_distribution<int>(first, last)(rng));
    }
    // A host whose whole port space is ephemeral, or crowded: any port the kernel gives.
    if (port == 0) port = bind_loopback(fd, 0);
    if (port == 0) {
      close_all();
      throw std::runtime_error("no free port on 127.0.0.1");
    }
    ports.push_back(port);
  }
  close_all();
  return ports;
}

int stack_command(int argc, char** argv) {
  // `moeline stack up --help` as well as `moeline stack --help`: the usage, and nothing run.
  const bool help = std::any_of(argv, argv + argc, [](const char* arg) {
    return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0;
  });
  if (argc < 1 || help) {
    std::cout << kUsage;
    return argc < 1 ? 2 : 0;
  }
  const std::string sub = argv[0];
  return cli::run_reporting_errors<runtime::ConfigError>(kUsage, [&] {
    if (sub == "up") return up(argc - 1, argv + 1);
    if (sub == "status") return status(argc - 1, argv + 1);
    if (sub == "down") return down(argc - 1, argv + 1);
    throw runtime::ConfigError("unknown stack command '" + sub + "'");
  });
}

}  // namespace moeline::stages
