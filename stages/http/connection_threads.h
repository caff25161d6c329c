#pragma once
// The HTTP server's threads: one per open connection (a streaming response holds its thread),
// started as connections need them up to a limit, and kept once started. A new connection goes to
// the most recently idle thread, woken on a condition variable of its own. (cpp-httplib's
// ThreadPool starts every thread up front and wakes one of them through a single condition
// variable that they all wait on; with 1024 threads that hand-off alone added about 1 ms to every
// new connection.) Threads are started by a thread of their own, never by the accepting thread:
// starting one takes long enough that a burst of connections would overflow the listen backlog.

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <httplib.h>

namespace moeline::stages::http {

class ConnectionThreads : public httplib::TaskQueue {
 public:
  // `ready` threads are started at once.
  explicit ConnectionThreads(size_t max_threads, size_t ready = 8);
  ~ConnectionThreads() override { shutdown(); }
  ConnectionThreads(const ConnectionThreads&) = delete;
  ConnectionThreads& operator=(const ConnectionThreads&) = delete;

  // Runs `job` on an idle thread, or queues it for the next thread free or started.
  void enqueue(std::function<void()> job) override;
  void shutdown() override;

  size_t started() const;

 private:
  struct Worker {
    std::condition_variable wake;
    std::function<void()> job;
    std::thread thread;
  };
  void work(Worker& worker);
  void spawn();
  void start_worker();  // with mutex_ held

  const size_t max_threads_;
  mutable std::mutex mutex_;
  std::condition_variable needed_;  // the spawner's: queued jobs outnumber threads starting
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<Worker*> idle_;  // the most recently idle last: its stack and caches are warm
  std::deque<std::function<void()>> backlog_;
  size_t starting_ = 0;  // started threads that have not yet looked at the backlog
  bool stopping_ = false;
  std::thread spawner_;
};

}  // namespace moeline::stages::http
