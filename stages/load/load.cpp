#include "stages/load/load.h"

#include <fcntl.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "base/progress.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "schemas/vocabulary.h"
#include "sdk/client.h"
#include "stages/common/common.h"
#include "stages/load/latency_plot.h"
#include "stages/runtime/config.h"
#include "stages/runtime/hub.h"

namespace moeline::stages {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// Requests finished so far, counted where every driver thread can add and the terminal's
// progress line can read.
struct Tally {
  std::atomic<uint64_t> completed{0}, errors{0};
};

struct Samples {
  Clock::time_point origin;  // the start of the run: each sample's time is taken from it
  Tally* tally = nullptr;
  std::vector<TimedSample> ttft, tpot;
  std::vector<double> e2e_ms;
  uint64_t started = 0, completed = 0, errors = 0, prompt_tokens = 0, output_tokens = 0;
  std::map<std::string, uint64_t> error_kinds;  // what each error was, counted
  Samples(Clock::time_point start, Tally* shared) : origin(start), tally(shared) {}
  void first_token(Clock::time_point at, double latency_ms) {
    ttft.push_back({std::chrono::duration<double>(at - origin).count(), latency_ms});
  }
  void next_token(Clock::time_point at, double gap_ms) {
    tpot.push_back({std::chrono::duration<double>(at - origin).count(), gap_ms});
  }
  void finished(double e2e) {
    ++completed;
    e2e_ms.push_back(e2e);
    if (tally) ++tally->completed;
  }
  void error(const std::string& kind) {
    ++errors;
    ++error_kinds[kind];
    if (tally) ++tally->errors;
  }
  // When the last latency was taken, in seconds from the start.
  double last_sample_s() const {
    double last = 0;
    for (const auto* samples : {&ttft, &tpot})
      for (const TimedSample& sample : *samples) last = std::max(last, sample.at_s);
    return last;
  }
  void add(const Samples& other) {
    started += other.started;
    completed += other.completed;
    errors += other.errors;
    for (const auto& [kind, count] : other.error_kinds) error_kinds[kind] += count;
    prompt_tokens += other.prompt_tokens;
    output_tokens += other.output_tokens;
    ttft.insert(ttft.end(), other.ttft.begin(), other.ttft.end());
    tpot.insert(tpot.end(), other.tpot.begin(), other.tpot.end());
    e2e_ms.insert(e2e_ms.end(), other.e2e_ms.begin(), other.e2e_ms.end());
  }
};

std::vector<double> latencies(const std::vector<TimedSample>& samples) {
  std::vector<double> values;
  values.reserve(samples.size());
  for (const TimedSample& s : samples) values.push_back(s.ms);
  return values;
}

nlohmann::json percentiles(std::vector<double> values) {
  if (values.empty()) return nullptr;
  std::sort(values.begin(), values.end());
  double sum = 0;
  for (double v : values) sum += v;
  return {{"p50", quantile(values, 0.5)},
          {"p90", quantile(values, 0.9)},
          {"p99", quantile(values, 0.99)},
          {"mean", sum / static_cast<double>(values.size())},
          {"count", values.size()}};
}

// When the next request may start: at once while fewer than `concurrency` are in flight
// (closed loop), or on a fixed schedule of `rate` per second (open loop).
class Pacer {
 public:
  Pacer(int concurrency, double rate) : concurrency_(concurrency), rate_(rate) {}
  bool may_start(size_t in_flight, Clock::time_point now) {
    if (rate_ <= 0) return static_cast<int>(in_flight) < concurrency_;
    if (next_ == Clock::time_point{}) next_ = now;
    if (now < next_) return false;
    next_ +=
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / rate_));
    return true;
  }

 private:
  int concurrency_;
  double rate_;
  Clock::time_point next_{};
};

std::vector<int32_t> synthetic_prompt(std::mt19937_64& rng, int64_t length, int64_t vocab) {
  std::vector<int32_t> tokens(static_cast<size_t>(length));
  for (auto& token : tokens) token = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return tokens;
}

struct LoadOptions {
  std::string target, endpoint, model;
  std::string http;  // --http URL: the OpenAI-compatible front instead of the ZeroMQ client
  std::string plot;  // --plot FILE.png
  int concurrency = 1;
  double rate = 0;
  double duration_s = 10;
  int64_t prompt_tokens = 128, max_tokens = 64;
  int threads = 0;
  std::vector<std::string> arithmetic;  // --quant-math and --bf16-math of the stage under load
  double request_timeout_s = 120;
  sdk::Credentials credentials;
  bool json = false;
  // Prompts differ from run to run unless a seed is given: the stack's snapshot store would
  // otherwise answer a repeated run from its cache.
  uint64_t seed = 0;
  Clock::time_point origin = Clock::now();
  Tally* tally = nullptr;
};

Samples drive_stack(const LoadOptions& o, int64_t vocab) {
  sdk::Client client(o.endpoint, std::chrono::seconds(120), o.credentials);
  Pacer pacer(o.concurrency, o.rate);
  std::mt19937_64 rng(o.seed);
  struct Live {
    Clock::time_point start, last;
    bool first = false;
    size_t tokens = 0;
  };
  std::map<uint64_t, Live> live;
  Samples s(Clock::now(), o.tally);
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(o.duration_s));
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(o.request_timeout_s));
  while (Clock::now() < end || !live.empty()) {
    const auto now = Clock::now();
    while (now < end && pacer.may_start(live.size(), now)) {
      sdk::GenerateOptions request;
      request.tokens = synthetic_prompt(rng, o.prompt_tokens, vocab);
      request.max_tokens = o.max_tokens;
      request.ignore_eos = true;
      request.deadline_ms = static_cast<uint32_t>(o.request_timeout_s * 1000);
      live[client.start(request)] = {Clock::now(), Clock::now()};
      ++s.started;
      s.prompt_tokens += static_cast<uint64_t>(o.prompt_tokens);
    }
    // Every request ends by its deadline, whatever the stack does (a gateway that died and took
    // the request with it ends it sooner: the SDK reports the lost connection).
    for (auto it = live.begin(); it != live.end();) {
      if (now - it->second.start < timeout) {
        ++it;
        continue;
      }
      client.cancel(it->first);
      s.error("timeout");
      it = live.erase(it);
    }
    auto event = client.next_event(std::chrono::milliseconds(o.rate > 0 ? 1 : 100));
    if (!event) continue;
    auto it = live.find(event->client_request_id);
    if (it == live.end()) continue;
    Live& l = it->second;
    const auto t = Clock::now();
    if (event->kind == sdk::EventKind::kDelta) {
      if (!l.first) {
        s.first_token(t, ms(t - l.start));
        l.first = true;
      } else {
        s.next_token(t, ms(t - l.last));
      }
      l.last = t;
      l.tokens += event->token_ids.size();
    } else if (event->terminal()) {
      if (event->kind == sdk::EventKind::kFinished) {
        s.finished(ms(t - l.start));
        s.output_tokens += l.tokens;
      } else {
        s.error(event->error_name.empty() ? "error" : event->error_name);
      }
      live.erase(it);
    }
  }
  return s;
}

// `--http URL`: each of `concurrency` threads sends streamed /v1/completions requests (the same
// synthetic token-id prompts, end-of-sequence ignored) one after another, and times the
// server-sent events as a client of the HTTP front sees them: TTFT to the first chunk with text,
// the gaps between chunks, the whole request; output tokens from the stream's usage chunk.
Samples drive_http(const LoadOptions& o, int64_t vocab) {
  const auto colon = o.http.find("://");
  const std::string base = colon == std::string::npos ? "http://" + o.http : o.http;
  std::mutex mutex;
  Samples total(Clock::now(), o.tally);
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(o.duration_s));
  auto worker = [&](uint64_t seed) {
    httplib::Client client(base);
    const auto timeout = static_cast<time_t>(std::ceil(o.request_timeout_s));
    client.set_read_timeout(timeout, 0);
    client.set_connection_timeout(10, 0);
    client.set_tcp_nodelay(true);
    httplib::Headers headers;
    if (!o.credentials.api_key.empty())
      headers.emplace("Authorization", "Bearer " + o.credentials.api_key);
    std::mt19937_64 rng(seed);
    Samples s(total.origin, o.tally);  // one start for every worker's sample times
    while (Clock::now() < end) {
      const nlohmann::json body = {{"prompt", synthetic_prompt(rng, o.prompt_tokens, vocab)},
                                   {"max_tokens", o.max_tokens},
                                   {"temperature", 0},
                                   {"ignore_eos", true},
                                   {"stream", true},
                                   {"stream_options", {{"include_usage", true}}}};
      httplib::Request request;
      request.method = "POST";
      request.path = "/v1/completions";
      request.headers = headers;
      request.body = body.dump();
      request.set_header("Content-Type", "application/json");
      const auto start = Clock::now();
      Clock::time_point last = start;
      bool first = false, failed = false;
      uint64_t tokens = 0;
      std::string buffer;
      request.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
        buffer.append(data, size);
        for (size_t at; (at = buffer.find("\n\n")) != std::string::npos; buffer.erase(0, at + 2)) {
          const std::string event = buffer.substr(0, at);
          if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
          // The clock first: what is timed is the chunk's arrival, not this client's parsing.
          const auto t = Clock::now();
          // Token chunks are timed without parsing them (a JSON parse per token would load
          // the machine under test); the usage chunk and errors are parsed.
          // (The last chunk, with the finish reason, is not a token: it is not timed.)
          const bool has_text = event.find("\"finish_reason\":null") != std::string::npos;
          if (!has_text) {
            const auto chunk = nlohmann::json::parse(event.substr(6), nullptr, false);
            if (!chunk.is_object() || chunk.contains("error")) failed = true;
            if (chunk.is_object() && chunk.contains("usage") && chunk["usage"].is_object())
              tokens = chunk["usage"].value("completion_tokens", uint64_t{0});
            continue;
          }
          if (!first) {
            s.first_token(t, ms(t - start));
            first = true;
          } else {
            s.next_token(t, ms(t - last));
          }
          last = t;
        }
        return true;
      };
      ++s.started;
      s.prompt_tokens += static_cast<uint64_t>(o.prompt_tokens);
      auto result = client.send(request);
      if (!result || result->status != 200 || failed) {
        s.error(!result                 ? "http: " + httplib::to_string(result.error())
                : result->status != 200 ? "http status " + std::to_string(result->status)
                                        : std::string("error event in the stream"));
        continue;
      }
      s.finished(ms(Clock::now() - start));
      s.output_tokens += tokens;
    }
    std::lock_guard lock(mutex);
    total.add(s);
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < o.concurrency; ++i)
    threads.emplace_back(worker, o.seed + static_cast<uint64_t>(i));
  for (std::thread& t : threads) t.join();
  return total;
}

// One stage process connected to this process as its hub.
class StageUnderLoad {
 public:
  StageUnderLoad(const LoadOptions& o, const model::Model& model, zmq::context_t& context,
                 runtime::Logger& log, runtime::Registry& metrics)
      : dir_(fs::temp_directory_path() / ("moeline-load-" + std::to_string(::getpid()))) {
    fs::create_directories(dir_);
    const std::string endpoint = "ipc://" + (dir_ / "hub.sock").string();
    hub = std::make_unique<runtime::Hub>(
        context, endpoint, settings_hash(model.model_id()), 500, 5000, log, metrics,
        runtime::HubSecurity{.max_message_bytes = max_stage_message_bytes(model.config())});
    const std::string exe = fs::read_symlink("/proc/self/exe").string();
    std::vector<std::string> args = {exe,     o.target, "--model",   o.model,
                                     "--hub", endpoint, "--replica", o.target + "-under-load"};
    if (o.threads > 0) {
      args.push_back("--threads");
      args.push_back(std::to_string(o.threads));
    }
    // The hub's settings hash has this process's arithmetic; the stage must compute alike.
    args.insert(args.end(), o.arithmetic.begin(), o.arithmetic.end());
    if (o.target == "decode") {
      args.push_back("--max-batch");
      args.push_back(std::to_string(std::max(o.concurrency, 1)));
    }
    const std::string log_file = (dir_ / "stage.log").string();
    pid_ = ::fork();
    if (pid_ == 0) {
      // The stage's own log stays out of the report; it is printed if the stage fails.
      const int fd = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
      }
      std::vector<char*> argv;
      for (std::string& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
  }
  void print_log() const {
    std::ifstream in(dir_ / "stage.log");
    std::cerr << in.rdbuf();
  }
  ~StageUnderLoad() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // Serves the stage's expert-plan request; returns the peer once it has granted credit.
  runtime::Peer* wait_ready(const model::Model& model) {
    const auto until = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < until) {
      while (auto incoming = hub->receive()) {
        if (incoming->message.type != wire::MessageType::ExpertPlanRequest) continue;
        flatbuffers::FlatBufferBuilder builder(128);
        builder.Finish(wire::CreateExpertPlan(builder, model.model_id(), true, 0, 0, 0,
                                              builder.CreateString("resident"),
                                              builder.CreateString(incoming->identity)),
                       wire::ExpertPlanIdentifier());
        hub->send(incoming->identity, wire::encode(wire::MessageType::ExpertPlan, builder), false);
      }
      hub->tick();
      for (const auto& [identity, peer] : hub->peers())
        if (peer.credits > 0) return hub->peer(identity);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    throw std::runtime_error("the " + std::string("stage under load did not become ready"));
  }
  std::unique_ptr<runtime::Hub> hub;

 private:
  fs::path dir_;
  pid_t pid_ = 0;
};

Samples drive_stage_loop(const LoadOptions& o, const model::Model& model, StageUnderLoad& stage);

Samples drive_stage(const LoadOptions& o, const model::Model& model) {
  zmq::context_t context(1);
  runtime::Logger log("load", "load");
  runtime::Registry metrics;
  StageUnderLoad stage(o, model, context, log, metrics);
  try {
    return drive_stage_loop(o, model, stage);
  } catch (...) {
    stage.print_log();
    throw;
  }
}

Samples drive_stage_loop(const LoadOptions& o, const model::Model& model, StageUnderLoad& stage) {
  runtime::Peer* peer = stage.wait_ready(model);
  const std::string identity = peer->identity;
  runtime::Hub& hub = *stage.hub;
  const model::ModelConfig& cfg = model.config();
  const int64_t vocab = cfg.vocab_size;
  Pacer pacer(o.concurrency, o.rate);
  std::mt19937_64 rng(o.seed);
  model::SamplingParams sampling;
  sampling.max_tokens = o.max_tokens;
  sampling.ignore_eos = true;

  // Synthetic KV for decode jobs: the right layout, small values (decode does not care what the
  // prompt was; it reads the cache like any other).
  const size_t blocks =
      static_cast<size_t>((o.prompt_tokens + model::kBlockTokens - 1) / model::kBlockTokens);
  const size_t block_bytes = model::KvCache::bytes_per_token(cfg) * model::kBlockTokens;
  std::vector<float> kv(blocks * block_bytes / sizeof(float));
  for (size_t i = 0; i < kv.size(); ++i)
    kv[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-4f;
  const uint64_t kv_sum =
      wire::checksum({reinterpret_cast<const uint8_t*>(kv.data()), kv.size() * 4});

  struct Live {
    Clock::time_point start, last;
    int64_t tokens = 0;
  };
  std::map<uint64_t, Live> live;
  uint64_t next_id = 1;
  Samples s(Clock::now(), o.tally);
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(o.duration_s));
  while (Clock::now() < end || !live.empty()) {
    const auto now = Clock::now();
    if (Clock::now() > end + std::chrono::seconds(120))
      throw std::runtime_error("stage stopped answering");
    runtime::Peer* p = hub.peer(identity);
    if (p == nullptr) throw std::runtime_error("the stage under load died");
    while (now < end && p->credits > 0 && pacer.may_start(live.size(), now)) {
      const uint64_t id = next_id++;
      std::vector<int32_t> prompt = synthetic_prompt(rng, o.prompt_tokens, vocab);
      flatbuffers::FlatBufferBuilder builder(1024 + prompt.size() * 4);
      auto tokens = builder.CreateVector(prompt);
      auto sampling_offset = to_wire(builder, sampling);
      auto name_space = builder.CreateString("tenant:load");
      if (o.target == "prefill") {
        builder.Finish(wire::CreatePrefillJob(builder, id, 1, tokens, sampling_offset, name_space,
                                              builder.CreateString("none"), 0, 0, 0, 0, 0, 0, 0,
                                              false, 0, 0, 0, wire::ReuseLevel::None),
                       wire::PrefillJobIdentifier());
        hub.send(identity, wire::encode(wire::MessageType::PrefillJob, builder), true);
      } else {
        std::vector<flatbuffers::Offset<wire::BulkFrame>> frames = {
            wire::CreateBulkFrame(builder, kv.size() * 4, kv_sum)};
        auto described = builder.CreateVector(frames);
        auto layout = stages::kv_layout(builder, cfg, blocks);
        builder.Finish(wire::CreatePrefillDone(builder, id, 1, tokens, 1, builder.CreateString(""),
                                               sampling_offset, name_space, layout, described, 0,
                                               builder.CreateString("load")),
                       wire::PrefillJobIdentifier());
        std::vector<zmq::message_t> bulk;
        bulk.emplace_back(kv.data(), kv.size() * 4);
        hub.send(identity, wire::encode(wire::MessageType::PrefillDone, builder, std::move(bulk)),
                 true);
      }
      live[id] = {Clock::now(), Clock::now()};
      ++s.started;
      s.prompt_tokens += static_cast<uint64_t>(o.prompt_tokens);
      p = hub.peer(identity);
    }
    zmq::pollitem_t item{hub.socket().handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(1));
    hub.tick();
    while (auto incoming = hub.receive()) {
      const auto t = Clock::now();
      wire::Message& message = incoming->message;
      if (message.type == wire::MessageType::PrefillDone) {
        const auto* done = message.as<wire::PrefillDone>();
        auto it = live.find(done->request_id());
        if (it == live.end()) continue;
        s.first_token(t, ms(t - it->second.start));
        s.finished(ms(t - it->second.start));
        ++s.output_tokens;
        live.erase(it);
      } else if (message.type == wire::MessageType::TokenBatch) {
        const auto* batch = message.as<wire::TokenBatch>();
        for (const wire::TokenUpdate* update : *batch->updates()) {
          auto it = live.find(update->request_id());
          if (it == live.end()) continue;
          Live& l = it->second;
          if (l.tokens == 0)
            s.first_token(t, ms(t - l.start));
          else
            s.next_token(t, ms(t - l.last));
          l.last = t;
          ++l.tokens;
          if (wire::finish_reason_of(*update) != wire::FinishReason::None) {
            s.finished(ms(t - l.start));
            s.output_tokens += static_cast<uint64_t>(l.tokens);
            live.erase(it);
          }
        }
      } else if (message.type == wire::MessageType::JobFailed) {
        live.erase(message.as<wire::JobFailed>()->request_id());
        s.error("job_failed");
      }
    }
  }
  return s;
}

// "rate 4/s" or "concurrency 8".
std::string load_text(const LoadOptions& o) {
  char rate_text[64];
  std::snprintf(rate_text, sizeof rate_text, "rate %g/s", o.rate);
  return o.rate > 0 ? rate_text : "concurrency " + std::to_string(o.concurrency);
}

// On a terminal, a line that follows the run ("load  40% (4/10 s), 812 done, 0 errors"), redrawn
// by a thread of its own while the drivers work.
class RunProgress {
 public:
  RunProgress(const LoadOptions& o, const Tally& tally) : line_("load", "s") {
    if (!line_.enabled()) return;
    thread_ = std::thread([this, &o, &tally] {
      const auto total = static_cast<int64_t>(std::ceil(o.duration_s));
      std::unique_lock lock(mutex_);
      while (!stop_) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - o.origin).count();
        line_.update(std::min(static_cast<int64_t>(elapsed), total), total,
                     std::to_string(tally.completed.load()) + " done, " +
                         std::to_string(tally.errors.load()) + " errors" +
                         (elapsed > o.duration_s ? ", finishing those in flight" : ""));
        wake_.wait_for(lock, std::chrono::milliseconds(200));
      }
    });
  }
  ~RunProgress() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
    line_.finish();
  }

 private:
  TerminalProgress line_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

int load_body(const runtime::Config& config) {
  LoadOptions o;
  o.target = config.text("target");
  o.endpoint = config.text("endpoint");
  o.http = config.text("http");
  o.plot = config.text("plot");
  o.model = config.text("model");
  o.concurrency = static_cast<int>(config.integer("concurrency"));
  o.rate = config.number("rate");
  o.duration_s = config.number("duration-s");
  o.prompt_tokens = config.integer("prompt-tokens");
  o.max_tokens = config.integer("max-tokens");
  o.threads = static_cast<int>(config.integer("threads"));
  o.arithmetic = arithmetic_arguments(config);
  o.request_timeout_s = config.number("request-timeout-s");
  o.credentials = {config.text("api-key"), config.text("server-key")};
  if (!(o.request_timeout_s > 0)) throw runtime::ConfigError("--request-timeout-s must be > 0");
  o.json = config.flag("json");
  o.seed = static_cast<uint64_t>(config.integer("seed"));
  if (o.seed == 0)
    o.seed = (static_cast<uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
  if (o.target == "prefill") o.max_tokens = 1;  // prefill's output is the first token
  if (o.target != "stack" && o.target != "prefill" && o.target != "decode")
    throw runtime::ConfigError("--target must be stack, prefill or decode");
  if (o.concurrency < 1) throw runtime::ConfigError("--concurrency must be >= 1");
  if (o.rate < 0 || o.duration_s <= 0 || o.prompt_tokens < 1 || o.max_tokens < 1)
    throw runtime::ConfigError(
        "--rate >= 0, --duration-s > 0, --prompt-tokens and --max-tokens >= 1");
  auto loaded = model::Model::load(o.model, TerminalProgress("loading model", "layers").callback());
  if (!loaded) throw std::runtime_error(loaded.error().message);
  const model::Model& model = **loaded;
  const int64_t context = model.config().max_position_embeddings;
  if (context > 0 && o.prompt_tokens + o.max_tokens > context)
    throw runtime::ConfigError("--prompt-tokens + --max-tokens exceeds the model's context of " +
                               std::to_string(context));
  if (!o.http.empty() && (o.target != "stack" || !o.endpoint.empty() || o.rate > 0))
    throw runtime::ConfigError(
        "--http drives the HTTP front at --concurrency (no --endpoint, "
        "--target or --rate with it)");
  if (o.target == "stack" && o.endpoint.empty() && o.http.empty())
    throw runtime::ConfigError("--endpoint (or --http URL) is required for --target stack");

  Tally tally;
  o.tally = &tally;
  o.origin = Clock::now();
  Samples s = [&] {
    RunProgress progress(o, tally);
    return !o.http.empty()       ? drive_http(o, model.config().vocab_size)
           : o.target == "stack" ? drive_stack(o, model.config().vocab_size)
                                 : drive_stage(o, model);
  }();
  const double elapsed = std::chrono::duration<double>(Clock::now() - o.origin).count();
  nlohmann::json out = {
      {"target", o.http.empty() ? o.target : "http"},
      {"concurrency", o.rate > 0 ? nlohmann::json(nullptr) : nlohmann::json(o.concurrency)},
      {"rate_per_s", o.rate > 0 ? nlohmann::json(o.rate) : nlohmann::json(nullptr)},
      {"duration_s", elapsed},
      {"prompt_tokens", o.prompt_tokens},
      {"max_tokens", o.max_tokens},
      {"seed", o.seed},
      {"requests", s.started},
      {"completed", s.completed},
      {"errors", s.errors},
      {"error_kinds", s.error_kinds},
      {"requests_per_s", static_cast<double>(s.completed) / elapsed},
      {"prompt_tokens_per_s", static_cast<double>(s.prompt_tokens) / elapsed},
      {"output_tokens_per_s", static_cast<double>(s.output_tokens) / elapsed},
      {"ttft_ms", percentiles(latencies(s.ttft))},
      {"tpot_ms", percentiles(latencies(s.tpot))},
      {"e2e_ms", percentiles(s.e2e_ms)}};
  if (!o.plot.empty()) {
    char subtitle[192];
    std::snprintf(subtitle, sizeof subtitle,
                  "target %s, %s, prompt %lld tokens, %lld out; %llu requests, %llu errors",
                  o.http.empty() ? o.target.c_str() : "http", load_text(o).c_str(),
                  static_cast<long long>(o.prompt_tokens), static_cast<long long>(o.max_tokens),
                  static_cast<unsigned long long>(s.started),
                  static_cast<unsigned long long>(s.errors));
    const LatencyPlot plot{.title = "moeline load: latency over time (" + model_name(o.model) + ")",
                           .subtitle = subtitle,
                           .duration_s = std::max(o.duration_s, s.last_sample_s()),
                           .ttft = s.ttft,
                           .per_token = s.tpot};
    if (!write_latency_plot(o.plot, plot))
      throw std::runtime_error("--plot: cannot write " + o.plot);
    out["plot"] = o.plot;
  }
  if (o.json) {
    std::cout << out.dump() << '\n';
  } else {
    std::printf("target %s, %s, %.1f s, prompt %lld tokens, up to %lld output tokens\n",
                o.target.c_str(), load_text(o).c_str(), elapsed,
                static_cast<long long>(o.prompt_tokens), static_cast<long long>(o.max_tokens));
    std::printf(
        "requests %llu completed %llu errors %llu | %.2f req/s, %.1f prompt tok/s, %.1f "
        "output tok/s\n",
        static_cast<unsigned long long>(s.started), static_cast<unsigned long long>(s.completed),
        static_cast<unsigned long long>(s.errors), out["requests_per_s"].get<double>(),
        out["prompt_tokens_per_s"].get<double>(), out["output_tokens_per_s"].get<double>());
    std::printf("%-10s %10s %10s %10s %10s %8s\n", "latency", "p50 ms", "p90 ms", "p99 ms",
                "mean ms", "n");
    for (const char* key : {"ttft_ms", "tpot_ms", "e2e_ms"}) {
      const auto& p = out[key];
      if (p.is_null()) continue;
      std::printf("%-10s %10.3f %10.3f %10.3f %10.3f %8zu\n", key, p["p50"].get<double>(),
                  p["p90"].get<double>(), p["p99"].get<double>(), p["mean"].get<double>(),
                  p["count"].get<size_t>());
    }
  }
  return s.errors == 0 ? 0 : 1;
}

std::vector<runtime::ConfigKey> load_keys() {
  return {
      {"target", "stack", "stack (through the gateway), prefill or decode (that stage alone)"},
      {"endpoint", "", "the gateway's client endpoint (--target stack)"},
      {"http", "",
       "URL of the OpenAI-compatible front (moeline http): streamed /v1/completions requests at "
       "--concurrency instead of the ZeroMQ client"},
      {"model", default_model_dir(),
       "checkpoint (vocabulary; the stage to start for prefill|decode)"},
      {"concurrency", "1", "requests in flight (closed loop)"},
      {"rate", "0", "requests per second (open loop; overrides --concurrency)"},
      {"duration-s", "10", "how long to start requests"},
      {"prompt-tokens", "128", "synthetic prompt length"},
      {"max-tokens", "64", "tokens generated per request (end-of-sequence ignored)"},
      {"threads", "0", "threads of the stage under load (0: all cores)"},
      {"quant-math", "fast", "the stage under load's --quant-math (prefill|decode)"},
      {"bf16-math", "exact", "the stage under load's --bf16-math (prefill|decode)"},
      {"api-key", "", "API key where the gateway requires one (env MOELINE_API_KEY)"},
      {"server-key", "",
       "the gateway's public Curve key or gateway.pub, for tcp:// with Curve "
       "(env MOELINE_SERVER_KEY)"},
      {"request-timeout-s", "120",
       "a request not finished this long after it started is its deadline: cancelled and "
       "counted as an error (the run never waits longer)"},
      {"json", "false", "print one JSON object", true},
      {"plot", "",
       "FILE.png: draw time to first token and per-token latency (p50, p90, p99) over the run"},
      {"seed", "0",
       "seed of the synthetic prompts (0: a new one each run, so that the stack's "
       "snapshot store cannot answer a repeated run from its cache)"},
  };
}

}  // namespace

int load_command(int argc, char** argv) {
  return run_stage("load", load_keys(), argc, argv, load_body);
}

}  // namespace moeline::stages
