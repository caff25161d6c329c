// Which HTTP library the OpenAI front should stand on, measured (docs/PERFORMANCE.md, "HTTP
// library"). N streaming connections are each sent a token every 1/rate s by one producer thread,
// as moeline's gateway bridge produces them; the client times each token's arrival against the
// moment it was produced (steady_clock is CLOCK_MONOTONIC, shared by the two processes). Servers:
//   httplib-direct   cpp-httplib, a thread per connection held by its response, tokens written
//                    by the producer thread (what `moeline http` does)
//   httplib-handoff  cpp-httplib, each token handed to the response's own thread through a
//                    condition variable (what `moeline http` did first)
//   beast            Boost.Beast over Asio: one thread, asynchronous; it parses the requests and
//                    writes every token
// The client is a child process: one epoll loop over every connection.
//
//   moeline_http_library_bench --server NAME --streams N --rate R --seconds S
//
// Prints one JSON object: tokens produced and received, delivery latency p50/p99/max (ms, after a
// one-second warm-up), the server process's CPU seconds per second, its peak RSS.

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>  // Boost 1.74's asio/awaitable.hpp uses std::exchange without including it
#include <vector>

#include <httplib.h>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "stages/http/connection_threads.h"

namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

std::string token_event(int64_t produced_ns) {
  return "data: " + std::to_string(produced_ns) + "\n\n";
}

struct Options {
  std::string server = "httplib-direct";
  int streams = 64;
  double rate = 20;  // tokens per second per stream
  double seconds = 10;
};

// --- the client (child process) -------------------------------------------------------------

struct Connection {
  int fd = -1;
  std::string buffer;
  bool open = false;
};

// Reads every connection until `stop`; tokens are timed from `measure_from`, and a connection
// that closes before `produced_until` counts as closed early.
json run_client(int port, const Options& options, Clock::time_point measure_from,
                Clock::time_point produced_until, Clock::time_point stop) {
  const int epoll = epoll_create1(0);
  std::vector<Connection> connections(static_cast<size_t>(options.streams));
  const std::string request =
      "POST /stream HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
      "Content-Length: 2\r\n\r\n{}";
  int opened = 0;
  for (size_t i = 0; i < connections.size(); ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
        write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
      close(fd);
      continue;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = i;
    epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event);
    connections[i] = {fd, {}, true};
    ++opened;
  }
  std::vector<double> latency_ms;
  uint64_t received = 0, closed_early = 0;
  std::vector<epoll_event> events(256);
  char chunk[65536];
  while (Clock::now() < stop) {
    const int ready = epoll_wait(epoll, events.data(), static_cast<int>(events.size()), 50);
    for (int e = 0; e < ready; ++e) {
      Connection& c = connections[events[static_cast<size_t>(e)].data.u64];
      while (true) {
        const ssize_t got = read(c.fd, chunk, sizeof chunk);
        if (got > 0) {
          c.buffer.append(chunk, static_cast<size_t>(got));
          continue;
        }
        if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
          if (c.open && Clock::now() < produced_until - std::chrono::milliseconds(200))
            ++closed_early;
          c.open = false;
          epoll_ctl(epoll, EPOLL_CTL_DEL, c.fd, nullptr);
        }
        break;
      }
      const int64_t arrived = now_ns();
      const bool measuring = Clock::now() >= measure_from;
      size_t at = 0;
      for (size_t found; (found = c.buffer.find("data: ", at)) != std::string::npos;) {
        const size_t blank = c.buffer.find("\n\n", found);
        if (blank == std::string::npos) break;
        const int64_t produced = std::stoll(c.buffer.substr(found + 6, blank - found - 6));
        ++received;
        if (measuring) latency_ms.push_back(static_cast<double>(arrived - produced) * 1e-6);
        at = blank + 2;
      }
      c.buffer.erase(0, at);
    }
  }
  for (Connection& c : connections)
    if (c.fd >= 0) close(c.fd);
  close(epoll);
  std::sort(latency_ms.begin(), latency_ms.end());
  auto quantile = [&](double q) {
    return latency_ms.empty() ? 0.0 : latency_ms[static_cast<size_t>(q * (latency_ms.size() - 1))];
  };
  return {{"connections", opened},
          {"received", received},
          {"closed_early", closed_early},
          {"latency_ms",
           {{"p50", quantile(0.5)},
            {"p99", quantile(0.99)},
            {"max", latency_ms.empty() ? 0.0 : latency_ms.back()},
            {"count", latency_ms.size()}}}};
}

// --- the producer and the streams it feeds --------------------------------------------------

// One open stream as the producer sees it. Handed-off tokens wait in `queue` for the stream's
// own thread; direct ones are written to `sink` at once.
struct Stream {
  std::mutex mutex;
  std::condition_variable changed;
  httplib::DataSink* sink = nullptr;
  std::deque<std::string> queue;
  bool over = false;
};

class Streams {
 public:
  void add(const std::shared_ptr<Stream>& stream) {
    std::lock_guard lock(mutex_);
    streams_.push_back(stream);
  }
  std::vector<std::shared_ptr<Stream>> all() {
    std::lock_guard lock(mutex_);
    return streams_;
  }
  void end_all() {
    for (auto& stream : all()) {
      std::lock_guard lock(stream->mutex);
      stream->over = true;
      stream->changed.notify_all();
    }
  }

 private:
  std::mutex mutex_;
  std::vector<std::shared_ptr<Stream>> streams_;
};

// Every 1/rate s, one token for each open stream, produced through `deliver`.
template <typename Deliver>
uint64_t produce(const Options& options, Clock::time_point end, Deliver deliver) {
  const auto period = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(1.0 / options.rate));
  uint64_t produced = 0;
  for (auto tick = Clock::now(); tick < end; tick += period) {
    std::this_thread::sleep_until(tick);
    produced += deliver();
  }
  return produced;
}

uint64_t serve_httplib(const Options& options, bool direct, int& port, int ready_fd,
                       Clock::time_point end) {
  httplib::Server server;
  const size_t threads = static_cast<size_t>(options.streams) + 16;
  server.new_task_queue = [threads] {
    return new moeline::stages::http::ConnectionThreads(threads);
  };
  server.set_tcp_nodelay(true);
  int listener = -1;
  server.set_socket_options([&listener](int socket) {
    int yes = 1;
    setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listener = socket;
  });
  Streams streams;
  server.Post("/stream", [&](const httplib::Request&, httplib::Response& response) {
    auto stream = std::make_shared<Stream>();
    response.set_chunked_content_provider(
        "text/event-stream", [&streams, stream, direct](size_t, httplib::DataSink& sink) {
          std::unique_lock lock(stream->mutex);
          stream->sink = &sink;
          if (direct) {
            streams.add(stream);
            stream->changed.wait(lock, [&] { return stream->over; });
          } else {
            streams.add(stream);
            while (true) {
              stream->changed.wait(lock, [&] { return stream->over || !stream->queue.empty(); });
              if (stream->queue.empty()) break;
              std::string text = std::move(stream->queue.front());
              stream->queue.pop_front();
              lock.unlock();
              const bool sent = sink.write(text.data(), text.size());
              lock.lock();
              if (!sent) break;
            }
          }
          stream->sink = nullptr;
          return false;
        });
  });
  port = server.bind_to_any_port("127.0.0.1");
  if (listener >= 0) listen(listener, SOMAXCONN);
  std::thread listening([&] { server.listen_after_bind(); });
  [[maybe_unused]] const ssize_t told = write(ready_fd, &port, sizeof port);
  const uint64_t produced = produce(options, end, [&] {
    uint64_t made = 0;
    // One stamp per tick for every stream, as the beast server's (a decode step's tokens exist
    // at once; what is timed includes writing the others first).
    const std::string text = token_event(now_ns());
    for (auto& stream : streams.all()) {
      std::lock_guard lock(stream->mutex);
      if (stream->over || stream->sink == nullptr) continue;
      ++made;
      if (!direct) {
        stream->queue.push_back(text);
        stream->changed.notify_one();
      } else if (!stream->sink->write(text.data(), text.size())) {
        stream->over = true;
        stream->changed.notify_all();
      }
    }
    return made;
  });
  streams.end_all();
  server.stop();
  listening.join();
  return produced;
}

// Beast: a session reads its request, answers with a chunked event stream, and writes whatever
// the producer posts to it, one write at a time.
class Session : public std::enable_shared_from_this<Session> {
 public:
  explicit Session(net::ip::tcp::socket socket) : socket_(std::move(socket)) {}
  template <typename OnReady>
  void start(OnReady on_ready) {
    auto self = shared_from_this();
    beast::http::async_read(socket_, buffer_, request_,
                            [self, on_ready](beast::error_code error, size_t) {
                              if (error) return;
                              self->push(
                                  "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                  "Transfer-Encoding: chunked\r\n\r\n",
                                  false);
                              on_ready(self);
                            });
  }
  void push(const std::string& text, bool chunked = true) {
    if (closed_) return;
    if (chunked) {
      char size[32];
      std::snprintf(size, sizeof size, "%zx\r\n", text.size());
      queue_.push_back(size + text + "\r\n");
    } else {
      queue_.push_back(text);
    }
    if (!writing_) write_next();
  }
  bool closed() const { return closed_; }

 private:
  void write_next() {
    if (queue_.empty()) {
      writing_ = false;
      return;
    }
    writing_ = true;
    auto self = shared_from_this();
    net::async_write(socket_, net::buffer(queue_.front()), [self](beast::error_code error, size_t) {
      self->queue_.pop_front();
      if (error) {
        self->closed_ = true;
        return;
      }
      self->write_next();
    });
  }

  net::ip::tcp::socket socket_;
  beast::flat_buffer buffer_;
  beast::http::request<beast::http::string_body> request_;
  std::deque<std::string> queue_;
  bool writing_ = false, closed_ = false;
};

uint64_t serve_beast(const Options& options, int& port, int ready_fd, Clock::time_point end) {
  net::io_context context(1);
  net::ip::tcp::acceptor acceptor(context);
  const net::ip::tcp::endpoint where(net::ip::make_address("127.0.0.1"), 0);
  acceptor.open(where.protocol());
  acceptor.set_option(net::socket_base::reuse_address(true));
  acceptor.bind(where);
  acceptor.listen(SOMAXCONN);
  port = acceptor.local_endpoint().port();
  std::vector<std::shared_ptr<Session>> sessions;  // the io thread's only
  std::function<void()> accept = [&] {
    acceptor.async_accept([&](beast::error_code error, net::ip::tcp::socket socket) {
      if (!error) {
        socket.set_option(net::ip::tcp::no_delay(true));
        std::make_shared<Session>(std::move(socket))->start([&](std::shared_ptr<Session> ready) {
          sessions.push_back(std::move(ready));
        });
      }
      accept();
    });
  };
  accept();
  auto guard = net::make_work_guard(context);
  std::thread io([&] { context.run(); });
  [[maybe_unused]] const ssize_t told = write(ready_fd, &port, sizeof port);
  std::atomic<uint64_t> made{0};
  produce(options, end, [&] {
    // Stamped on the producer's thread, as the other servers' tokens are, then handed to the io
    // thread, which writes them all.
    net::post(context, [&made, &sessions, produced = now_ns()] {
      for (auto& session : sessions) {
        if (session->closed()) continue;
        session->push(token_event(produced));
        made.fetch_add(1, std::memory_order_relaxed);
      }
    });
    return uint64_t{0};
  });
  net::post(context, [&] { acceptor.close(); });
  guard.reset();
  context.stop();
  io.join();
  return made.load();
}

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--server")
      options.server = value;
    else if (flag == "--streams")
      options.streams = std::stoi(value);
    else if (flag == "--rate")
      options.rate = std::stod(value);
    else if (flag == "--seconds")
      options.seconds = std::stod(value);
    else {
      std::cerr << "unknown flag " << flag << " (--server, --streams, --rate, --seconds)\n";
      return 2;
    }
  }
  if (options.server != "httplib-direct" && options.server != "httplib-handoff" &&
      options.server != "beast") {
    std::cerr << "--server must be httplib-direct, httplib-handoff or beast\n";
    return 2;
  }
  // The client is forked before any server thread exists; it learns the port through a pipe and
  // sends its results back through another.
  int to_client[2], from_client[2];
  if (pipe(to_client) != 0 || pipe(from_client) != 0) return 1;
  const auto start = Clock::now();
  const auto warm = start + std::chrono::seconds(2);  // connections open, threads started
  const auto end = warm + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(options.seconds));
  const pid_t child = fork();
  if (child == 0) {
    int port = 0;
    if (read(to_client[0], &port, sizeof port) != sizeof port) _exit(1);
    const std::string result =
        run_client(port, options, warm, end, end + std::chrono::milliseconds(500)).dump();
    [[maybe_unused]] const ssize_t sent = write(from_client[1], result.data(), result.size());
    _exit(0);
  }
  close(from_client[1]);
  int port = 0;
  double cpu_at_warm = 0;
  std::thread cpu_probe([&] {
    std::this_thread::sleep_until(warm);
    cpu_at_warm = cpu_seconds();
  });
  const uint64_t produced =
      options.server == "beast"
          ? serve_beast(options, port, to_client[1], end)
          : serve_httplib(options, options.server == "httplib-direct", port, to_client[1], end);
  const double cpu = cpu_seconds();
  cpu_probe.join();
  std::string result;
  char buffer[4096];
  for (ssize_t got; (got = read(from_client[0], buffer, sizeof buffer)) > 0;)
    result.append(buffer, static_cast<size_t>(got));
  waitpid(child, nullptr, 0);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  json out = json::parse(result.empty() ? "{}" : result, nullptr, false);
  out["server"] = options.server;
  out["streams"] = options.streams;
  out["rate_per_stream"] = options.rate;
  out["produced"] = produced;
  out["server_cpu_per_s"] = (cpu - cpu_at_warm) / options.seconds;
  out["server_peak_rss_mib"] = static_cast<double>(usage.ru_maxrss) / 1024.0;
  std::cout << out.dump() << '\n';
  return 0;
}
