#include "stages/http/connection_threads.h"

#include <algorithm>

namespace moeline::stages::http {

ConnectionThreads::ConnectionThreads(size_t max_threads, size_t ready)
    : max_threads_(std::max<size_t>(max_threads, 1)) {
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < std::min(ready, max_threads_); ++i) start_worker();
  }
  spawner_ = std::thread([this] { spawn(); });
}

void ConnectionThreads::start_worker() {
  auto worker = std::make_unique<Worker>();
  Worker* raw = worker.get();
  workers_.push_back(std::move(worker));
  ++starting_;
  raw->thread = std::thread([this, raw] { work(*raw); });
}

void ConnectionThreads::enqueue(std::function<void()> job) {
  std::unique_lock lock(mutex_);
  if (stopping_) return;
  if (!idle_.empty()) {
    Worker* worker = idle_.back();
    idle_.pop_back();
    worker->job = std::move(job);
    lock.unlock();
    worker->wake.notify_one();
    return;
  }
  backlog_.push_back(std::move(job));
  if (workers_.size() < max_threads_) {
    lock.unlock();
    needed_.notify_one();
  }
}

void ConnectionThreads::spawn() {
  std::unique_lock lock(mutex_);
  while (true) {
    needed_.wait(
        lock, [&] { return stopping_ || (!backlog_.empty() && workers_.size() < max_threads_); });
    if (stopping_) return;
    // One thread per queued connection: each new thread takes a job from the backlog.
    start_worker();
  }
}

void ConnectionThreads::work(Worker& worker) {
  std::unique_lock lock(mutex_);
  --starting_;
  while (true) {
    if (worker.job) {
      std::function<void()> job = std::move(worker.job);
      worker.job = nullptr;
      lock.unlock();
      job();
      lock.lock();
      continue;
    }
    if (!backlog_.empty()) {
      worker.job = std::move(backlog_.front());
      backlog_.pop_front();
      continue;
    }
    if (stopping_) return;
    idle_.push_back(&worker);
    worker.wake.wait(lock, [&] { return worker.job != nullptr || stopping_; });
    if (!worker.job) return;  // stopping, nothing handed over
  }
}

void ConnectionThreads::shutdown() {
  std::vector<std::unique_ptr<Worker>> workers;
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
    idle_.clear();
  }
  needed_.notify_all();
  if (spawner_.joinable()) spawner_.join();
  {
    std::lock_guard lock(mutex_);
    workers.swap(workers_);
  }
  for (auto& worker : workers) worker->wake.notify_one();
  for (auto& worker : workers)
    if (worker->thread.joinable()) worker->thread.join();
}

size_t ConnectionThreads::started() const {
  std::lock_guard lock(mutex_);
  return workers_.size();
}

}  // namespace moeline::stages::http
