#include "stages/common/common.h"

#include <algorithm>
#include <filesystem>

#include <xxhash.h>

#include <cstdlib>
#include <iostream>

#include "base/environment.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/kernel_report.h"
#include "kernels/cpu/quant_matmul.h"
#include "model/kv_cache.h"
#include "stages/runtime/service.h"
#include "stages/runtime/trace.h"

namespace moeline::stages {

model::SamplingParams from_wire(const wire::SamplingParams* sampling) {
  model::SamplingParams params;
  if (sampling == nullptr) return params;
  params.temperature = sampling->temperature();
  params.top_k = sampling->top_k();
  params.top_p = sampling->top_p();
  if (sampling->has_seed()) params.seed = sampling->seed();
  params.max_tokens = sampling->max_tokens();
  if (sampling->stop_token_ids())
    params.stop_token_ids.assign(sampling->stop_token_ids()->begin(),
                                 sampling->stop_token_ids()->end());
  params.ignore_eos = sampling->ignore_eos();
  params.min_tokens = sampling->min_tokens();
  params.min_p = sampling->min_p();
  params.presence_penalty = sampling->presence_penalty();
  params.frequency_penalty = sampling->frequency_penalty();
  params.repetition_penalty = sampling->repetition_penalty();
  params.logprobs = sampling->logprobs();
  params.top_logprobs = sampling->top_logprobs();
  params.prompt_logprobs = sampling->prompt_logprobs();
  if (const auto* bias = sampling->logit_bias())
    for (const wire::TokenBias* entry : *bias)
      params.logit_bias.push_back({entry->token(), entry->bias()});
  // An unknown kind stays as sent, for validate() to refuse by number.
  params.structured = static_cast<model::StructuredOutput>(sampling->structured());
  if (sampling->json_schema()) params.json_schema = sampling->json_schema()->str();
  params.reasoning = static_cast<model::ReasoningBlock>(sampling->reasoning());
  return params;
}

flatbuffers::Offset<wire::SamplingParams> to_wire(flatbuffers::FlatBufferBuilder& builder,
                                                  const model::SamplingParams& sampling) {
  auto stops = builder.CreateVector(sampling.stop_token_ids);
  flatbuffers::Offset<flatbuffers::Vector<const wire::TokenBias*>> bias = 0;
  if (!sampling.logit_bias.empty()) {
    std::vector<wire::TokenBias> entries;
    for (const model::TokenBias& entry : sampling.logit_bias)
      entries.emplace_back(entry.token, entry.bias);
    bias = builder.CreateVectorOfStructs(entries);
  }
  auto schema = sampling.json_schema.empty() ? 0 : builder.CreateString(sampling.json_schema);
  return wire::CreateSamplingParams(
      builder, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed.value_or(0),
      sampling.seed.has_value(), sampling.max_tokens, stops, sampling.ignore_eos, sampling.min_p,
      sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
      sampling.logprobs, static_cast<int32_t>(sampling.top_logprobs), bias,
      sampling.prompt_logprobs, static_cast<wire::StructuredOutput>(sampling.structured), schema,
      static_cast<wire::ReasoningBlock>(sampling.reasoning), sampling.min_tokens);
}

flatbuffers::Offset<wire::TokenLogprobs> logprobs_to_wire(flatbuffers::FlatBufferBuilder& builder,
                                                          const float* logits, int64_t vocab,
                                                          int32_t token,
                                                          const model::SamplingParams& sampling) {
  if (!sampling.logprobs) return 0;
  return logprobs_to_wire(builder,
                          model::token_logprobs(logits, vocab, token, sampling.top_logprobs));
}

flatbuffers::Offset<wire::TokenLogprobs> logprobs_to_wire(flatbuffers::FlatBufferBuilder& builder,
                                                          const model::TokenLogprobs& lp) {
  auto ids = lp.top_ids.empty() ? 0 : builder.CreateVector(lp.top_ids);
  auto values = lp.top_logprobs.empty() ? 0 : builder.CreateVector(lp.top_logprobs);
  return wire::CreateTokenLogprobs(builder, lp.logprob, ids, values);
}

flatbuffers::Offset<wire::TokenLogprobs> copy_logprobs(flatbuffers::FlatBufferBuilder& builder,
                                                       const wire::TokenLogprobs* from) {
  if (from == nullptr) return 0;
  flatbuffers::Offset<flatbuffers::Vector<int32_t>> ids = 0;
  flatbuffers::Offset<flatbuffers::Vector<float>> values = 0;
  // The two lists pair up: a sender's mismatched or overlong lists are cut.
  const size_t pairs =
      from->top_ids() && from->top_logprobs()
          ? std::min<size_t>({from->top_ids()->size(), from->top_logprobs()->size(),
                              static_cast<size_t>(model::kMaxTopLogprobs)})
          : 0;
  if (pairs > 0) {
    ids = builder.CreateVector(from->top_ids()->data(), pairs);
    values = builder.CreateVector(from->top_logprobs()->data(), pairs);
  }
  return wire::CreateTokenLogprobs(builder, from->logprob(), ids, values);
}

flatbuffers::Offset<wire::KvLayout> kv_layout(flatbuffers::FlatBufferBuilder& builder,
                                              const model::ModelConfig& config, size_t blocks) {
  const model::KvShape shape = model::kv_shape(config);
  return wire::CreateKvLayout(
      builder, static_cast<uint32_t>(config.num_layers), static_cast<uint32_t>(shape.kv_heads),
      static_cast<uint32_t>(shape.key_dim), static_cast<uint32_t>(model::kBlockTokens),
      builder.CreateString("f32"), static_cast<uint32_t>(blocks), shape.value_dim > 0);
}

bool kv_layout_matches(const wire::KvLayout* layout, const model::ModelConfig& config,
                       size_t blocks) {
  const model::KvShape shape = model::kv_shape(config);
  return layout != nullptr && layout->layers() == config.num_layers &&
         layout->kv_heads() == shape.kv_heads && layout->head_dim() == shape.key_dim &&
         layout->values() == (shape.value_dim > 0) &&
         (!layout->values() || shape.value_dim == shape.key_dim) &&
         layout->block_tokens() == model::kBlockTokens && layout->blocks() == blocks &&
         layout->dtype() != nullptr && layout->dtype()->str() == "f32";
}

uint64_t settings_hash(uint64_t model_id) {
  const uint64_t parts[6] = {model_id,
                             static_cast<uint64_t>(model::kBlockTokens),
                             sizeof(float),
                             static_cast<uint64_t>(kernels::quant_math()),
                             static_cast<uint64_t>(kernels::bf16_math()),
                             kernels::kArithmeticRevision};
  return XXH3_64bits(parts, sizeof parts);
}

std::string replica_name(const runtime::Config& config, const char* stage) {
  return config.text("replica").empty() ? runtime::default_replica_name(stage)
                                        : config.text("replica");
}

void configure_io_threads(zmq::context_t& context, const runtime::Config& config) {
  const int64_t threads = config.integer("io-threads");
  if (threads < 1 || threads > 16)
    throw runtime::ConfigError("--io-threads " + std::to_string(threads) + ": expected 1 to 16");
  context.set(zmq::ctxopt::io_threads, static_cast<int>(threads));
}

std::vector<runtime::ConfigKey> arithmetic_keys() {
  return {{"quant-math", "fast",
           "quantized (GGUF) weights: fast (8-bit activations, integer dot products) or exact "
           "(weights dequantized to F32, F32 activations); every stage of a stack the same"},
          {"bf16-math", "exact",
           "BF16 weights: exact (widened to F32, F32 activations) or fast (activations rounded "
           "to BF16, the CPU's BF16 dot products: AVX512_BF16, else exact); every stage of a "
           "stack the same"}};
}

void configure_arithmetic(const runtime::Config& config) {
  kernels::QuantMath quant;
  if (!kernels::parse_quant_math(config.text("quant-math").c_str(), quant))
    throw runtime::ConfigError("--quant-math must be exact or fast, not '" +
                               config.text("quant-math") + "'");
  kernels::Bf16Math bf16;
  if (!kernels::parse_bf16_math(config.text("bf16-math").c_str(), bf16))
    throw runtime::ConfigError("--bf16-math must be exact or fast, not '" +
                               config.text("bf16-math") + "'");
  kernels::set_quant_math(quant);
  kernels::set_bf16_math(bf16);
}

std::vector<std::string> arithmetic_arguments(const runtime::Config& config) {
  return {"--quant-math", config.text("quant-math"), "--bf16-math", config.text("bf16-math")};
}

size_t max_stage_message_bytes(const model::ModelConfig& config) {
  // The largest message stages exchange carries a whole context's KV (a hand-over, a prefix plan)
  // or a prompt's logits and partial block (a snapshot put), plus its tokens: twice that bounds
  // it with room to spare. A frame past the bound is dropped by ZeroMQ before it is buffered.
  const model::KvShape shape = model::kv_shape(config);
  const uint64_t context = static_cast<uint64_t>(
      config.max_position_embeddings > 0 ? config.max_position_embeddings : 32768);
  const uint64_t kv_token = static_cast<uint64_t>(config.num_layers) *
                            static_cast<uint64_t>(shape.kv_heads) *
                            static_cast<uint64_t>(shape.key_dim + shape.value_dim) * sizeof(float);
  const uint64_t bytes = 2 * (context * (kv_token + 2 * sizeof(int32_t)) +
                              static_cast<uint64_t>(config.vocab_size) * sizeof(float)) +
                         (uint64_t{16} << 20);
  return static_cast<size_t>(std::min<uint64_t>(bytes, uint64_t{1} << 40));
}

runtime::LinkSettings link_settings(const runtime::Config& config, wire::StageKind stage,
                                    const std::string& replica, const model::Model& model,
                                    uint16_t http_port) {
  runtime::LinkSettings settings;
  settings.hub = config.text("hub");
  settings.stage = stage;
  settings.replica = replica;
  settings.settings_hash = settings_hash(model.model_id());
  settings.heartbeat_ms = static_cast<int>(config.integer("heartbeat-ms"));
  settings.peer_timeout_ms = static_cast<int>(config.integer("peer-timeout-ms"));
  settings.http_port = http_port;
  settings.max_message_bytes = max_stage_message_bytes(model.config());
  const runtime::CurveSettings curve =
      runtime::load_curve_settings(config.text("curve-dir"), curve_role(stage));
  if (curve.enabled()) {
    settings.curve_keys = curve.own.keys;
    settings.curve_server_key = curve.server_public_key;
  }
  return settings;
}

std::vector<runtime::ConfigKey> intake_keys() {
  return {{"intake-bind", "auto",
           "where peers send this stage bulk data directly (auto: a socket file next to an ipc:// "
           "hub; a free port on the address that reaches a tcp:// hub)"},
          {"intake-advertise", "",
           "the intake endpoint peers are told (default: the bound one; set it behind NAT or "
           "port mapping)"},
          {"shm-handover", "auto",
           "bulk data to and from peers of this node through shared memory instead of the socket "
           "(auto: /dev/shm/moeline-<uid>; off; or a folder; peers use it only when they share "
           "it)"},
          {"shm-handover-min-bytes", "4096",
           "transfers with fewer bulk bytes cross the socket (cheaper for a few pages)"},
          {"shm-handover-arena-bytes", "268435456",
           "this process's shared-memory arena for transfers it sends (address space; pages stay "
           "once the transfers in flight at once have touched them); larger ones cross the "
           "socket"}};
}

runtime::SharedBulkSettings shared_bulk_settings(const runtime::Config& config) {
  return runtime::shared_bulk_settings(config.text("shm-handover"),
                                       config.integer("shm-handover-min-bytes"),
                                       config.integer("shm-handover-arena-bytes"));
}

std::unique_ptr<runtime::Intake> open_intake(zmq::context_t& context, const runtime::Config& config,
                                             const runtime::LinkSettings& link,
                                             const std::string& stage, runtime::Logger& log,
                                             runtime::Registry& metrics, runtime::ZapHandler* zap) {
  runtime::IntakeSettings settings;
  settings.bind = config.text("intake-bind");
  settings.advertise = config.text("intake-advertise");
  settings.hub = link.hub;
  settings.stage = stage;
  settings.replica = link.replica;
  settings.max_message_bytes = link.max_message_bytes;
  settings.curve_keys = link.curve_keys;
  settings.shared_bulk = shared_bulk_settings(config);
  return std::make_unique<runtime::Intake>(context, settings, log, metrics, zap);
}

std::string curve_role(wire::StageKind stage) {
  return stage == wire::StageKind::OffloadManager ? "offload" : wire::stage_name(stage);
}

Drain::Drain(const runtime::Config& config)
    : grace_(std::max<int64_t>(0, config.integer("drain-grace-ms"))) {
  runtime::StageService::set_drains(true);
}

bool Drain::active(runtime::HubLink& link, runtime::Logger& log) {
  if (until_) return true;
  if (!runtime::StageService::drain_requested()) return false;
  until_ = std::chrono::steady_clock::now() + grace_;
  link.drain();
  log.info("drain_started", {{"grace_ms", grace_.count()}});
  return true;
}

bool Drain::idle(bool empty) {
  const auto now = std::chrono::steady_clock::now();
  if (!empty) {
    empty_since_.reset();
    return false;
  }
  if (!empty_since_) empty_since_ = now;
  return now - *empty_since_ >= std::chrono::milliseconds(500);
}

bool Drain::expired() const {
  return until_ && std::chrono::steady_clock::now() >= *until_;
}

bool Drain::overdue() const {
  return until_ && std::chrono::steady_clock::now() >= *until_ + std::chrono::seconds(5);
}

void send_job_failed(runtime::HubLink& link, uint64_t request_id, uint32_t attempt,
                     wire::ErrorCode code, const std::string& text) {
  flatbuffers::FlatBufferBuilder builder(128 + text.size());
  builder.Finish(
      wire::CreateJobFailed(builder, request_id, attempt, code, builder.CreateString(text)),
      wire::PrefillJobIdentifier());
  link.send(wire::encode(wire::MessageType::JobFailed, builder));
}

void hand_back(runtime::HubLink& link, uint64_t request_id, uint32_t attempt) {
  send_job_failed(link, request_id, attempt, wire::ErrorCode::Draining, "the replica is draining");
}

std::string model_name(const std::string& path) {
  const std::filesystem::path model(path);
  const std::filesystem::path named = model.has_filename() ? model : model.parent_path();
  return named.extension() == ".gguf" ? named.stem().string() : named.filename().string();
}

std::string default_model_dir() {
  if (const char* env = env::get(env::kModel); env != nullptr && *env != '\0') return env;
  return MOELINE_DEFAULT_MODEL;
}

std::vector<runtime::ConfigKey> common_keys(const char* default_http) {
  return {
      {"model", default_model_dir(),
       "checkpoint folder (config.json, safetensors, tokenizer.json) or GGUF file"},
      {"http", default_http, "HOST:PORT for /metrics and /healthz (port 0: any free port)"},
      {"port-file", "", "write the HTTP port chosen here to this file"},
      {"replica", "", "name of this process in logs and metrics (default: stage-host-pid)"},
      {"heartbeat-ms", "500", "heartbeat interval"},
      {"peer-timeout-ms", "3000", "a peer silent this long is considered dead"},
      {"watchdog-ms", "30000", "/healthz fails when the stage loop stalls this long"},
      {"drain-grace-ms", "30000",
       "on SIGTERM: stop taking work, finish what is held for up to this long, hand back the "
       "rest, exit (prefill, decode, gateway; a second SIGTERM stops at once)"},
      {"io-threads", "1",
       "ZeroMQ I/O threads (CurveZMQ encrypts in them: 2 helps a gateway relaying KV under Curve "
       "when a core is free)"},
      {"log-level", "info", "the least severe log lines written: info, warn or error"},
      {"log-format", "logfmt",
       "logfmt (key=value, one line per event) or json (one object per line)"},
      {"trace-requests", "false",
       "log every message of a request this stage receives (event=trace, with its time in "
       "microseconds): one request's path, read across the stages' logs"},
      {"curve-dir", "",
       "key directory (moeline keys init): tcp:// sockets run CurveZMQ with this process's key "
       "(gateway.key, or <role>.key and gateway.pub); empty: open, for ipc:// stacks"},
  };
}

std::vector<runtime::ConfigKey> signature_keys() {
  return {{"signature-layers", "1",
           "activation signatures pool the first k MoE layers' routers (1: the probe costs 2-5% "
           "of a prefill, see docs/PERFORMANCE.md)"},
          {"signature-dimension", "256", "signatures are projected to this when larger"}};
}

reuse::SignatureOptions signature_options(const runtime::Config& config) {
  reuse::SignatureOptions options;
  options.layers = static_cast<int>(config.integer("signature-layers"));
  options.dimension = static_cast<int>(config.integer("signature-dimension"));
  if (options.layers < 1 || options.dimension < 1)
    throw runtime::ConfigError("--signature-layers and --signature-dimension must be >= 1");
  return options;
}

std::vector<runtime::ConfigKey> worker_keys() {
  std::vector<runtime::ConfigKey> keys = common_keys();
  keys.push_back({"hub", "tcp://127.0.0.1:5556", "the gateway's hub endpoint to connect to"});
  keys.push_back({"threads", "0", "compute threads (0: all cores)"});
  for (runtime::ConfigKey& key : arithmetic_keys()) keys.push_back(std::move(key));
  return keys;
}

std::vector<runtime::ConfigKey> compute_keys() {
  std::vector<runtime::ConfigKey> keys = worker_keys();
  keys.push_back({"expert-trace", "",
                  "record this process's expert acquisitions to FILE, written at exit "
                  "(moeline experts replay); {replica} in FILE becomes the replica's name"});
  keys.push_back({"expert-trace-limit", "10000000", "acquisitions recorded at most"});
  keys.push_back({"device", "cpu",
                  "where the forward pass runs: cpu, or cuda / cuda:N (a build with nvcc and a "
                  "GPU; KV and the experts that fit --device-expert-budget live on the device)"});
  keys.push_back({"device-expert-budget", "",
                  "with --device cuda: expert bytes kept on the GPU, a share (\"50%\") or a size "
                  "(\"8GiB\"); the rest is copied in from the node's host pool on demand. "
                  "Default: every expert"});
  return keys;
}

int run_stage(const char* stage, const std::vector<runtime::ConfigKey>& keys, int argc, char** argv,
              int (*body)(const runtime::Config&)) {
  try {
    runtime::Config config = runtime::Config::load(stage, keys, argc, argv);
    if (config.help_requested()) {
      std::cout << runtime::Config::usage(stage, keys);
      return 0;
    }
    // Stages take --trace-requests; tools run through here without it.
    auto has = [&keys](const char* name) {
      return std::any_of(keys.begin(), keys.end(),
                         [name](const runtime::ConfigKey& key) { return key.name == name; });
    };
    if (has("trace-requests")) runtime::set_request_tracing(config.flag("trace-requests"));
    if (has("bf16-math")) configure_arithmetic(config);
    // Every metric of the stage carries its model.
    if (has("model") && !config.text("model").empty())
      runtime::Registry::set_process_labels({{"model", model_name(config.text("model"))}});
    if (has("log-level")) {
      try {
        runtime::set_log_options(runtime::parse_log_level(config.text("log-level")),
                                 runtime::parse_log_format(config.text("log-format")));
      } catch (const std::invalid_argument& e) {
        throw runtime::ConfigError(std::string("--log-level/--log-format: ") + e.what());
      }
      // The effective configuration, once: every setting, and where those not at their default
      // came from.
      std::vector<std::pair<std::string, std::string>> fields;
      std::string sources;
      for (const runtime::ConfigKey& key : keys) {
        if (key.name != "replica")  // the line's own replica= is the name it resolves to
          fields.emplace_back(key.name, config.text(key.name));
        if (config.source(key.name) != "default")
          sources += (sources.empty() ? "" : ",") + key.name + ":" + config.source(key.name);
      }
      fields.emplace_back("set_by", sources);
      runtime::Logger(stage, replica_name(config, stage)).info("config_effective", fields);
    }
    return body(config);
  } catch (const runtime::ConfigError& e) {
    std::cerr << runtime::Config::usage(stage, keys) << "moeline: error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moeline: error: " << stage << ": " << e.what() << '\n';
    return 1;
  }
}

}  // namespace moeline::stages
