#include "stages/common/worker.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>

#include "kernels/cpu/kernel_report.h"
#include "stages/common/common.h"
#ifdef MOELINE_HAVE_CUDA
#include "model/cuda_engine.h"
#endif

namespace moeline::stages {
namespace {

// /healthz's "kernels": which path the CPU kernels take here, on which CPU, and their tuning.
nlohmann::json kernels_json(const kernels::KernelReport& report) {
  nlohmann::json tuning = nlohmann::json::object();
  for (const auto& [name, value] : report.tuning) tuning[name] = value;
  nlohmann::json body = {{"isa", report.isa},
                         {"best_isa", report.best_isa},
                         {"cpu", report.cpu},
                         {"quant_math", report.quant_math},
                         {"bf16_math", report.bf16_math},
                         {"arithmetic_revision", report.arithmetic_revision},
                         {"tuning", tuning}};
  if (!report.forced.empty()) body["forced"] = report.forced;
  return body;
}

}  // namespace

void ExpertUsageCounter::on_router(const model::RouterEvent& event) {
  const auto tokens = static_cast<int64_t>(event.tokens.size());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < event.top_k; ++k)
      ++counts_[static_cast<size_t>(event.layer * experts_ + event.chosen[t * event.top_k + k])];
  if (event.layer == 0 || tokens_ == 0) tokens_ += static_cast<uint64_t>(tokens);
  if (event.layer < 0 || event.layer >= layers_) return;
  const auto layer = static_cast<size_t>(event.layer);
  layer_tokens_[layer] += static_cast<uint64_t>(tokens);
  router_seconds_[layer] += event.router_seconds;
  if (event.top_k >= 2 && event.scores) {
    double sum = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      const float first = event.scores[t * event.experts + event.chosen[t * event.top_k]];
      const float second = event.scores[t * event.experts + event.chosen[t * event.top_k + 1]];
      // Probabilities of a softmax: their log ratio is the gap of the router's logits.
      sum += std::log(std::max(first, 1e-30f)) - std::log(std::max(second, 1e-30f));
    }
    confidence_sum_[layer] += sum;
  }
}

std::vector<zmq::message_t> ExpertUsageCounter::take(const std::string& replica,
                                                     const std::string& reporter,
                                                     std::span<const uint8_t> ticket) {
  flatbuffers::FlatBufferBuilder builder(counts_.size() * 8 + 192);
  auto counts = builder.CreateVector(counts_);
  auto name = builder.CreateString(replica);
  auto layer_tokens = builder.CreateVector(layer_tokens_);
  auto confidence = builder.CreateVector(confidence_sum_);
  auto router_seconds = builder.CreateVector(router_seconds_);
  auto reporter_name = reporter.empty() ? 0 : builder.CreateString(reporter);
  auto ticket_bytes = ticket.empty() ? 0 : builder.CreateVector(ticket.data(), ticket.size());
  builder.Finish(
      wire::CreateExpertUsage(builder, static_cast<uint32_t>(layers_),
                              static_cast<uint32_t>(experts_), counts, tokens_, name, layer_tokens,
                              confidence, router_seconds, reporter_name, ticket_bytes),
      wire::ExpertPlanIdentifier());
  std::fill(counts_.begin(), counts_.end(), 0);
  std::fill(layer_tokens_.begin(), layer_tokens_.end(), 0);
  std::fill(confidence_sum_.begin(), confidence_sum_.end(), 0.0);
  std::fill(router_seconds_.begin(), router_seconds_.end(), 0.0);
  tokens_ = 0;
  return wire::encode(wire::MessageType::ExpertUsage, builder);
}

ComputeWorker::ComputeWorker(const runtime::Config& config, const char* stage, wire::StageKind kind)
    : service(stage, replica_name(config, stage)) {
  runtime::StageService::install_signal_handlers();
  service.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
  configure_io_threads(context, config);
  // The HTTP server first: /livez answers while the model loads, and /readyz says what the stage
  // is doing (503 until it has joined the hub). Its detail reads only what is set before it or
  // atomically.
  device = config.text("device");
  service.start_http(config.text("http"), config.text("port-file"), [this] {
    // The HTTP thread: only what the loop published (ThreadSanitizer caught this reading the
    // link and the plan flag while the loop set them).
    return nlohmann::json{{"hub_accepted", health_hub_accepted_.load()},
                          {"expert_plan", health_plan_received_.load()},
                          {"device", device},
                          {"kernels", kernels_json(kernels::kernel_report())}};
  });
  service.set_phase("loading model");
  auto loaded = model::Model::load(config.text("model"), [this](int64_t done, int64_t total) {
    service.set_phase_progress(done, total);
  });
  if (!loaded) throw std::runtime_error(loaded.error().message);
  model = std::move(*loaded);
  service.log.info("model_loaded", {{"dir", config.text("model")},
                                    {"model_id", model->model_id()},
                                    {"dtype", model->dtype_summary()}});
  const kernels::KernelReport kernel_report = kernels::kernel_report();
  service.log.info("kernels", kernels::report_fields(kernel_report));
  if (const std::string problem = kernels::forced_path_problem(kernel_report); !problem.empty())
    service.log.warn("kernels_forced_path_ignored", {{"reason", problem}});
  int threads = static_cast<int>(config.integer("threads"));
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  pool = std::make_unique<kernels::ThreadPool>(threads);
  experts = std::make_unique<PlannedExperts>(*model);
  device_expert_budget_ = config.text("device-expert-budget");
  if (device != "cpu" && device != "cuda") {
    const std::string index = device.rfind("cuda:", 0) == 0 ? device.substr(5) : "";
    if (index.empty() || index.size() > 4 ||
        index.find_first_not_of("0123456789") != std::string::npos)
      throw runtime::ConfigError("--device must be cpu, cuda or cuda:N, not '" + device + "'");
    device_ordinal_ = std::stoi(index);
  }
  if (device == "cpu" && !device_expert_budget_.empty())
    throw runtime::ConfigError("--device-expert-budget needs --device cuda");
  if (device != "cpu" && !config.text("expert-trace").empty())
    throw runtime::ConfigError(
        "--expert-trace records the CPU engine's expert acquisitions; not with --device " + device);
  if (std::string path = config.text("expert-trace"); !path.empty()) {
    // One file per replica: "{replica}" in the path becomes this process's name.
    if (const size_t at = path.find("{replica}"); at != std::string::npos)
      path.replace(at, 9, service.log.replica());
    trace = std::make_unique<offload::TraceRecorder>(
        *experts, model->expert_catalog(),
        static_cast<size_t>(config.integer("expert-trace-limit")));
    trace->set_process(service.log.replica(), stage);
    trace_path = path;
    service.log.info("expert_trace",
                     {{"path", path}, {"limit", config.integer("expert-trace-limit")}});
  }
  const model::ModelConfig& cfg = model->config();
  usage =
      std::make_unique<ExpertUsageCounter>(cfg.num_layers, std::max<int64_t>(1, cfg.num_experts));
  service.set_phase("joining hub");
  link_settings_ = link_settings(config, kind, service.log.replica(), *model, service.http_port());
  link = std::make_unique<runtime::HubLink>(context, link_settings_, service.log, service.metrics);
  peers = std::make_unique<runtime::PeerSender>(context, link_settings_.curve_keys,
                                                shared_bulk_settings(config), service.metrics,
                                                service.log);
}

void ComputeWorker::open_intake(const runtime::Config& config) {
  if (link_settings_.curve_keys)
    zap = std::make_unique<runtime::ZapHandler>(context, service.log, service.metrics);
  intake = stages::open_intake(context, config, link_settings_, service.log.stage(), service.log,
                               service.metrics, zap.get());
  link->set_intake(intake->endpoint(), intake->public_key(), intake->node());
  service.advertise("intake", intake->endpoint());
}

ComputeWorker::~ComputeWorker() {
  service.stop_http();  // /healthz reads members that die before `service`
  if (trace && !trace->write(trace_path))
    service.log.error("expert_trace_not_written", {{"path", trace_path}});
}

void ComputeWorker::create_engine(int32_t kv_blocks) {
  observers.add(usage.get());
  if (device == "cpu") {
    cache = std::make_unique<model::KvCache>(model->config(), kv_blocks);
    offload::ExpertProvider& provider =
        trace ? static_cast<offload::ExpertProvider&>(*trace) : *experts;
    engine = std::make_unique<model::Engine>(*model, provider, *pool, *cache);
    forward = engine.get();
    forward->set_router_observer(&observers);
    service.log.info("kv_cache", {{"device", device},
                                  {"blocks", kv_blocks},
                                  {"bytes", static_cast<uint64_t>(cache->bytes())}});
    return;
  }
#ifdef MOELINE_HAVE_CUDA
  double fraction = 1.0;
  if (!device_expert_budget_.empty()) {
    try {
      fraction = offload::expert_budget_fraction(device_expert_budget_,
                                                 model->expert_catalog().pool_bytes_for_all());
    } catch (const std::exception& e) {
      throw runtime::ConfigError(std::string("--device-expert-budget: ") + e.what());
    }
  }
  // Below a device budget of 1, missing experts come from `experts`: this process's mapping of
  // the checkpoint until the plan names the node's host pool, then that pool (pinned with the
  // device on first use). The CPU may compute a miss where that is measured to be cheaper.
  auto created =
      model::CudaEngine::create(*model, {.device = device_ordinal_,
                                         .kv_blocks = kv_blocks,
                                         .expert_budget_fraction = std::min(fraction, 1.0),
                                         .host_experts = experts.get(),
                                         .cpu_threads = pool.get()});
  if (!created) throw std::runtime_error("--device " + device + ": " + created.error().message);
  auto* cuda = created->get();
  service.log.info("kv_cache",
                   {{"device", device},
                    {"blocks", kv_blocks},
                    {"expert_slots", cuda->expert_slots()},
                    {"device_bytes", static_cast<uint64_t>(cuda->device_weight_bytes())}});
  device_engine = std::move(*created);
  forward = device_engine.get();
  forward->set_router_observer(&observers);
  runtime::Registry& m = service.metrics;
  m.gauge("moeline_device_expert_slots", "Experts the GPU's expert cache holds")
      .set(cuda->expert_slots());
  m.gauge("moeline_device_weight_bytes", "Bytes of GPU memory holding weights, experts and KV")
      .set(static_cast<double>(cuda->device_weight_bytes()));
  struct Counters {
    runtime::Counter *hits, *misses, *prefetched, *prefetch_used, *on_cpu, *bytes, *graphs;
    runtime::Histogram* load;
    model::CudaExpertStats last;
    uint64_t last_graphs = 0;
  };
  auto counters = std::make_shared<Counters>(Counters{
      &m.counter("moeline_device_expert_hits_total", "Expert uses found in the GPU's cache"),
      &m.counter("moeline_device_expert_misses_total",
                 "Expert uses not in the GPU's cache (copied in, or computed on the CPU)"),
      &m.counter("moeline_device_prefetch_total", "Experts copied to the GPU on a prediction"),
      &m.counter("moeline_device_prefetch_used_total", "Predicted experts used before eviction"),
      &m.counter("moeline_device_computed_on_cpu_total",
                 "Misses computed on the CPU, where measured to be cheaper than the copy"),
      &m.counter("moeline_device_bytes_loaded_total", "Expert bytes copied host to GPU"),
      &m.counter("moeline_device_graph_replays_total", "Decode steps replayed as CUDA graphs"),
      &m.histogram("moeline_device_expert_load_seconds", "One expert's copy to the GPU",
                   runtime::latency_buckets()),
      {},
      0});
  report_device_ = [cuda, counters] {
    Counters& c = *counters;
    for (float ms : cuda->take_load_ms()) c.load->observe(ms * 1e-3);
    const model::CudaExpertStats now = cuda->expert_stats();
    c.hits->inc(static_cast<double>(now.hits - c.last.hits));
    c.misses->inc(static_cast<double>(now.misses - c.last.misses));
    c.prefetched->inc(static_cast<double>(now.prefetched - c.last.prefetched));
    c.prefetch_used->inc(static_cast<double>(now.prefetch_used - c.last.prefetch_used));
    c.on_cpu->inc(static_cast<double>(now.computed_on_cpu - c.last.computed_on_cpu));
    c.bytes->inc(static_cast<double>(now.bytes_loaded - c.last.bytes_loaded));
    c.graphs->inc(static_cast<double>(cuda->graph_replays() - c.last_graphs));
    c.last_graphs = cuda->graph_replays();
    c.last = now;
  };
#else
  throw std::runtime_error("--device " + device +
                           ": this build has no CUDA backend (nvcc was not found when it was "
                           "built)");
#endif
}

std::string ComputeWorker::exit_reason() const {
  return pool_lost_.empty() ? link->reject_reason() : pool_lost_;
}

bool ComputeWorker::maintain() {
  if (link->rejected()) return false;
  const auto now = std::chrono::steady_clock::now();
  if (experts->pool() && now - last_pool_check_ > std::chrono::seconds(1)) {
    last_pool_check_ = now;
    if (!experts->pool()->owner_alive()) {
      pool_lost_ = "the expert pool's owner (offload manager) is gone";
      service.log.error("expert_pool_lost", {{"pool", experts->pool()->name()}});
      return false;
    }
  }
  if (link->needs_hello()) {
    plan_received_ = false;
    plan_requested_ = false;
    link->hello(0);
  }
  // Ask for the plan once accepted, and again if the answer is slow (no offload manager yet).
  if (link->accepted() && !plan_received_ &&
      (!plan_requested_ || now - plan_requested_at_ > std::chrono::seconds(2))) {
    flatbuffers::FlatBufferBuilder builder(128);
    builder.Finish(wire::CreateExpertPlanRequest(builder, model->model_id(),
                                                 builder.CreateString(link->identity())),
                   wire::ExpertPlanIdentifier());
    link->send(wire::encode(wire::MessageType::ExpertPlanRequest, builder));
    plan_requested_ = true;
    plan_requested_at_ = now;
  }
  if (report_device_ && now - last_device_report_ > std::chrono::seconds(1)) {
    report_device_();
    last_device_report_ = now;
  }
  if (ready() && !usage->empty() && now - last_usage_report_ > std::chrono::seconds(1)) {
    report_usage();
    last_usage_report_ = now;
  }
  health_hub_accepted_.store(link->accepted());
  health_plan_received_.store(plan_received_);
  service.set_ready(ready());
  return true;
}

void ComputeWorker::report_usage() {
  if (usage_route_) {
    auto report = usage->take(service.log.replica(), link->identity(), usage_route_->ticket);
    if (peers->send(usage_route_->to, std::move(report))) return;
    // Unreachable (a restarted offload manager listens elsewhere): through the hub from now on,
    // where the gateway passes it on to whichever offload manager is there.
    service.log.warn("usage_route_unreachable", {{"endpoint", usage_route_->to.endpoint}});
    usage_route_.reset();
    return;
  }
  link->send(usage->take(service.log.replica()));
}

bool ComputeWorker::handle(const wire::Message& message, uint32_t free_credits) {
  if (message.type != wire::MessageType::ExpertPlan) return false;
  const auto* plan = message.as<wire::ExpertPlan>();
  if (plan->model_id() != model->model_id()) {
    service.log.error("expert_plan_mismatch", {{"model_id", plan->model_id()}});
    return true;
  }
  if (!plan_received_) {
    const std::string pool_name = plan->pool_name() ? plan->pool_name()->str() : "";
    if (!pool_name.empty() && (!experts->pool() || experts->pool()->name() != pool_name)) {
      auto client = offload::PoolClient::attach(pool_name, model->expert_catalog());
      if (!client) {
        // Asked again shortly (maintain); no credit until the pool is reachable.
        service.log.error("expert_pool_attach_failed",
                          {{"pool", pool_name},
                           {"code", std::string(status_code_name(client.error().code))},
                           {"error", client.error().message}});
        return true;
      }
      (*client)->set_prefetch_depth(static_cast<int>(plan->prefetch_depth()));
      experts->use_pool(std::move(*client));
      model->release_expert_mappings();
    }
    plan_received_ = true;
    usage_route_.reset();
    if (const wire::PeerRoute* route = plan->usage_route();
        route != nullptr && route->endpoint() != nullptr && route->ticket() != nullptr) {
      usage_route_ = UsageRoute{runtime::PeerAddress::of(route),
                                {route->ticket()->begin(), route->ticket()->end()}};
      peers->prepare(usage_route_->to);
    }
    service.log.info("expert_plan", {{"tier", plan->tier() ? plan->tier()->str() : ""},
                                     {"all_resident", plan->all_resident()},
                                     {"pool", experts->pool() ? experts->pool()->name() : ""},
                                     {"prefetch_depth", plan->prefetch_depth()},
                                     {"usage_to", usage_route_ ? usage_route_->to.endpoint : "hub"},
                                     {"credits", free_credits}});
    link->grant(free_credits);
  }
  return true;
}

}  // namespace moeline::stages
