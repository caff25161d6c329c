// The stage runtime (stages/runtime): configuration and its precedence (defaults < file <
// environment < flags), sizes, the Prometheus registry and its text format, rate-limited logging
// and the one-line key=value log format.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "stages/runtime/config.h"
#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"
#include "stages/runtime/process_metrics.h"
#include "stages/runtime/service.h"
#include "stages/stack/stack.h"

namespace moeline::runtime {
namespace {

// --- Config --------------------------------------------------------------------------------------

const std::vector<ConfigKey> kKeys = {
    {"client-bind", "ipc:///tmp/client.sock", "where clients connect"},
    {"max-batch", "8", "the largest batch"},
    {"temperature", "0.5", "the default temperature"},
    {"json", "false", "log as JSON", true},
    {"cache-bytes", "64MiB", "the prefix cache size"},
    {"replica", "", "this replica's name"},
};

// Sets the environment for one test and restores what was there before (also the variables of
// every key, so that the caller's environment cannot leak into a test).
class ScopedEnvironment {
 public:
  ScopedEnvironment() {
    for (const char* name : {"MOELINE_CLIENT_BIND", "MOELINE_MAX_BATCH", "MOELINE_TEMPERATURE",
                             "MOELINE_JSON", "MOELINE_CACHE_BYTES", "MOELINE_REPLICA"}) {
      remember(name);
      ::unsetenv(name);
    }
  }
  ~ScopedEnvironment() {
    for (const auto& [name, value] : saved_) {
      if (value)
        ::setenv(name.c_str(), value->c_str(), 1);
      else
        ::unsetenv(name.c_str());
    }
  }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

  void set(const std::string& name, const std::string& value) {
    remember(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }

 private:
  void remember(const std::string& name) {
    if (saved_.count(name)) return;
    const char* value = std::getenv(name.c_str());
    saved_[name] = value ? std::optional<std::string>(value) : std::nullopt;
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

class ConfigTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("moeline-runtime-test-" + std::to_string(::getpid()) + "-" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string write_file(const std::string& name, const std::string& text) {
    const std::filesystem::path path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }

  static Config load(std::vector<std::string> args, const std::string& stage = "gateway") {
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    return Config::load(stage, kKeys, static_cast<int>(argv.size()), argv.data());
  }

  // The message of the ConfigError that loading `args` throws ("" when none is thrown).
  static std::string load_error(std::vector<std::string> args) {
    try {
      load(std::move(args));
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  }

  // The file every precedence test starts from: top-level keys (dashed and underscored) for every
  // stage, a section for the gateway, one for another stage.
  std::string precedence_file() {
    return write_file("moeline.json", R"({
      "max_batch": 16,
      "client-bind": "ipc:///tmp/from-file.sock",
      "json": true,
      "unknown_key": "ignored",
      "gateway": {"max_batch": 32, "cache-bytes": "1GiB"},
      "prefill": {"temperature": 0.25}
    })");
  }

  ScopedEnvironment env_;
  std::filesystem::path dir_;
};

TEST_F(ConfigTest, Defaults) {
  const Config config = load({});
  EXPECT_EQ(config.text("client-bind"), "ipc:///tmp/client.sock");
  EXPECT_EQ(config.integer("max-batch"), 8);
  EXPECT_EQ(config.number("temperature"), 0.5);
  EXPECT_FALSE(config.flag("json"));
  EXPECT_FALSE(config.flag("replica")) << "an empty value is false";
  EXPECT_EQ(config.text("replica"), "");
  for (const ConfigKey& key : kKeys) EXPECT_EQ(config.source(key.name), "default") << key.name;
  EXPECT_FALSE(config.help_requested());
  const nlohmann::json json = config.to_json();
  EXPECT_EQ(json.size(), kKeys.size());
  EXPECT_EQ(json.at("max-batch"), "8");
}

TEST_F(ConfigTest, FileTopLevelAppliesToEveryStageASectionToItsStageOnly) {
  const std::string file = precedence_file();

  const Config gateway = load({"--config", file}, "gateway");
  EXPECT_EQ(gateway.integer("max-batch"), 32) << "the gateway section beats the top level";
  EXPECT_EQ(gateway.source("max-batch"), "file");
  EXPECT_EQ(gateway.text("client-bind"), "ipc:///tmp/from-file.sock");
  EXPECT_EQ(gateway.text("cache-bytes"), "1GiB");
  EXPECT_TRUE(gateway.flag("json"));
  EXPECT_EQ(gateway.number("temperature"), 0.5) << "the prefill section is not the gateway's";
  EXPECT_EQ(gateway.source("temperature"), "default");

  const Config prefill = load({"--config=" + file}, "prefill");
  EXPECT_EQ(prefill.integer("max-batch"), 16) << "top-level key, underscored";
  EXPECT_EQ(prefill.number("temperature"), 0.25);
  EXPECT_EQ(prefill.source("temperature"), "file");
  EXPECT_EQ(prefill.text("cache-bytes"), "64MiB") << "the gateway section is not prefill's";
  EXPECT_EQ(prefill.source("cache-bytes"), "default");
}

TEST_F(ConfigTest, EnvironmentBeatsTheFile) {
  env_.set("MOELINE_MAX_BATCH", "64");
  env_.set("MOELINE_CLIENT_BIND", "ipc:///tmp/from-env.sock");
  const Config config = load({"--config", precedence_file()});
  EXPECT_EQ(config.integer("max-batch"), 64);
  EXPECT_EQ(config.source("max-batch"), "env");
  EXPECT_EQ(config.text("client-bind"), "ipc:///tmp/from-env.sock") << "dashes as underscores";
  EXPECT_EQ(config.source("client-bind"), "env");
  EXPECT_EQ(config.text("cache-bytes"), "1GiB");
  EXPECT_EQ(config.source("cache-bytes"), "file");
}

TEST_F(ConfigTest, FlagsBeatTheEnvironment) {
  env_.set("MOELINE_MAX_BATCH", "64");
  env_.set("MOELINE_CLIENT_BIND", "ipc:///tmp/from-env.sock");
  env_.set("MOELINE_TEMPERATURE", "0.75");
  const Config config = load(
      {"--max-batch", "128", "--config", precedence_file(), "--client-bind=tcp://127.0.0.1:5555"});
  EXPECT_EQ(config.integer("max-batch"), 128);
  EXPECT_EQ(config.source("max-batch"), "flag");
  EXPECT_EQ(config.text("client-bind"), "tcp://127.0.0.1:5555");
  EXPECT_EQ(config.source("client-bind"), "flag");
  EXPECT_EQ(config.number("temperature"), 0.75);
  EXPECT_EQ(config.source("temperature"), "env");
  EXPECT_EQ(config.source("cache-bytes"), "file");
  EXPECT_EQ(config.source("replica"), "default");
}

TEST_F(ConfigTest, FlagValueMayHoldAnEqualsSign) {
  const Config config = load({"--replica=a=b"});
  EXPECT_EQ(config.text("replica"), "a=b");
}

TEST_F(ConfigTest, SwitchesTakeNoValue) {
  Config config = load({"--json", "--max-batch", "3"});
  EXPECT_TRUE(config.flag("json"));
  EXPECT_EQ(config.text("json"), "true");
  EXPECT_EQ(config.source("json"), "flag");
  EXPECT_EQ(config.integer("max-batch"), 3);
  config = load({"--max-batch", "3", "--json"});
  EXPECT_TRUE(config.flag("json")) << "a switch last on the line";
  config = load({"--json=false"});
  EXPECT_FALSE(config.flag("json")) << "a switch with an explicit value";
}

TEST_F(ConfigTest, UnknownFlagIsAnErrorNamingIt) {
  const std::string error = load_error({"--max-batch", "3", "--bogus-key", "1"});
  EXPECT_NE(error.find("--bogus-key"), std::string::npos) << error;
  EXPECT_NE(load_error({"stray"}).find("stray"), std::string::npos);
}

TEST_F(ConfigTest, MissingValueIsAnError) {
  const std::string error = load_error({"--max-batch"});
  EXPECT_NE(error.find("--max-batch"), std::string::npos) << error;
  EXPECT_NE(load_error({"--config"}), "");
}

TEST_F(ConfigTest, BadValuesNameTheKeyAndTheirSource) {
  const auto message_of = [](const auto& read) -> std::string {
    try {
      read();
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  const Config flags = load({"--max-batch", "12x", "--temperature", "warm", "--json=maybe"});
  const std::string integer = message_of([&] { flags.integer("max-batch"); });
  EXPECT_NE(integer.find("max-batch"), std::string::npos) << integer;
  EXPECT_NE(integer.find("12x"), std::string::npos) << integer;
  EXPECT_NE(integer.find("flag"), std::string::npos) << integer;
  const std::string number = message_of([&] { flags.number("temperature"); });
  EXPECT_NE(number.find("temperature"), std::string::npos) << number;
  EXPECT_NE(number.find("flag"), std::string::npos) << number;
  const std::string flag_text = message_of([&] { flags.flag("json"); });
  EXPECT_NE(flag_text.find("json"), std::string::npos) << flag_text;
  EXPECT_NE(flag_text.find("maybe"), std::string::npos) << flag_text;
  // "--json maybe": a switch takes no value, so "maybe" is a stray argument.
  EXPECT_THROW(load({"--json", "maybe"}), ConfigError);

  env_.set("MOELINE_JSON", "maybe");
  env_.set("MOELINE_MAX_BATCH", "");
  const Config env = load({});
  const std::string flag = message_of([&] { env.flag("json"); });
  EXPECT_NE(flag.find("json"), std::string::npos) << flag;
  EXPECT_NE(flag.find("env"), std::string::npos) << flag;
  const std::string empty = message_of([&] { env.integer("max-batch"); });
  EXPECT_NE(empty.find("max-batch"), std::string::npos) << "an empty integer: " << empty;

  const Config file =
      load({"--config", write_file("bad.json", R"({"temperature": "hot", "max-batch": 1.5})")});
  const std::string from_file = message_of([&] { file.number("temperature"); });
  EXPECT_NE(from_file.find("temperature"), std::string::npos) << from_file;
  EXPECT_NE(from_file.find("file"), std::string::npos) << from_file;
  EXPECT_THROW(file.integer("max-batch"), ConfigError) << "1.5 is not an integer";

  EXPECT_THROW(load({"--temperature", "1.5e"}).number("temperature"), ConfigError);
  EXPECT_EQ(load({"--temperature", "1.5e-1"}).number("temperature"), 0.15);
  EXPECT_EQ(load({"--max-batch", "-4"}).integer("max-batch"), -4);
}

TEST_F(ConfigTest, FlagAcceptsTheUsualSpellings) {
  for (const char* yes : {"true", "1", "yes"})
    EXPECT_TRUE(load({"--json=" + std::string(yes)}).flag("json")) << yes;
  for (const char* no : {"false", "0", "no"})
    EXPECT_FALSE(load({"--json=" + std::string(no)}).flag("json")) << no;
}

TEST_F(ConfigTest, MissingOrInvalidFileIsAnError) {
  const std::string missing = (dir_ / "absent.json").string();
  std::string error = load_error({"--config", missing});
  EXPECT_NE(error.find(missing), std::string::npos) << error;

  const std::string invalid = write_file("invalid.json", R"({"max-batch": 3,)");
  error = load_error({"--config", invalid});
  EXPECT_NE(error.find(invalid), std::string::npos) << error;
  EXPECT_NE(error.find("JSON"), std::string::npos) << error;

  const std::string array = write_file("array.json", "[1, 2]");
  EXPECT_NE(load_error({"--config", array}), "") << "a file that is not an object";
}

TEST_F(ConfigTest, HelpIsRequested) {
  EXPECT_TRUE(load({"--help"}).help_requested());
  EXPECT_TRUE(load({"--max-batch", "3", "-h"}).help_requested());
}

TEST_F(ConfigTest, UsageListsEveryKey) {
  const std::string usage = Config::usage("gateway", kKeys);
  EXPECT_NE(usage.find("moeline gateway"), std::string::npos) << usage;
  EXPECT_NE(usage.find("--config"), std::string::npos) << usage;
  for (const ConfigKey& key : kKeys) {
    EXPECT_NE(usage.find("--" + key.name), std::string::npos) << key.name;
    EXPECT_NE(usage.find(key.help), std::string::npos) << key.help;
    if (!key.default_value.empty()) {
      EXPECT_NE(usage.find(key.default_value), std::string::npos) << key.default_value;
    }
  }
}

// --- parse_bytes ---------------------------------------------------------------------------------

TEST(ParseBytes, UnitsDecimalAndBinary) {
  EXPECT_EQ(parse_bytes("512"), 512u);
  EXPECT_EQ(parse_bytes("0"), 0u);
  EXPECT_EQ(parse_bytes("3B"), 3u);
  EXPECT_EQ(parse_bytes("64KiB"), 65536u);
  EXPECT_EQ(parse_bytes("64MiB"), 64ull << 20);
  EXPECT_EQ(parse_bytes("2GiB"), 2ull << 30);
  EXPECT_EQ(parse_bytes("1TiB"), 1ull << 40);
  EXPECT_EQ(parse_bytes("2KB"), 2000u);
  EXPECT_EQ(parse_bytes("5MB"), 5'000'000u);
  EXPECT_EQ(parse_bytes("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(parse_bytes("2TB"), 2'000'000'000'000u);
}

TEST(ParseBytes, BadTextIsAConfigError) {
  for (const char* bad : {"", "lots", "12XB", "64 KiB", "64kib", "GiB", "-1", "-1KiB", "1e400"})
    EXPECT_THROW(parse_bytes(bad), ConfigError) << "'" << bad << "'";
}

TEST(ParseBytes, NotANumberIsAConfigError) {
  for (const char* bad : {"nan", "NaN", "inf", "infGiB", "1e30TiB"})
    EXPECT_THROW(parse_bytes(bad), ConfigError) << "'" << bad << "'";
}

// --- Registry ------------------------------------------------------------------------------------

TEST(Registry, RendersThePrometheusTextFormat) {
  Registry registry;
  registry
      .counter("moeline_gateway_requests_total", "Requests received.",
               {{"tenant", "a\"b\\c\nd"}, {"code", "ok"}})
      .inc(3);
  registry.counter("moeline_gateway_requests_total", "Requests received.", {{"tenant", "b"}}).inc();
  registry.gauge("moeline_gateway_queue_depth", "Requests waiting.").set(2.5);
  Histogram& ttft = registry.histogram("moeline_gateway_ttft_seconds", "Time to first token.",
                                       {0.5, 1, 2.5}, {{"stage", "gateway"}});
  for (const double seconds : {0.25, 0.5, 2.0, 10.0}) ttft.observe(seconds);
  Histogram& batch = registry.histogram("moeline_decode_batch_size", "Batch sizes.", {1, 2});
  batch.observe(2);

  const std::string want =
      "# HELP moeline_decode_batch_size Batch sizes.\n"
      "# TYPE moeline_decode_batch_size histogram\n"
      "moeline_decode_batch_size_bucket{le=\"1\"} 0\n"
      "moeline_decode_batch_size_bucket{le=\"2\"} 1\n"
      "moeline_decode_batch_size_bucket{le=\"+Inf\"} 1\n"
      "moeline_decode_batch_size_sum 2\n"
      "moeline_decode_batch_size_count 1\n"
      "# HELP moeline_gateway_queue_depth Requests waiting.\n"
      "# TYPE moeline_gateway_queue_depth gauge\n"
      "moeline_gateway_queue_depth 2.5\n"
      "# HELP moeline_gateway_requests_total Requests received.\n"
      "# TYPE moeline_gateway_requests_total counter\n"
      "moeline_gateway_requests_total{tenant=\"a\\\"b\\\\c\\nd\",code=\"ok\"} 3\n"
      "moeline_gateway_requests_total{tenant=\"b\"} 1\n"
      "# HELP moeline_gateway_ttft_seconds Time to first token.\n"
      "# TYPE moeline_gateway_ttft_seconds histogram\n"
      "moeline_gateway_ttft_seconds_bucket{stage=\"gateway\",le=\"0.5\"} 2\n"
      "moeline_gateway_ttft_seconds_bucket{stage=\"gateway\",le=\"1\"} 2\n"
      "moeline_gateway_ttft_seconds_bucket{stage=\"gateway\",le=\"2.5\"} 3\n"
      "moeline_gateway_ttft_seconds_bucket{stage=\"gateway\",le=\"+Inf\"} 4\n"
      "moeline_gateway_ttft_seconds_sum{stage=\"gateway\"} 12.75\n"
      "moeline_gateway_ttft_seconds_count{stage=\"gateway\"} 4\n";
  EXPECT_EQ(registry.render(), want);
}

// The process's labels (a stage's model) on every sample, declared families with no sample yet,
// and the process metrics.
TEST(Registry, ProcessLabelsDeclaredFamiliesAndProcessMetrics) {
  Registry registry;
  registry.counter("moeline_x_total", "X.").inc();
  registry.histogram("moeline_y_seconds", "Y.", {1}, {{"stage", "s"}}).observe(0.5);
  registry.declare_counter({"moeline_z_total", "Z, labelled when it happens."});
  Registry::set_process_labels({{"model", "demo"}});
  const std::string text = registry.render();
  Registry::set_process_labels({});
  EXPECT_NE(text.find("moeline_x_total{model=\"demo\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("moeline_y_seconds_bucket{stage=\"s\",model=\"demo\",le=\"1\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("moeline_y_seconds_count{stage=\"s\",model=\"demo\"} 1\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("# TYPE moeline_z_total counter\n"), std::string::npos) << text;
  EXPECT_EQ(registry.render().find("model="), std::string::npos);  // reset

  ProcessMetrics process(registry);
  const std::string metrics = registry.render();
  for (const char* name : {"process_cpu_seconds_total ", "process_resident_memory_bytes ",
                           "process_open_fds ", "process_max_fds ", "process_start_time_seconds "})
    EXPECT_NE(metrics.find(std::string("\n") + name), std::string::npos) << name;
  EXPECT_EQ(metrics.find("process_resident_memory_bytes 0\n"), std::string::npos);
}

TEST(Registry, HistogramBucketsAreCumulativeAndInclusive) {
  Histogram histogram({1, 2, 4});
  for (const double value : {0.0, 1.0, 1.5, 4.0, 4.5, 100.0}) histogram.observe(value);
  EXPECT_EQ(histogram.cumulative(), (std::vector<uint64_t>{2, 3, 4, 6}));
  EXPECT_EQ(histogram.count(), 6u);
  EXPECT_EQ(histogram.sum(), 111.0);
}

TEST(Registry, SameNameAndLabelsIsTheSameSeries) {
  Registry registry;
  Counter& a = registry.counter("moeline_x_total", "X.", {{"k", "v"}});
  Counter& b = registry.counter("moeline_x_total", "X.", {{"k", "v"}});
  Counter& other = registry.counter("moeline_x_total", "X.", {{"k", "w"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &other);
  Gauge& g = registry.gauge("moeline_y", "Y.");
  g.set(4);
  g.add(-1.5);
  EXPECT_EQ(registry.gauge("moeline_y", "Y.").value(), 2.5);
}

TEST(Registry, OneNameTwoTypesIsALogicError) {
  Registry registry;
  registry.counter("moeline_gateway_things", "Things.");
  EXPECT_THROW(registry.gauge("moeline_gateway_things", "Things."), std::logic_error);
  EXPECT_THROW(registry.histogram("moeline_gateway_things", "Things.", {1}), std::logic_error);
  registry.gauge("moeline_gateway_level", "Level.");
  EXPECT_THROW(registry.counter("moeline_gateway_level", "Level."), std::logic_error);
}

TEST(Registry, ConcurrentIncrementsAreExact) {
  Registry registry;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 50'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&registry] {
      // Each thread looks the series up itself: registration is concurrent too.
      Counter& counter = registry.counter("moeline_test_events_total", "Events.");
      for (int i = 0; i < kPerThread; ++i) counter.inc();
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(registry.counter("moeline_test_events_total", "Events.").value(),
            double{kThreads} * kPerThread);
  EXPECT_NE(registry.render().find("moeline_test_events_total 200000\n"), std::string::npos)
      << registry.render();
}

TEST(Registry, HelpTextIsEscaped) {
  Registry registry;
  registry.gauge("moeline_z", "line one\nline two, C:\\path");
  EXPECT_NE(registry.render().find("# HELP moeline_z line one\\nline two, C:\\\\path\n"),
            std::string::npos)
      << registry.render();
}

// --- RateLimited ---------------------------------------------------------------------------------

TEST(RateLimited, AllowsOncePerIntervalAndCountsWhatItSuppressed) {
  // Long enough that the calls meant to fall inside one interval do on a busy machine.
  constexpr std::chrono::milliseconds kInterval{1500};
  RateLimited limit(kInterval);
  uint64_t suppressed = 99;
  ASSERT_TRUE(limit.allow(suppressed)) << "the first call";
  EXPECT_EQ(suppressed, 0u);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(limit.allow(suppressed)) << "call " << i;
  std::this_thread::sleep_for(kInterval + std::chrono::milliseconds(20));
  ASSERT_TRUE(limit.allow(suppressed)) << "a call after the interval";
  EXPECT_EQ(suppressed, 3u);
  EXPECT_FALSE(limit.allow(suppressed)) << "a new interval started";
}

TEST(RateLimited, FirstCallIsAllowedWhateverTheInterval) {
  RateLimited limit(std::chrono::hours(24 * 365 * 100));
  uint64_t suppressed = 99;
  EXPECT_TRUE(limit.allow(suppressed));
  EXPECT_EQ(suppressed, 0u);
}

// --- Logger --------------------------------------------------------------------------------------

TEST(Logger, OneKeyValueLinePerEvent) {
  const Logger log("gateway", "gateway 1");
  testing::internal::CaptureStderr();
  log.info("request_rejected", {{"reason", "prompt too long"},
                                {"tokens", 9000},
                                {"ratio", 0.5},
                                {"ok", true},
                                {"quote", std::string("say \"hi\"\nbye")},
                                {"empty", ""}});
  const std::string line = testing::internal::GetCapturedStderr();

  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1) << "one line: " << line;
  EXPECT_TRUE(std::regex_search(
      line, std::regex(R"(^ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=info stage=gateway )")))
      << line;
  EXPECT_NE(line.find(" replica=\"gateway 1\" event=request_rejected "), std::string::npos) << line;
  EXPECT_NE(line.find(" reason=\"prompt too long\" tokens=9000 ratio=0.5 ok=true "),
            std::string::npos)
      << line;
  EXPECT_NE(line.find(R"( quote="say \"hi\"\nbye" empty="")"), std::string::npos) << line;
}

TEST(Logger, LevelsAndPlainValues) {
  const Logger log("decode", "decode-0");
  EXPECT_EQ(log.stage(), "decode");
  EXPECT_EQ(log.replica(), "decode-0");
  testing::internal::CaptureStderr();
  log.warn("slow_step", {{"ms", int64_t{250}}});
  log.error("peer_lost");
  const std::string out = testing::internal::GetCapturedStderr();
  const size_t first_end = out.find('\n');
  ASSERT_NE(first_end, std::string::npos) << out;
  const std::string first = out.substr(0, first_end + 1);
  const std::string second = out.substr(first_end + 1);
  EXPECT_NE(first.find(" level=warn stage=decode replica=decode-0 event=slow_step ms=250\n"),
            std::string::npos)
      << first;
  EXPECT_NE(second.find(" level=error stage=decode replica=decode-0 event=peer_lost\n"),
            std::string::npos)
      << second;
  EXPECT_EQ(second.rfind("ts=", 0), 0u) << second;
}

}  // namespace
}  // namespace moeline::runtime

// The health endpoints an orchestrator and a load balancer read: /livez says the loop is not
// wedged (a stage still starting is alive), /readyz (and /healthz) that it takes work.
namespace {
sockaddr_in loopback_address(uint16_t port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// One GET over a plain socket: the status code and the body.
std::pair<int, std::string> http_get(uint16_t port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = loopback_address(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return {0, ""};
  }
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)::write(fd, request.data(), request.size());
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) response.append(buffer, n);
  ::close(fd);
  if (response.size() < 12) return {0, response};
  const size_t body = response.find("\r\n\r\n");
  return {std::stoi(response.substr(9, 3)),
          body == std::string::npos ? "" : response.substr(body + 4)};
}
}  // namespace

// A stage whose setup fails right after its HTTP server starts (a bad --device found after the
// model loaded) must still exit with its error: cpp-httplib's stop() does nothing until the
// listening thread has begun, so a stop that came first left that thread serving and the join
// waiting for it forever (seen under CI load: the stage answered 503 until `stack up` gave up).
TEST(StageHealth, StoppingRightAfterStartingReturns) {
  std::atomic<bool> finished{false};
  std::thread watchdog([&finished] {
    for (int waited_ms = 0; waited_ms < 30000 && !finished.load(); waited_ms += 10)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!finished.load()) {
      std::fprintf(stderr, "stop_http right after start_http did not return within 30 s\n");
      std::_Exit(1);
    }
  });
  for (int i = 0; i < 200; ++i) {
    moeline::runtime::StageService service("probe", "probe-0");
    service.start_http("127.0.0.1:0", "");
    service.stop_http();
  }
  finished.store(true);
  watchdog.join();
}

TEST(StageHealth, HealthzListsTheEndpointsTheStageAdvertises) {
  moeline::runtime::StageService service("probe", "probe-0");
  service.start_http("127.0.0.1:0", "");
  const uint16_t port = service.http_port();
  // None advertised: no "endpoints" at all.
  EXPECT_EQ(http_get(port, "/healthz").second.find("\"endpoints\""), std::string::npos);
  service.advertise("intake", "tcp://127.0.0.1:40001");
  service.advertise("intake", "tcp://127.0.0.1:40002");  // the latest wins
  const auto body = nlohmann::json::parse(http_get(port, "/healthz").second);
  EXPECT_EQ(body["endpoints"], nlohmann::json({{"intake", "tcp://127.0.0.1:40002"}})) << body;
}

TEST(StageHealth, LiveWhileStartingReadyOnceJoinedStalledPastTheWatchdog) {
  moeline::runtime::StageService service("probe", "probe-0");
  // Long enough that a request right after a tick is answered within it on a busy machine; each
  // answer that must be 200 follows a tick of its own.
  service.set_watchdog_limit(std::chrono::milliseconds(1500));
  service.start_http("127.0.0.1:0", "");
  const uint16_t port = service.http_port();
  // Starting: alive, not ready (the model may still be loading).
  EXPECT_EQ(http_get(port, "/livez").first, 200);
  EXPECT_EQ(http_get(port, "/readyz").first, 503);
  EXPECT_NE(http_get(port, "/readyz").second.find("\"starting\""), std::string::npos);
  // What it is doing meanwhile, and for how long.
  service.set_phase("loading model");
  const std::string loading = http_get(port, "/readyz").second;
  EXPECT_NE(loading.find("\"phase\":\"loading model\""), std::string::npos) << loading;
  EXPECT_NE(loading.find("\"phase_s\":"), std::string::npos) << loading;
  EXPECT_EQ(loading.find("\"progress\""), std::string::npos) << loading;  // none reported yet
  // How far it is (the model's layers bound so far).
  service.set_phase_progress(12, 48);
  const std::string part = http_get(port, "/readyz").second;
  EXPECT_NE(part.find("\"progress\":0.25"), std::string::npos) << part;
  EXPECT_NE(part.find("\"progress_done\":12"), std::string::npos) << part;
  EXPECT_NE(part.find("\"progress_total\":48"), std::string::npos) << part;
  // The next phase starts without the last one's progress.
  service.set_phase("joining hub");
  const std::string joining = http_get(port, "/readyz").second;
  EXPECT_NE(joining.find("\"phase\":\"joining hub\""), std::string::npos) << joining;
  EXPECT_EQ(joining.find("\"progress\""), std::string::npos) << joining;
  // The loop runs and the hub accepted it: both.
  service.tick();
  service.set_ready(true);
  EXPECT_EQ(http_get(port, "/livez").first, 200);
  service.tick();
  EXPECT_EQ(http_get(port, "/readyz").first, 200);
  service.tick();
  EXPECT_EQ(http_get(port, "/healthz").first, 200);
  // The loop stops ticking past the watchdog: neither, and it says why.
  service.tick();
  std::this_thread::sleep_for(std::chrono::milliseconds(1800));
  const auto [live, body] = http_get(port, "/livez");
  EXPECT_EQ(live, 503);
  EXPECT_NE(body.find("\"stalled\""), std::string::npos) << body;
  EXPECT_EQ(http_get(port, "/readyz").first, 503);
  // It ticks again: alive and ready again.
  service.tick();
  EXPECT_EQ(http_get(port, "/livez").first, 200);
  service.tick();
  EXPECT_EQ(http_get(port, "/readyz").first, 200);
  service.stop_http();
}

// --log-level and --log-format: lines below the level are not written; json lines are one object
// each, with the line's own keys first and a field that would collide with them renamed.
namespace {
std::string captured_stderr(const std::function<void()>& write) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return "";
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(pipe_fds[1], STDERR_FILENO);
  write();
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(pipe_fds[1]);
  std::string out;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;) out.append(buffer, n);
  ::close(pipe_fds[0]);
  return out;
}
}  // namespace

TEST(Logs, LevelAndFormat) {
  using namespace moeline::runtime;
  const Logger log("decode", "decode-1");
  const std::string json = captured_stderr([&] {
    set_log_options(LogLevel::kWarn, LogFormat::kJson);
    log.info("not_written", {{"a", 1}});
    log.warn("written", {{"tokens", 12}, {"why", "a \"quoted\" reason"}, {"replica", "spoof"}});
    set_log_options(LogLevel::kInfo, LogFormat::kLogfmt);
  });
  EXPECT_EQ(json.find("not_written"), std::string::npos) << json;
  const auto line = nlohmann::json::parse(json.substr(0, json.find('\n')));
  EXPECT_EQ(line["level"], "warn");
  EXPECT_EQ(line["stage"], "decode");
  EXPECT_EQ(line["replica"], "decode-1");
  EXPECT_EQ(line["field_replica"], "spoof");
  EXPECT_EQ(line["event"], "written");
  EXPECT_EQ(line["tokens"], 12);
  EXPECT_EQ(line["why"], "a \"quoted\" reason");

  const std::string logfmt = captured_stderr([&] { log.info("plain", {{"n", 3}}); });
  EXPECT_NE(logfmt.find("level=info stage=decode replica=decode-1 event=plain n=3"),
            std::string::npos)
      << logfmt;
  EXPECT_THROW(parse_log_level("debug"), std::invalid_argument);
  EXPECT_THROW(parse_log_format("xml"), std::invalid_argument);
  EXPECT_EQ(parse_log_level("error"), LogLevel::kError);
}

// `stack up --transport tcp` binds its hub, client and HTTP endpoints on ports chosen here: chosen
// one at a time, a port just closed could come back, and the gateway once got the same port for
// its hub and its clients and could not start. Chosen from the kernel's ephemeral range, a port
// was taken by an outgoing connection before the gateway bound it, and it never started.
TEST(StackPorts, LoopbackPortsChosenTogetherDifferAreFreeAndNotEphemeral) {
  int ephemeral_low = 32768, ephemeral_high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low >> ephemeral_high;
  const std::vector<int> ports = moeline::stages::free_loopback_ports(64);
  ASSERT_EQ(ports.size(), 64u);
  std::set<int> distinct(ports.begin(), ports.end());
  EXPECT_EQ(distinct.size(), ports.size());
  for (const int port : ports) {
    ASSERT_GT(port, 0);
    ASSERT_LE(port, 65535);
    // This host has room below the range (Linux's default leaves 10000-32767).
    if (ephemeral_low > 11000) {
      EXPECT_TRUE(port < ephemeral_low || port > ephemeral_high) << port << " is ephemeral";
    }
    // Free once chosen: a listener can have it (another process may race for it, as for any
    // port; on a test machine none does in this moment).
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in address = loopback_address(static_cast<uint16_t>(port));
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0) << port;
    ::close(fd);
  }
  EXPECT_TRUE(moeline::stages::free_loopback_ports(0).empty());
}
