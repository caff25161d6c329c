#include "stages/runtime/service.h"

#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

namespace moeline::runtime {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<bool> g_drain{false};
std::atomic<bool> g_drains{false};

void on_signal(int signal) {
  if (signal == SIGTERM && !g_drain.load()) {
    g_drain.store(true);
    if (g_drains.load()) return;
  }
  g_stop.store(true);
}

}  // namespace

StageService::StageService(std::string stage, std::string replica)
    : log(std::move(stage), std::move(replica)),
      last_tick_ns_(now_ns()),
      phase_since_ns_(now_ns()) {
  metrics.gauge("moeline_process_start_time_seconds", "Unix time the process started")
      .set(static_cast<double>(std::time(nullptr)));
  metrics.declare_counter(kHandlerErrors);
  metrics.declare_counter(kWireRejectedFrames);
}

StageService::~StageService() {
  stop_http();
}

void StageService::stop_http() {
  stopping_.store(true);
  if (http_thread_.joinable()) {
    // cpp-httplib's stop() does nothing until the listening thread has begun: a stop that came
    // first (a stage whose setup failed just after start_http) would leave it serving and this
    // join waiting forever. So wait for it to begin (or to have ended) before stopping it.
    while (!server_->is_running() && !http_thread_done_.load())
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    server_->stop();
    http_thread_.join();
  }
  if (liveness_thread_.joinable()) liveness_thread_.join();
}

void StageService::liveness_loop(std::string path) {
  const std::string temporary = path + ".tmp";
  while (!stopping_.load()) {
    const int64_t idle_ms = (now_ns() - last_tick_ns_.load(std::memory_order_relaxed)) / 1'000'000;
    {
      std::ofstream out(temporary, std::ios::trunc);
      out << nlohmann::json{{"pid", ::getpid()},
                            {"ready", ready_.load()},
                            {"loop_idle_ms", idle_ms},
                            {"watchdog_ms", watchdog_ms_}}
                 .dump()
          << '\n';
    }
    std::rename(temporary.c_str(), path.c_str());
    // By the clock, not by naps counted: a process that was stopped (SIGSTOP) and runs again
    // says so at once, rather than after another half second of running.
    const auto next = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    while (!stopping_.load() && std::chrono::steady_clock::now() < next)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int64_t StageService::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool StageService::alive() const {
  const int64_t idle_ms = (now_ns() - last_tick_ns_.load(std::memory_order_relaxed)) / 1'000'000;
  return !ticked_.load(std::memory_order_relaxed) || idle_ms <= watchdog_ms_;
}

bool StageService::healthy() const {
  const int64_t idle_ms = (now_ns() - last_tick_ns_.load(std::memory_order_relaxed)) / 1'000'000;
  return ready_.load() && idle_ms <= watchdog_ms_;
}

void StageService::advertise(const std::string& name, const std::string& endpoint) {
  std::lock_guard lock(endpoints_mutex_);
  endpoints_[name] = endpoint;
}

void StageService::start_http(const std::string& address, const std::string& port_file,
                              std::function<nlohmann::json()> health_detail) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos)
    throw std::runtime_error("--http expects HOST:PORT, got '" + address + "'");
  const std::string host = address.substr(0, colon);
  const int port = std::stoi(address.substr(colon + 1));
  server_ = std::make_unique<httplib::Server>();
  // A connection that sends nothing, or reads nothing, is closed after 2 s: slow clients cannot
  // hold the server's threads for long.
  server_->set_read_timeout(2, 0);
  server_->set_write_timeout(2, 0);
  server_->set_keep_alive_max_count(8);
  server_->set_keep_alive_timeout(2);
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
    process_metrics_.update();
    response.set_content(metrics.render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  auto readiness = [this, health_detail](const httplib::Request&, httplib::Response& response) {
    const int64_t idle_ms = (now_ns() - last_tick_ns_.load(std::memory_order_relaxed)) / 1'000'000;
    nlohmann::json body = {{"stage", log.stage()},
                           {"replica", log.replica()},
                           {"ready", ready_.load()},
                           {"loop_idle_ms", idle_ms},
                           {"pid", ::getpid()}};
    if (std::lock_guard lock(endpoints_mutex_); !endpoints_.empty()) body["endpoints"] = endpoints_;
    if (health_detail) body.update(health_detail());
    if (!ready_.load()) {
      body["phase"] = phase_.load();
      body["phase_s"] =
          static_cast<double>(now_ns() - phase_since_ns_.load(std::memory_order_relaxed)) / 1e9;
      const int64_t done = phase_done_.load(std::memory_order_relaxed);
      const int64_t total = phase_total_.load(std::memory_order_relaxed);
      if (done >= 0 && total > 0) {
        body["progress"] = static_cast<double>(std::min(done, total)) / static_cast<double>(total);
        body["progress_done"] = done;
        body["progress_total"] = total;
      }
    }
    const bool ok = healthy();
    body["status"] = ok ? "ok" : (ready_.load() && !alive() ? "stalled" : "starting");
    response.status = ok ? 200 : 503;
    response.set_content(body.dump(), "application/json");
  };
  server_->Get("/readyz", readiness);
  server_->Get("/healthz", readiness);
  server_->Get("/livez", [this](const httplib::Request&, httplib::Response& response) {
    const int64_t idle_ms = (now_ns() - last_tick_ns_.load(std::memory_order_relaxed)) / 1'000'000;
    const bool ok = alive();
    response.status = ok ? 200 : 503;
    response.set_content(nlohmann::json{{"stage", log.stage()},
                                        {"replica", log.replica()},
                                        {"status", ok ? "alive" : "stalled"},
                                        {"loop_idle_ms", ticked_.load() ? idle_ms : 0},
                                        {"watchdog_ms", watchdog_ms_}}
                             .dump(),
                         "application/json");
  });
  int bound = port;
  if (port == 0) {
    bound = server_->bind_to_any_port(host);
  } else if (!server_->bind_to_port(host, port)) {
    bound = -1;
  }
  if (bound <= 0) throw std::runtime_error("cannot listen for HTTP on " + address);
  port_ = static_cast<uint16_t>(bound);
  if (!port_file.empty()) {
    const std::string temporary = port_file + ".tmp";
    std::ofstream(temporary) << port_ << '\n';
    std::rename(temporary.c_str(), port_file.c_str());
  }
  http_thread_ = std::thread([this] {
    server_->listen_after_bind();
    http_thread_done_.store(true);
  });
  if (!port_file.empty())
    liveness_thread_ = std::thread([this, path = port_file + ".alive"] { liveness_loop(path); });
  log.info("http_listening", {{"address", host + ":" + std::to_string(port_)}});
}

void StageService::report_handler_error(const char* handler, const char* what) noexcept {
  try {
    metrics.counter(kHandlerErrors, {{"stage", log.stage()}, {"handler", handler}}).inc();
    if (uint64_t suppressed = 0; handler_error_log_.allow(suppressed))
      log.error("handler_error",
                {{"handler", handler}, {"error", what}, {"suppressed", suppressed}});
  } catch (...) {
    // Reporting is best effort: the loop must go on even when memory is short.
  }
}

void StageService::install_signal_handlers() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

bool StageService::stop_requested() {
  return g_stop.load() || (g_drain.load() && !g_drains.load());
}

bool StageService::drain_requested() {
  return g_drain.load();
}

void StageService::set_drains(bool drains) {
  g_drains.store(drains);
}

std::string default_replica_name(const std::string& stage) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return stage + "-" + host + "-" + std::to_string(::getpid());
}

}  // namespace moeline::runtime
