#include "stages/offload_manager/offload_manager.h"

#include <cmath>
#include <numeric>

#include "model/model.h"
#include "stages/common/common.h"
#include "stages/runtime/link.h"
#include "stages/runtime/service.h"

namespace moeline::stages {
namespace {

int offload_body(const runtime::Config& config) {
  runtime::StageService::install_signal_handlers();
  runtime::StageService service("offload", replica_name(config, "offload"));
  service.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
  auto loaded = model::Model::load(config.text("model"));
  if (!loaded) throw std::runtime_error(loaded.error().message);
  const model::Model& model = **loaded;
  const model::ModelConfig& cfg = model.config();
  size_t expert_bytes = 0;
  for (const auto& layer : model.experts())
    for (const offload::ExpertWeights& expert : layer) expert_bytes += expert.bytes();
  service.start_http(config.text("http"), config.text("port-file"));
  auto& metrics = service.metrics;
  metrics.gauge("moeline_offload_expert_bytes", "Bytes of expert weights", {{"tier", "resident"}})
      .set(static_cast<double>(expert_bytes));
  auto& plans = metrics.counter("moeline_offload_plans_total", "Expert plans served");
  auto& routed = metrics.counter("moeline_offload_routed_tokens_total",
                                 "Tokens whose routing was reported by compute stages");
  const int64_t layers = cfg.num_layers;
  const int64_t experts = std::max<int64_t>(1, cfg.num_experts);
  std::vector<uint64_t> totals(static_cast<size_t>(layers * experts), 0);
  std::vector<runtime::Counter*> per_expert(totals.size());
  std::vector<runtime::Gauge*> imbalance(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) {
    imbalance[static_cast<size_t>(l)] = &metrics.gauge(
        "moeline_offload_load_imbalance", "std/mean of per-expert token counts since start",
        {{"layer", std::to_string(l)}});
    for (int64_t e = 0; e < experts; ++e)
      per_expert[static_cast<size_t>(l * experts + e)] =
          &metrics.counter("moeline_offload_expert_tokens_total", "Tokens routed to each expert",
                           {{"layer", std::to_string(l)}, {"expert", std::to_string(e)}});
  }

  zmq::context_t context(1);
  runtime::LinkSettings settings =
      link_settings(config, wire::StageKind::OffloadManager, service.log.replica(),
                    model.model_id(), service.http_port());
  runtime::HubLink link(context, settings, service.log, metrics);

  while (!runtime::StageService::stop_requested()) {
    service.tick();
    if (link.rejected()) return 3;
    if (link.needs_hello()) link.hello(1u << 20);
    service.set_ready(link.accepted());
    auto message = link.receive(100);
    if (!message) continue;
    switch (message->type) {
      case wire::MessageType::ExpertPlanRequest: {
        const auto* request = message->as<wire::ExpertPlanRequest>();
        flatbuffers::FlatBufferBuilder builder(256);
        auto tier = builder.CreateString("resident");
        auto requester = builder.CreateString(request->replica() ? request->replica()->str() : "");
        builder.Finish(
            wire::CreateExpertPlan(builder, model.model_id(), true, static_cast<uint32_t>(layers),
                                   static_cast<uint32_t>(experts), expert_bytes, tier, requester),
            wire::ExpertPlanIdentifier());
        link.send(wire::encode(wire::MessageType::ExpertPlan, builder));
        plans.inc();
        break;
      }
      case wire::MessageType::ExpertUsage: {
        const auto* usage = message->as<wire::ExpertUsage>();
        if (usage->layers() != layers || usage->experts() != experts || !usage->counts() ||
            usage->counts()->size() != totals.size()) {
          service.log.warn("usage_shape_mismatch", {{"layers", usage->layers()}});
          break;
        }
        for (size_t i = 0; i < totals.size(); ++i) {
          totals[i] += usage->counts()->Get(static_cast<flatbuffers::uoffset_t>(i));
          per_expert[i]->inc(
              static_cast<double>(usage->counts()->Get(static_cast<flatbuffers::uoffset_t>(i))));
        }
        routed.inc(static_cast<double>(usage->tokens()));
        for (int64_t l = 0; l < layers; ++l) {
          const auto begin = totals.begin() + l * experts;
          const double mean =
              static_cast<double>(std::accumulate(begin, begin + experts, uint64_t{0})) /
              static_cast<double>(experts);
          double variance = 0;
          for (auto it = begin; it != begin + experts; ++it)
            variance += (static_cast<double>(*it) - mean) * (static_cast<double>(*it) - mean);
          variance /= static_cast<double>(experts);
          imbalance[static_cast<size_t>(l)]->set(mean > 0 ? std::sqrt(variance) / mean : 0.0);
        }
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
      case wire::MessageType::ProbeJob:
      case wire::MessageType::ProbePlan:
      case wire::MessageType::PrefillJob:
      case wire::MessageType::PrefillDone:
      case wire::MessageType::TokenBatch:
      case wire::MessageType::JobFailed:
      case wire::MessageType::SnapshotPut:
      case wire::MessageType::CancelJob:
      case wire::MessageType::ExpertPlan:
      case wire::MessageType::ControlCommand:
      case wire::MessageType::ControlReply:
        service.log.warn("unexpected_message", {{"type", wire::message_type_name(message->type)}});
        break;
    }
  }
  service.log.info("stopped");
  return 0;
}

}  // namespace

int offload_main(int argc, char** argv) {
  return run_stage("offload", worker_keys(), argc, argv, offload_body);
}

}  // namespace moeline::stages
