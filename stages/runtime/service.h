#pragma once
// What every stage process has besides its loop: the logger, the metrics registry, an HTTP
// endpoint with /metrics (Prometheus text) and /healthz, a watchdog, and a stop flag set by
// SIGTERM / SIGINT.
//
// The watchdog: the stage loop calls tick() every iteration; when it has not for longer than the
// limit (a loop stuck in a forward pass or a deadlock), /healthz answers 503 and the supervisor
// (moeline stack, or the container runtime) replaces the process.

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"
#include "stages/runtime/process_metrics.h"

namespace httplib {
class Server;
}

namespace moeline::runtime {

class StageService {
 public:
  StageService(std::string stage, std::string replica);
  ~StageService();
  StageService(const StageService&) = delete;
  StageService& operator=(const StageService&) = delete;

  // Serves /metrics, /livez, /readyz and /healthz on "host:port" (port 0: any free port; written
  // to port_file when one is given). /livez: the stage loop is not wedged (200 until it has been
  // idle past the watchdog; a stage still starting is alive), what an orchestrator restarts on.
  // /readyz and /healthz (the same answer): ready for work (joined its hub, loop not wedged), what
  // a load balancer routes on. `health_detail` adds fields to their JSON; it runs on the HTTP
  // thread.
  // With a port file, a thread of its own also rewrites "<port_file>.alive" twice a second with
  // the loop's idle time: the supervisor's liveness check reads that file, so a port any local
  // user can fill with slow connections cannot get a healthy stage killed. The HTTP server
  // itself times slow connections out after 2 s.
  void start_http(const std::string& address, const std::string& port_file,
                  std::function<nlohmann::json()> health_detail = {});
  uint16_t http_port() const { return port_; }
  // An endpoint this process serves besides the hub link and HTTP (its intake): /healthz lists
  // it under "endpoints", and `stack status --json` with the stack's own, so an operator sees
  // every port a stack opens. Any thread.
  void advertise(const std::string& name, const std::string& endpoint);
  // Stops the HTTP and liveness threads (idempotent; the destructor calls it too). A stage whose
  // `health_detail` reads objects that die before this service calls it first: the HTTP thread
  // must not read them while they are destroyed.
  void stop_http();

  void tick() {
    last_tick_ns_.store(now_ns(), std::memory_order_relaxed);
    ticked_.store(true, std::memory_order_relaxed);
  }
  void set_watchdog_limit(std::chrono::milliseconds limit) { watchdog_ms_ = limit.count(); }
  void set_ready(bool ready) { ready_.store(ready); }
  // What the stage is doing before it is ready ("loading model", "joining hub"): /readyz reports
  // it, with the seconds spent in it, while it answers 503. A string literal (the HTTP thread
  // reads it).
  void set_phase(const char* phase) {
    phase_since_ns_.store(now_ns(), std::memory_order_relaxed);
    phase_done_.store(-1, std::memory_order_relaxed);
    phase_.store(phase);
  }
  // How far the current phase is (`done` of `total`: the model's layers while it loads); /readyz
  // reports it as `progress` (0 to 1) with the count.
  void set_phase_progress(int64_t done, int64_t total) {
    phase_total_.store(total, std::memory_order_relaxed);
    phase_done_.store(done, std::memory_order_relaxed);
  }
  bool healthy() const;
  // The loop has not been idle past the watchdog (or has not started yet).
  bool alive() const;

  // Runs one message handler so that nothing it throws reaches the stage loop: an exception is
  // a bug or input no check caught, never a reason to drop every other request this process
  // holds. It is counted (moeline_handler_errors_total{stage,handler}) and logged, and false is
  // returned so the caller can answer the sender with an error.
  template <typename Handler>
  bool guard(const char* handler, Handler&& run) noexcept {
    try {
      run();
      return true;
    } catch (const std::exception& e) {
      report_handler_error(handler, e.what());
    } catch (...) {
      report_handler_error(handler, "unknown exception");
    }
    return false;
  }

  // SIGINT stops at once. SIGTERM asks for a drain: a stage that drains (prefill, decode, the
  // gateway) stops taking work, finishes what it holds within its grace period, hands back the
  // rest and exits; for every other stage it is a stop. A second SIGTERM stops at once.
  static void install_signal_handlers();
  static bool stop_requested();
  static bool drain_requested();
  // Called by a stage that drains: from then on SIGTERM alone does not make stop_requested() true.
  static void set_drains(bool drains);

  Logger log;
  Registry metrics;

 private:
  static int64_t now_ns();
  void report_handler_error(const char* handler, const char* what) noexcept;
  void liveness_loop(std::string path);
  std::unique_ptr<httplib::Server> server_;
  std::thread http_thread_, liveness_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> http_thread_done_{false};  // listen_after_bind returned
  uint16_t port_ = 0;
  std::atomic<int64_t> last_tick_ns_;
  std::atomic<bool> ticked_{false};
  std::atomic<bool> ready_{false};
  std::atomic<const char*> phase_{"starting"};
  std::atomic<int64_t> phase_since_ns_{0};
  std::atomic<int64_t> phase_done_{-1}, phase_total_{0};  // -1: the phase reports no progress
  int64_t watchdog_ms_ = 30000;
  RateLimited handler_error_log_;
  ProcessMetrics process_metrics_{metrics};
  mutable std::mutex endpoints_mutex_;
  std::map<std::string, std::string> endpoints_;  // advertise()'s, read by the HTTP thread
};

// "moeline-<stage>-<hostname>-<pid>": unique per process, stable in logs.
std::string default_replica_name(const std::string& stage);

}  // namespace moeline::runtime
