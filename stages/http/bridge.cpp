#include "stages/http/bridge.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <stdexcept>

namespace moeline::stages::http {

void RequestChannel::push(sdk::Event event) {
  {
    std::lock_guard lock(mutex_);
    if (consumer_) {
      if (consumed_) return;
      bool more = false;
      try {
        more = consumer_(event, Clock::now());
      } catch (const std::exception&) {
        // The consumer's response is over (StreamedResponse ends it with an error itself); the
        // bridge thread goes on with every other request.
      }
      if (more) return;
      consumed_ = true;
    } else {
      events_.emplace_back(std::move(event), Clock::now());
    }
  }
  ready_.notify_one();
}

bool RequestChannel::attach(Consumer consumer) {
  std::lock_guard lock(mutex_);
  consumer_ = std::move(consumer);
  consumed_ = false;
  while (!events_.empty() && !consumed_) {
    auto [event, arrived] = std::move(events_.front());
    events_.pop_front();
    consumed_ = !consumer_(event, arrived);
  }
  return !consumed_;
}

bool RequestChannel::wait_consumed(Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  const bool finished = ready_.wait_until(lock, deadline, [&] { return consumed_; });
  consumer_ = nullptr;
  return finished;
}

std::optional<sdk::Event> RequestChannel::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!ready_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  sdk::Event event = std::move(events_.front().first);
  events_.pop_front();
  return event;
}

GatewayBridge::GatewayBridge(std::string endpoint, sdk::Credentials credentials,
                             runtime::Logger& log)
    : endpoint_(std::move(endpoint)), credentials_(std::move(credentials)), log_(log) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw std::runtime_error("eventfd failed");
  thread_ = std::thread([this] { loop(); });
}

GatewayBridge::~GatewayBridge() {
  stopping_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
  ::close(wake_fd_);
}

std::shared_ptr<RequestChannel> GatewayBridge::start(sdk::GenerateOptions options) {
  auto channel = std::make_shared<RequestChannel>();
  {
    std::lock_guard lock(mutex_);
    commands_.push_back({channel, std::move(options)});
  }
  wake();
  return channel;
}

void GatewayBridge::cancel(const std::shared_ptr<RequestChannel>& channel) {
  {
    std::lock_guard lock(mutex_);
    commands_.push_back({channel, std::nullopt});
  }
  wake();
}

void GatewayBridge::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t written = ::write(wake_fd_, &one, sizeof one);
}

void GatewayBridge::fail_all(const std::string& why) {
  for (auto& [id, channel] : by_id_) {
    sdk::Event event;
    event.client_request_id = id;
    event.kind = sdk::EventKind::kError;
    event.error_code = 9;  // StageFailed: the connection to the gateway is gone
    event.error_name = sdk::error_name(event.error_code);
    event.error_message = why;
    channel->push(std::move(event));
  }
  by_id_.clear();
  ids_.clear();
  in_flight_.store(0);
}

void GatewayBridge::run_commands(sdk::Client& client) {
  std::deque<Command> commands;
  {
    std::lock_guard lock(mutex_);
    commands.swap(commands_);
  }
  for (Command& command : commands) {
    if (command.start) {
      uint64_t id = 0;
      try {
        id = client.start(*command.start);
      } catch (const std::exception& e) {
        sdk::Event event;
        event.kind = sdk::EventKind::kError;
        event.error_code = 9;  // StageFailed
        event.error_name = sdk::error_name(event.error_code);
        event.error_message = e.what();
        command.channel->push(std::move(event));
        throw;
      }
      by_id_[id] = command.channel;
      ids_[command.channel.get()] = id;
    } else if (auto it = ids_.find(command.channel.get()); it != ids_.end()) {
      client.cancel(it->second);
      by_id_.erase(it->second);
      ids_.erase(it);
    }
  }
  in_flight_.store(by_id_.size());
}

void GatewayBridge::loop() {
  while (!stopping_.load()) {
    try {
      sdk::Client client(endpoint_, std::chrono::seconds(60), credentials_);
      client.set_wake_fd(wake_fd_);
      connected_.store(true);
      log_.info("gateway_connected", {{"endpoint", endpoint_}});
      while (!stopping_.load()) {
        uint64_t drained = 0;
        [[maybe_unused]] const ssize_t got = ::read(wake_fd_, &drained, sizeof drained);
        run_commands(client);
        std::optional<sdk::Event> event;
        try {
          event = client.next_event(std::chrono::milliseconds(200));
        } catch (const sdk::ClientError& e) {
          // An error about no request of ours (a cancel that crossed its request's end): the
          // connection and every other request are fine.
          log_.warn("gateway_error_reply", {{"error", e.what()}});
          continue;
        }
        if (!event) continue;
        auto it = by_id_.find(event->client_request_id);
        if (it == by_id_.end()) continue;  // cancelled meanwhile
        const bool terminal = event->terminal();
        it->second->push(std::move(*event));
        if (terminal) {
          ids_.erase(it->second.get());
          by_id_.erase(it);
          in_flight_.store(by_id_.size());
        }
      }
    } catch (const std::exception& e) {
      // A bad reply or a socket error: every open request ends with an error, and a fresh
      // connection is made (the SDK itself ends requests when the gateway restarts).
      connected_.store(false);
      log_.error("gateway_connection_failed", {{"endpoint", endpoint_}, {"error", e.what()}});
      fail_all(std::string("connection to the gateway failed: ") + e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  fail_all("the HTTP stage is stopping");
}

}  // namespace moeline::stages::http
