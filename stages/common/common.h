#pragma once
// What the stage processes share beyond the runtime: converting sampling parameters between the
// wire and the engine, the settings hash peers must agree on, and the keys every stage accepts.

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "model/config.h"
#include "model/model.h"
#include "model/sampling.h"
#include "reuse/signature.h"
#include "schemas/wire.h"
#include "stages/runtime/config.h"
#include "stages/runtime/intake.h"
#include "stages/runtime/link.h"

namespace moeline::stages {

model::SamplingParams from_wire(const wire::SamplingParams* sampling);
flatbuffers::Offset<wire::SamplingParams> to_wire(flatbuffers::FlatBufferBuilder& builder,
                                                  const model::SamplingParams& sampling);

// The KvLayout of `blocks` KV blocks of this model's cache (model::KvCache's block layout), and
// whether a received one describes exactly that.
// The chosen token's log-probabilities for the wire where the request asked for them (`sampling`
// logprobs, top_logprobs), else 0 (the field left out).
flatbuffers::Offset<wire::TokenLogprobs> logprobs_to_wire(flatbuffers::FlatBufferBuilder& builder,
                                                          const float* logits, int64_t vocab,
                                                          int32_t token,
                                                          const model::SamplingParams& sampling);
// Log-probabilities already computed, for the wire (the prompt's, prompt_logprobs).
flatbuffers::Offset<wire::TokenLogprobs> logprobs_to_wire(flatbuffers::FlatBufferBuilder& builder,
                                                          const model::TokenLogprobs& logprobs);
// `from` rebuilt in `builder` (0 for null): forwarding a stage's log-probabilities to a client.
flatbuffers::Offset<wire::TokenLogprobs> copy_logprobs(flatbuffers::FlatBufferBuilder& builder,
                                                       const wire::TokenLogprobs* from);

flatbuffers::Offset<wire::KvLayout> kv_layout(flatbuffers::FlatBufferBuilder& builder,
                                              const model::ModelConfig& config, size_t blocks);
bool kv_layout_matches(const wire::KvLayout* layout, const model::ModelConfig& config,
                       size_t blocks);

// Hash of what every process of a stack must agree on: the model (its id covers config.json and
// the tensor headers), the KV block size, the KV dtype and the arithmetic of the kernels (the
// modes configure_arithmetic sets and kernels::kArithmeticRevision: prefill and decode of one
// sequence must compute alike, or exact reuse would join KV of two arithmetics).
uint64_t settings_hash(uint64_t model_id);

// The model's part of every reuse key (block chains, prompt keys): the settings hash, so that
// activations a persisted store kept from another --quant-math, --bf16-math or kernel revision
// are never found, rather than joined to this arithmetic's.
inline uint64_t reuse_model_key(uint64_t model_id) {
  return settings_hash(model_id);
}

// Keys of every stage (model, http, port-file, replica, heartbeat-ms, peer-timeout-ms,
// watchdog-ms) and of every worker stage (hub).
std::vector<runtime::ConfigKey> common_keys(const char* default_http = "127.0.0.1:0");
std::vector<runtime::ConfigKey> worker_keys();
// A compute stage's (prefill, decode): worker_keys and the expert trace.
std::vector<runtime::ConfigKey> compute_keys();
// --replica, or "<stage>-<host>-<pid>".
std::string replica_name(const runtime::Config& config, const char* stage);
// The link settings of a worker stage from its config (hub, heartbeats, timeouts).
// With --curve-dir, the link runs Curve with the role's key; a tcp:// hub without one is logged
// as open.
runtime::LinkSettings link_settings(const runtime::Config& config, wire::StageKind stage,
                                    const std::string& replica, const model::Model& model,
                                    uint16_t http_port);
// The keys of a stage with an intake (decode, probe): --intake-bind, --intake-advertise.
std::vector<runtime::ConfigKey> intake_keys();
// --shm-handover, --shm-handover-min-bytes and -arena-bytes (part of intake_keys()).
runtime::SharedBulkSettings shared_bulk_settings(const runtime::Config& config);
// The intake of a stage (see stages/runtime/intake.h), bound next to the link's hub with the
// link's Curve keys; `zap` is the process's ZAP handler (needed with Curve).
std::unique_ptr<runtime::Intake> open_intake(zmq::context_t& context, const runtime::Config& config,
                                             const runtime::LinkSettings& link,
                                             const std::string& stage, runtime::Logger& log,
                                             runtime::Registry& metrics, runtime::ZapHandler* zap);
// The key file a stage kind uses in a key directory: probe, prefill, decode, offload.
std::string curve_role(wire::StageKind stage);
// --io-threads: ZeroMQ's I/O threads for this process's context (Curve encrypts and decrypts in
// them, so a process that relays bulk data under Curve gains from two). Call before the context's
// first socket.
void configure_io_threads(zmq::context_t& context, const runtime::Config& config);
// --quant-math and --bf16-math (exact|fast): how a process multiplies block-quantized and BF16
// weights. Keys of every process that joins or runs a hub (part of settings_hash).
std::vector<runtime::ConfigKey> arithmetic_keys();
// Sets the kernels' arithmetic from those keys (a ConfigError for anything else); run_stage calls
// it for every stage that has them.
void configure_arithmetic(const runtime::Config& config);
// The same keys as arguments for a stage process this one starts.
std::vector<std::string> arithmetic_arguments(const runtime::Config& config);
// The largest message stages exchange for this model (ZMQ_MAXMSGSIZE of the hub and links).
size_t max_stage_message_bytes(const model::ModelConfig& config);
// Activation signatures (approximate reuse): the probe computes them for lookups and prefill for
// what it stores, so both take the same keys (--signature-layers, --signature-dimension) and must
// be given the same values.
std::vector<runtime::ConfigKey> signature_keys();
reuse::SignatureOptions signature_options(const runtime::Config& config);

// A compute stage's drain. SIGTERM begins it: the hub is told (no more jobs), the stage finishes
// what it holds for up to --drain-grace-ms, hands back the rest (JobFailed Draining: the gateway
// retries each elsewhere) and exits.
class Drain {
 public:
  explicit Drain(const runtime::Config& config);
  // True while draining; begins the drain on the first call after SIGTERM.
  bool active(runtime::HubLink& link, runtime::Logger& log);
  bool expired() const;
  // True five seconds past the grace period: time to leave even if work keeps arriving (it is
  // handed back as it comes, but a peer that keeps sending must not keep the stage alive).
  bool overdue() const;
  // True once the stage has held nothing (`empty`) for half a second in a row.
  bool idle(bool empty);

 private:
  std::chrono::milliseconds grace_;
  std::optional<std::chrono::steady_clock::time_point> empty_since_;
  std::optional<std::chrono::steady_clock::time_point> until_;
};
// Tells the gateway a job failed (JobFailed with `code` and `text`).
void send_job_failed(runtime::HubLink& link, uint64_t request_id, uint32_t attempt,
                     wire::ErrorCode code, const std::string& text);
// Gives a job back to the gateway, which sends it to another replica.
void hand_back(runtime::HubLink& link, uint64_t request_id, uint32_t attempt);

// The model folder a stage uses when --model is not given.
std::string default_model_dir();
// A model's name for labels and titles: its folder's name, or a GGUF file's stem.
std::string model_name(const std::string& path);

// Runs a stage's main under the shared error handling: a ConfigError prints the usage and exits
// 2; any other exception logs and exits 1.
int run_stage(const char* stage, const std::vector<runtime::ConfigKey>& keys, int argc, char** argv,
              int (*body)(const runtime::Config&));

}  // namespace moeline::stages
