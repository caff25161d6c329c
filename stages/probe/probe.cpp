#include "stages/probe/probe.h"

#include <chrono>

#include "model/model.h"
#include "stages/common/common.h"
#include "stages/runtime/link.h"
#include "stages/runtime/service.h"

namespace moeline::stages {
namespace {

int probe_body(const runtime::Config& config) {
  runtime::StageService::install_signal_handlers();
  runtime::StageService service("probe", replica_name(config, "probe"));
  service.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
  auto model = model::Model::load(config.text("model"));
  if (!model) throw std::runtime_error(model.error().message);
  service.start_http(config.text("http"), config.text("port-file"));
  auto& metrics = service.metrics;
  auto& lookups = metrics.counter("moeline_probe_lookups_total", "Jobs looked up");
  auto& planned =
      metrics.counter("moeline_probe_requests_total", "Jobs by outcome", {{"outcome", "planned"}});
  auto& latency = metrics.histogram("moeline_probe_latency_seconds", "Lookup time per job",
                                    runtime::latency_buckets());
  auto& batch = metrics.histogram("moeline_probe_batch_size", "Jobs handled per loop iteration",
                                  runtime::size_buckets());
  auto& queue_depth = metrics.gauge("moeline_probe_queue_depth", "Jobs waiting in this probe");
  metrics.counter("moeline_probe_hits_total", "Reuse hits by level", {{"level", "none"}});
  const auto credits = static_cast<uint32_t>(config.integer("queue"));

  zmq::context_t context(1);
  runtime::LinkSettings settings =
      link_settings(config, wire::StageKind::Probe, service.log.replica(), (*model)->model_id(),
                    service.http_port());
  runtime::HubLink link(context, settings, service.log, metrics);
  queue_depth.set(0);

  while (!runtime::StageService::stop_requested()) {
    service.tick();
    if (link.rejected()) return 3;
    if (link.needs_hello()) link.hello(credits);
    service.set_ready(link.accepted());
    uint32_t handled = 0;
    for (auto message = link.receive(50); message; message = link.receive(0)) {
      switch (message->type) {
        case wire::MessageType::ProbeJob: {
          const auto start = std::chrono::steady_clock::now();
          const auto* job = message->as<wire::ProbeJob>();
          flatbuffers::FlatBufferBuilder builder(128);
          const auto took = std::chrono::steady_clock::now() - start;
          builder.Finish(
              wire::CreateProbePlan(
                  builder, job->request_id(), job->attempt(), builder.CreateString("none"), 0,
                  static_cast<uint32_t>(
                      std::chrono::duration_cast<std::chrono::microseconds>(took).count())),
              wire::PrefillJobIdentifier());
          link.send(wire::encode(wire::MessageType::ProbePlan, builder));
          link.grant(1);
          lookups.inc();
          planned.inc();
          latency.observe(std::chrono::duration<double>(took).count());
          ++handled;
          break;
        }
        case wire::MessageType::Hello:
        case wire::MessageType::HelloReply:
        case wire::MessageType::Heartbeat:
        case wire::MessageType::Credit:
        case wire::MessageType::ErrorReply:
        case wire::MessageType::GenerateRequest:
        case wire::MessageType::CancelRequest:
        case wire::MessageType::Feedback:
        case wire::MessageType::StreamEvent:
        case wire::MessageType::ProbePlan:
        case wire::MessageType::PrefillJob:
        case wire::MessageType::PrefillDone:
        case wire::MessageType::TokenBatch:
        case wire::MessageType::JobFailed:
        case wire::MessageType::CancelJob:
        case wire::MessageType::ExpertPlanRequest:
        case wire::MessageType::ExpertPlan:
        case wire::MessageType::ExpertUsage:
        case wire::MessageType::ControlCommand:
        case wire::MessageType::ControlReply:
          service.log.warn("unexpected_message",
                           {{"type", wire::message_type_name(message->type)}});
          break;
      }
    }
    if (handled) batch.observe(handled);
  }
  service.log.info("stopped");
  return 0;
}

std::vector<runtime::ConfigKey> probe_keys() {
  std::vector<runtime::ConfigKey> keys = worker_keys();
  keys.push_back({"queue", "64", "jobs this probe accepts at once (its credit)"});
  return keys;
}

}  // namespace

int probe_main(int argc, char** argv) {
  return run_stage("probe", probe_keys(), argc, argv, probe_body);
}

}  // namespace moeline::stages
