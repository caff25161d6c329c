#include "stages/probe/probe.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "model/generator.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/sampling.h"
#include "reuse/records.h"
#include "reuse/snapshot_store.h"
#include "stages/common/common.h"
#include "stages/runtime/link.h"
#include "stages/runtime/service.h"

namespace moeline::stages {
namespace {

using Clock = std::chrono::steady_clock;

class Probe {
 public:
  explicit Probe(const runtime::Config& config)
      : service_("probe", replica_name(config, "probe")), metrics_(service_.metrics) {
    runtime::StageService::install_signal_handlers();
    service_.set_watchdog_limit(std::chrono::milliseconds(config.integer("watchdog-ms")));
    auto loaded = model::Model::load(config.text("model"));
    if (!loaded) throw std::runtime_error(loaded.error().message);
    model_ = std::move(*loaded);
    const model::ModelConfig& cfg = model_->config();
    block_bytes_ = model::KvCache::bytes_per_token(cfg) * model::kBlockTokens;
    for (int64_t eos : cfg.eos_token_ids) eos_.push_back(static_cast<int32_t>(eos));

    reuse::StoreOptions options;
    options.ram_bytes = runtime::parse_bytes(config.text("store-ram-bytes"));
    options.disk_bytes = runtime::parse_bytes(config.text("store-disk-bytes"));
    options.disk_path = config.text("store-path");
    const std::string policy = config.text("store-policy");
    if (policy != "slru" && policy != "lru")
      throw runtime::ConfigError("--store-policy must be slru or lru, got '" + policy + "'");
    options.policy =
        policy == "lru" ? reuse::EvictionPolicy::kLru : reuse::EvictionPolicy::kSegmentedLru;
    store_ = std::make_unique<reuse::SnapshotStore>(options);
    service_.log.info("store_opened",
                      {{"ram_bytes", options.ram_bytes},
                       {"disk_bytes", options.disk_bytes},
                       {"disk_path", options.disk_path.empty() ? "(none)" : options.disk_path},
                       {"disk_entries", store_->stats().disk_entries},
                       {"policy", policy}});

    service_.start_http(config.text("http"), config.text("port-file"));
    register_metrics();
    credits_ = static_cast<uint32_t>(config.integer("queue"));
    runtime::LinkSettings settings =
        link_settings(config, wire::StageKind::Probe, service_.log.replica(), model_->model_id(),
                      service_.http_port());
    link_ = std::make_unique<runtime::HubLink>(context_, settings, service_.log, metrics_);
  }

  int run() {
    while (!runtime::StageService::stop_requested()) {
      service_.tick();
      if (link_->rejected()) return 3;
      if (link_->needs_hello()) link_->hello(credits_);
      service_.set_ready(link_->accepted());
      uint32_t handled = 0;
      for (auto message = link_->receive(50); message; message = link_->receive(0)) {
        dispatch(*message);
        ++handled;
      }
      if (handled) batch_->observe(handled);
      update_gauges();
    }
    store_->flush();
    service_.log.info("stopped", {{"disk_entries", store_->stats().disk_entries}});
    return 0;
  }

 private:
  void register_metrics() {
    lookups_ = &metrics_.counter("moeline_probe_lookups_total", "Jobs looked up");
    lookup_tokens_ = &metrics_.counter("moeline_probe_lookup_tokens_total",
                                       "Prompt tokens of the jobs looked up");
    for (const char* level : {"none", "prefix", "full", "result"}) {
      hits_[level] = &metrics_.counter(
          "moeline_probe_hits_total", "Jobs by the reuse level that served them (request-weighted)",
          {{"level", level}});
      hit_tokens_[level] = &metrics_.counter(
          "moeline_probe_hit_tokens_total",
          "Prompt tokens reused, by level (token-weighted; none: tokens not reused)",
          {{"level", level}});
      outcomes_[level] = &metrics_.counter("moeline_probe_requests_total", "Jobs by outcome",
                                           {{"outcome", level}});
    }
    latency_ = &metrics_.histogram("moeline_probe_latency_seconds", "Lookup time per job",
                                   runtime::latency_buckets());
    batch_ = &metrics_.histogram("moeline_probe_batch_size", "Messages handled per loop iteration",
                                 runtime::size_buckets());
    queue_depth_ = &metrics_.gauge("moeline_probe_queue_depth", "Jobs waiting in this probe");
    puts_ = &metrics_.counter("moeline_probe_store_puts_total", "Entries put into the store");
    for (const char* tier : {"ram", "disk"}) {
      bytes_[tier] = &metrics_.gauge("moeline_probe_store_bytes", "Snapshot store bytes by tier",
                                     {{"tier", tier}});
      entries_[tier] = &metrics_.gauge("moeline_probe_store_entries",
                                       "Snapshot store entries by tier", {{"tier", tier}});
    }
    const std::vector<std::pair<const char*, const char*>> counters = {
        {"evictions", "Entries evicted from the RAM tier"},
        {"spills", "Entries written to the disk tier"},
        {"restores", "Entries read back from the disk tier"},
        {"disk_evictions", "Entries dropped from the disk tier (its budget)"},
        {"corrupt_entries", "Disk entries that failed their checksum (dropped, never served)"}};
    for (const auto& [name, help] : counters)
      store_counters_[name] = &metrics_.gauge(std::string("moeline_probe_store_") + name,
                                              std::string(help) + " (total)");
  }

  void update_gauges() {
    const reuse::StoreStats& s = store_->stats();
    bytes_["ram"]->set(static_cast<double>(s.ram_bytes));
    bytes_["disk"]->set(static_cast<double>(s.disk_bytes));
    entries_["ram"]->set(static_cast<double>(s.ram_entries));
    entries_["disk"]->set(static_cast<double>(s.disk_entries));
    store_counters_["evictions"]->set(static_cast<double>(s.evictions));
    store_counters_["spills"]->set(static_cast<double>(s.spills));
    store_counters_["restores"]->set(static_cast<double>(s.restores));
    store_counters_["disk_evictions"]->set(static_cast<double>(s.disk_evictions));
    store_counters_["corrupt_entries"]->set(static_cast<double>(s.corrupt));
    queue_depth_->set(0);
  }

  void dispatch(wire::Message& message) {
    switch (message.type) {
      case wire::MessageType::ProbeJob:
        return lookup(*message.as<wire::ProbeJob>());
      case wire::MessageType::SnapshotPut:
        return put(message);
      case wire::MessageType::CancelJob:
        return;  // a job is answered as soon as it arrives: nothing to cancel
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
      case wire::MessageType::ExpertPlanRequest:
      case wire::MessageType::ExpertPlan:
      case wire::MessageType::ExpertUsage:
      case wire::MessageType::ControlCommand:
      case wire::MessageType::ControlReply:
        service_.log.warn("unexpected_message", {{"type", wire::message_type_name(message.type)}});
        return;
    }
  }

  void put(const wire::Message& message) {
    const auto* put = message.as<wire::SnapshotPut>();
    if (auto bad = wire::check_bulk(put->frames(), message.bulk)) {
      service_.log.warn("snapshot_refused", {{"reason", *bad}});
      return;
    }
    const size_t entries = put->entries() ? put->entries()->size() : 0;
    if (entries != message.bulk.size()) {
      service_.log.warn("snapshot_refused", {{"reason", "entries and frames differ in number"}});
      return;
    }
    // Deepest first (entries come in chain order): the head of a chain ends up the most recent.
    for (size_t i = entries; i-- > 0;) {
      const auto* entry = put->entries()->Get(static_cast<flatbuffers::uoffset_t>(i));
      const auto bytes = message.bulk[i].bytes();
      // A block must be exactly one block of this model's KV.
      if (entry->kind() == 'B' && bytes.size() != block_bytes_) continue;
      store_->put(entry->key(),
                  std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
      puts_->inc();
    }
  }

  // The longest run of cached blocks from the start (values in order). The blocks are read
  // deepest first, so that the head of the chain is the most recently used: a chain is only
  // useful from its first block on, so its first blocks are the last ones to evict.
  std::vector<reuse::Value> cached_prefix(const std::vector<uint64_t>& chain, size_t limit) {
    size_t run = 0;
    while (run < chain.size() && run < limit && store_->contains(reuse::block_entry(chain[run])))
      ++run;
    std::vector<reuse::Value> blocks(run);
    for (size_t b = run; b-- > 0;) blocks[b] = store_->get(reuse::block_entry(chain[b]));
    // A record that failed its checksum on disk ends the run there.
    for (size_t b = 0; b < run; ++b) {
      if (!blocks[b] || blocks[b]->size() != block_bytes_) {
        blocks.resize(b);
        break;
      }
    }
    return blocks;
  }

  flatbuffers::Offset<wire::KvLayout> layout(flatbuffers::FlatBufferBuilder& builder,
                                             size_t blocks) const {
    const model::ModelConfig& cfg = model_->config();
    return wire::CreateKvLayout(
        builder, static_cast<uint32_t>(cfg.num_layers), static_cast<uint32_t>(cfg.num_kv_heads),
        static_cast<uint32_t>(cfg.head_dim), static_cast<uint32_t>(model::kBlockTokens),
        builder.CreateString("f32"), static_cast<uint32_t>(blocks));
  }

  // One bulk frame holding the blocks' KV in order, and its descriptor.
  static zmq::message_t concatenate(const std::vector<reuse::Value>& blocks, uint64_t& checksum) {
    size_t total = 0;
    for (const reuse::Value& block : blocks) total += block->size();
    zmq::message_t frame(total);
    auto* out = static_cast<uint8_t*>(frame.data());
    for (const reuse::Value& block : blocks) {
      std::copy(block->begin(), block->end(), reinterpret_cast<char*>(out));
      out += block->size();
    }
    checksum = wire::checksum({static_cast<const uint8_t*>(frame.data()), frame.size()});
    return frame;
  }

  void lookup(const wire::ProbeJob& job) {
    const auto start = Clock::now();
    std::vector<int32_t> tokens;
    if (job.tokens()) tokens.assign(job.tokens()->begin(), job.tokens()->end());
    const std::string name_space = job.cache_namespace() ? job.cache_namespace()->str() : "";
    const uint64_t ns = model::namespace_id(name_space);
    const uint64_t model_id = model_->model_id();
    const std::vector<uint64_t> chain = reuse::block_chain(tokens, model_id, ns);
    const uint64_t key = reuse::prompt_key(tokens, chain, model_id, ns);
    const uint32_t allowed = job.allowed_levels();
    const model::SamplingParams sampling = from_wire(job.sampling());
    lookups_->inc();
    lookup_tokens_->inc(static_cast<double>(tokens.size()));

    std::string level = "none";
    if (!tokens.empty() && (allowed & reuse::kResult)) {
      if (reuse::Value value = store_->get(reuse::result_entry(key, sampling))) {
        if (auto result = reuse::decode_result(*value); result && !result->tokens.empty()) {
          answer_result(job, tokens, *result);
          return done("result", tokens.size(), start);
        }
      }
    }
    if (!tokens.empty() && (allowed & reuse::kFull)) {
      if (reuse::Value value = store_->get(reuse::prompt_entry(key))) {
        auto prompt = reuse::decode_prompt(*value, static_cast<size_t>(model_->config().vocab_size),
                                           block_bytes_);
        std::vector<reuse::Value> blocks =
            prompt ? cached_prefix(chain, chain.size()) : std::vector<reuse::Value>{};
        if (prompt && blocks.size() == chain.size()) {
          answer_full(job, tokens, sampling, *prompt, std::move(blocks));
          return done("full", tokens.size(), start);
        }
      }
    }
    size_t reused_blocks = 0;
    std::vector<reuse::Value> blocks;
    if (allowed & reuse::kPrefix) {
      // Prefill must compute at least the last token (it samples from its logits).
      const size_t limit = tokens.empty() ? 0 : (tokens.size() - 1) / model::kBlockTokens;
      blocks = cached_prefix(chain, limit);
      reused_blocks = blocks.size();
      if (reused_blocks > 0) level = "prefix";
    }
    flatbuffers::FlatBufferBuilder builder(256);
    std::vector<zmq::message_t> bulk;
    flatbuffers::Offset<wire::KvLayout> kv_layout = 0;
    flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
    if (reused_blocks > 0) {
      uint64_t sum = 0;
      bulk.push_back(concatenate(blocks, sum));
      frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
          wire::CreateBulkFrame(builder, bulk.back().size(), sum)});
      kv_layout = layout(builder, reused_blocks);
    }
    const auto reused = static_cast<uint32_t>(reused_blocks * model::kBlockTokens);
    const auto took = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
    builder.Finish(
        wire::CreateProbePlan(builder, job.request_id(), job.attempt(), builder.CreateString(level),
                              reused, static_cast<uint32_t>(took.count()), frames, kv_layout, 0, 0,
                              reused_blocks > 0 ? chain[reused_blocks - 1] : 0),
        wire::PrefillJobIdentifier());
    link_->send(wire::encode(wire::MessageType::ProbePlan, builder, std::move(bulk)));
    done(level, reused, start, tokens.size());
  }

  void done(const std::string& level, size_t reused, Clock::time_point start,
            size_t prompt_tokens = 0) {
    link_->grant(1);
    hits_[level]->inc();
    outcomes_[level]->inc();
    hit_tokens_[level]->inc(static_cast<double>(level == "none" ? prompt_tokens : reused));
    if (level != "none" && prompt_tokens > reused)
      hit_tokens_["none"]->inc(static_cast<double>(prompt_tokens - reused));
    latency_->observe(std::chrono::duration<double>(Clock::now() - start).count());
  }

  void answer_result(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                     const reuse::ResultRecord& result) {
    flatbuffers::FlatBufferBuilder builder(256 + result.tokens.size() * 4);
    auto completion = builder.CreateVector(result.tokens);
    auto finish = builder.CreateString(result.finish_reason);
    builder.Finish(wire::CreateProbePlan(
                       builder, job.request_id(), job.attempt(), builder.CreateString("result"),
                       static_cast<uint32_t>(tokens.size()), 0, 0, 0, completion, finish, 0),
                   wire::PrefillJobIdentifier());
    link_->send(wire::encode(wire::MessageType::ProbePlan, builder));
  }

  // A full hit: what prefill would have answered, from the store.
  void answer_full(const wire::ProbeJob& job, const std::vector<int32_t>& tokens,
                   const model::SamplingParams& sampling, const reuse::PromptRecord& prompt,
                   std::vector<reuse::Value> blocks) {
    const model::ModelConfig& cfg = model_->config();
    model::Sampler sampler(sampling);
    const int32_t first = sampler.sample(prompt.logits.data(), cfg.vocab_size);
    const std::string finish = model::finish_after(first, 1, static_cast<int64_t>(tokens.size()),
                                                   sampling, eos_, cfg.max_position_embeddings);
    flatbuffers::FlatBufferBuilder builder(512 + tokens.size() * 4);
    std::vector<zmq::message_t> bulk;
    flatbuffers::Offset<wire::KvLayout> kv_layout = 0;
    flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::BulkFrame>>> frames = 0;
    if (finish.empty()) {
      if (!prompt.tail_kv.empty())
        blocks.push_back(std::make_shared<const std::string>(prompt.tail_kv));
      uint64_t sum = 0;
      bulk.push_back(concatenate(blocks, sum));
      frames = builder.CreateVector(std::vector<flatbuffers::Offset<wire::BulkFrame>>{
          wire::CreateBulkFrame(builder, bulk.back().size(), sum)});
      kv_layout = layout(builder, blocks.size());
    }
    auto token_vector = builder.CreateVector(tokens);
    auto finish_text = builder.CreateString(finish);
    auto sampling_offset = to_wire(builder, sampling);
    auto name_space =
        builder.CreateString(job.cache_namespace() ? job.cache_namespace()->str() : "");
    auto replica = builder.CreateString(service_.log.replica());
    auto level = builder.CreateString("full");
    builder.Finish(
        wire::CreatePrefillDone(builder, job.request_id(), job.attempt(), token_vector, first,
                                finish_text, sampling_offset, name_space, kv_layout, frames, 0,
                                replica, level, static_cast<uint32_t>(tokens.size())),
        wire::PrefillJobIdentifier());
    link_->send(wire::encode(wire::MessageType::PrefillDone, builder, std::move(bulk)));
  }

  runtime::StageService service_;
  runtime::Registry& metrics_;
  zmq::context_t context_{1};
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<reuse::SnapshotStore> store_;
  std::unique_ptr<runtime::HubLink> link_;
  size_t block_bytes_ = 0;
  std::vector<int32_t> eos_;
  uint32_t credits_ = 64;
  runtime::Counter *lookups_ = nullptr, *lookup_tokens_ = nullptr, *puts_ = nullptr;
  std::map<std::string, runtime::Counter*> hits_, hit_tokens_, outcomes_;
  std::map<std::string, runtime::Gauge*> bytes_, entries_, store_counters_;
  runtime::Histogram *latency_ = nullptr, *batch_ = nullptr;
  runtime::Gauge* queue_depth_ = nullptr;
};

std::vector<runtime::ConfigKey> probe_keys() {
  std::vector<runtime::ConfigKey> keys = worker_keys();
  keys.push_back({"queue", "64", "jobs this probe accepts at once (its credit)"});
  keys.push_back({"store-ram-bytes", "256MiB", "RAM tier budget of the snapshot store"});
  keys.push_back({"store-disk-bytes", "4GiB", "disk tier budget (RocksDB)"});
  keys.push_back({"store-path", "", "disk tier folder (empty: no disk tier)"});
  keys.push_back(
      {"store-policy", "slru", "RAM eviction: slru (segmented LRU, scan-resistant) or lru"});
  return keys;
}

int probe_body(const runtime::Config& config) {
  return Probe(config).run();
}

}  // namespace

int probe_main(int argc, char** argv) {
  return run_stage("probe", probe_keys(), argc, argv, probe_body);
}

}  // namespace moeline::stages
