#pragma once
// The HTTP stage's one connection to the gateway. The SDK's Client is single-threaded, and the
// HTTP server runs a thread per connection, so one thread owns the Client: handlers hand it
// requests and cancellations through a queue (waking it with an eventfd) and receive their
// events on a channel of their own.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "sdk/client.h"
#include "stages/runtime/log.h"

namespace moeline::stages::http {

// The events of one request, from the bridge thread to the handler that waits for them.
class RequestChannel {
 public:
  using Clock = std::chrono::steady_clock;
  void push(sdk::Event event);
  // The next event, or nullopt after `timeout`.
  std::optional<sdk::Event> next(std::chrono::milliseconds timeout);

  // From now on each event goes to `consumer` as it arrives, on the bridge thread, instead of
  // waiting in the queue for next() (those already queued go to it first, on this thread), until
  // it returns false. A streaming response writes its tokens this way, without a wake-up of its
  // own thread per token. Returns false if the consumer finished on the queued events.
  using Consumer = std::function<bool(const sdk::Event& event, Clock::time_point arrived)>;
  bool attach(Consumer consumer);
  // Waits until the attached consumer has returned false, or `deadline`; either way it is then
  // detached (never called again). True if it finished.
  bool wait_consumed(Clock::time_point deadline);

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::pair<sdk::Event, Clock::time_point>> events_;
  Consumer consumer_;
  bool consumed_ = false;
};

class GatewayBridge {
 public:
  GatewayBridge(std::string endpoint, sdk::Credentials credentials, runtime::Logger& log);
  ~GatewayBridge();
  GatewayBridge(const GatewayBridge&) = delete;
  GatewayBridge& operator=(const GatewayBridge&) = delete;

  // Sends a request; its events (Accepted, Delta..., Finished or Error) arrive on the channel.
  std::shared_ptr<RequestChannel> start(sdk::GenerateOptions options);
  // The caller no longer wants the request (its client went away, a stop string ended it): the
  // gateway stops generating it. Nothing more arrives on the channel.
  void cancel(const std::shared_ptr<RequestChannel>& channel);
  bool connected() const { return connected_.load(); }
  size_t in_flight() const { return in_flight_.load(); }

 private:
  struct Command {
    std::shared_ptr<RequestChannel> channel;
    std::optional<sdk::GenerateOptions> start;  // empty: cancel
  };
  void loop();
  void run_commands(sdk::Client& client);
  void wake();
  void fail_all(const std::string& why);

  std::string endpoint_;
  sdk::Credentials credentials_;
  runtime::Logger& log_;
  int wake_fd_ = -1;
  std::mutex mutex_;
  std::deque<Command> commands_;
  std::atomic<bool> stopping_{false}, connected_{false};
  std::atomic<size_t> in_flight_{0};
  // Bridge thread only.
  std::map<uint64_t, std::shared_ptr<RequestChannel>> by_id_;
  std::map<const RequestChannel*, uint64_t> ids_;
  std::thread thread_;
};

}  // namespace moeline::stages::http
