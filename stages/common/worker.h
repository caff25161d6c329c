#pragma once
// The part of a compute stage (prefill, decode) that is not its loop: the checkpoint, the engine's
// pieces, the link to the hub, and the handshake with the offload manager. A compute process
// says hello with no credit, asks the offload manager where the experts are (ExpertPlan) and only
// then grants its capacity: no job reaches it before it knows how to reach every expert. It also
// counts the tokens each expert sees (a RouterObserver) and reports them to the offload manager.

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "kernels/cpu/thread_pool.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/router_observer.h"
#include "offload/expert_pool.h"
#include "offload/resident_provider.h"
#include "offload/trace.h"
#include "stages/runtime/config.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/link.h"
#include "stages/runtime/service.h"

namespace moeline::stages {

class ExpertUsageCounter : public model::RouterObserver {
 public:
  ExpertUsageCounter(int64_t layers, int64_t experts)
      : layers_(layers),
        experts_(experts),
        counts_(static_cast<size_t>(layers * experts)),
        layer_tokens_(static_cast<size_t>(layers)),
        confidence_sum_(static_cast<size_t>(layers)),
        router_seconds_(static_cast<size_t>(layers)) {}
  void on_router(const model::RouterEvent& event) override;
  bool empty() const { return tokens_ == 0; }
  // Builds an ExpertUsage message of the counts since the last call and resets them. A report
  // for the offload manager's intake names the routing identity its plan was asked with and
  // carries that plan's ticket (both empty for one through the hub).
  std::vector<zmq::message_t> take(const std::string& replica, const std::string& reporter = {},
                                   std::span<const uint8_t> ticket = {});

 private:
  int64_t layers_, experts_;
  std::vector<uint64_t> counts_;
  std::vector<uint64_t> layer_tokens_;
  std::vector<double> confidence_sum_, router_seconds_;
  uint64_t tokens_ = 0;
};

// The engine's expert provider: every expert resident in this process's mapping of the checkpoint
// until the offload manager's plan names the node's shared pool, then that pool. The plan arrives
// before any job can (no credit is granted before it), so no forward sees the switch.
class PlannedExperts final : public offload::ExpertProvider {
 public:
  explicit PlannedExperts(const model::Model& model) : resident_(model.experts()) {}
  void use_pool(std::unique_ptr<offload::PoolClient> pool) { pool_ = std::move(pool); }
  offload::PoolClient* pool() const { return pool_.get(); }

  int layers() const override { return target().layers(); }
  int experts_per_layer() const override { return target().experts_per_layer(); }
  offload::ExpertWeights acquire(int layer, int expert) override {
    return target().acquire(layer, expert);
  }
  std::optional<offload::ExpertWeights> try_acquire(int layer, int expert) override {
    return target().try_acquire(layer, expert);
  }
  void release(int layer, int expert) override { target().release(layer, expert); }
  void expect(int layer, std::span<const int32_t> experts) override {
    target().expect(layer, experts);
  }
  void prefetch(int layer, std::span<const int32_t> experts) override {
    target().prefetch(layer, experts);
  }
  int prefetch_depth() const override { return target().prefetch_depth(); }
  std::span<const std::byte> served_from() const override { return target().served_from(); }

 private:
  offload::ExpertProvider& target() const {
    return pool_ ? static_cast<offload::ExpertProvider&>(*pool_) : resident_;
  }
  mutable offload::ResidentExpertProvider resident_;
  std::unique_ptr<offload::PoolClient> pool_;
};

class ComputeWorker {
 public:
  // Loads the model and starts HTTP.
  ComputeWorker(const runtime::Config& config, const char* stage, wire::StageKind kind);
  // Writes the expert trace (--expert-trace), if one was recorded.
  ~ComputeWorker();
  // The forward pass on --device, with a KV cache of `kv_blocks`. Throws ConfigError for a
  // malformed --device-expert-budget, std::runtime_error when the device cannot be used (no CUDA
  // in this build, no GPU, no such ordinal): the process exits with the reason.
  void create_engine(int32_t kv_blocks);

  // Keeps the link alive: hellos (again after a hub restart), the expert plan, usage reports.
  // False when this process must exit: the hub refused it, or the expert pool's owner is gone (a
  // restarted offload manager makes a new pool; a restarted process attaches to it). Why:
  // exit_reason().
  bool maintain();
  std::string exit_reason() const;
  // Consumes link-level messages of the compute stages (ExpertPlan: then grants `free_credits`,
  // the capacity free right now); true if it did.
  bool handle(const wire::Message& message, uint32_t free_credits);
  bool ready() const { return plan_received_ && link->accepted(); }
  // Binds this process's intake (decode: hand-overs from prefill) and announces it in the hello;
  // call before the first hello.
  void open_intake(const runtime::Config& config);

  runtime::StageService service;
  zmq::context_t context{1};
  std::unique_ptr<model::Model> model;
  std::unique_ptr<kernels::ThreadPool> pool;
  std::unique_ptr<PlannedExperts> experts;
  // --expert-trace: records what the engine acquires through `experts`; written at exit.
  std::unique_ptr<offload::TraceRecorder> trace;
  std::string trace_path;
  // The forward pass the stage drives: `engine` on the CPU, or the CUDA engine (--device cuda),
  // whose KV cache lives on the device. KV enters and leaves through forward->import_kv/export_kv.
  model::ForwardPass* forward = nullptr;
  std::unique_ptr<model::KvCache> cache;  // the CPU engine's
  std::unique_ptr<model::Engine> engine;  // null on a GPU: what only the CPU engine does (blended
                                          // prefill) is then refused
  std::unique_ptr<model::ForwardPass> device_engine;
  std::string device = "cpu";
  std::unique_ptr<ExpertUsageCounter> usage;
  // The engine's observers: usage first; a stage may add its own.
  model::RouterFanout observers;
  std::unique_ptr<runtime::HubLink> link;
  // Bulk data to other stages' intakes (prefill: KV to decode, puts to the probe).
  std::unique_ptr<runtime::PeerSender> peers;
  std::unique_ptr<runtime::ZapHandler> zap;  // with Curve and an intake; outlives the intake
  std::unique_ptr<runtime::Intake> intake;   // null unless open_intake()

 private:
  runtime::LinkSettings link_settings_;
  std::string device_expert_budget_;
  int device_ordinal_ = 0;
  // --device cuda: moves the GPU engine's expert-cache counters into the metrics (each second).
  std::function<void()> report_device_;
  std::chrono::steady_clock::time_point last_device_report_;
  bool plan_received_ = false;
  // Where usage reports go when the plan names the offload manager's intake (1.8; else the hub).
  struct UsageRoute {
    runtime::PeerAddress to;
    std::vector<uint8_t> ticket;
  };
  std::optional<UsageRoute> usage_route_;
  void report_usage();
  // What /healthz reports (its HTTP thread reads these; the loop writes them).
  std::atomic<bool> health_hub_accepted_{false}, health_plan_received_{false};
  std::string pool_lost_;
  bool plan_requested_ = false;
  std::chrono::steady_clock::time_point plan_requested_at_, last_usage_report_, last_pool_check_;
};

}  // namespace moeline::stages
