#pragma once
// The gateway's client front: the client socket and what goes out on it (stream events, errors,
// control replies), and the validation of what comes in, tokenization included. A request that
// passes `RequestValidator::validate` is well-formed, authenticated, within every limit, and
// tokenized; the request tracker takes it from there.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>
#include <zmq.hpp>

#include "model/model_info.h"
#include "model/sampling.h"
#include "schemas/wire.h"
#include "stages/gateway/gateway_metrics.h"
#include "stages/gateway/request.h"
#include "stages/gateway/tenant_limits.h"
#include "stages/runtime/api_keys.h"
#include "stages/runtime/config.h"
#include "stages/runtime/log.h"
#include "stages/runtime/security.h"
#include "tokenizer/tokenizer.h"

namespace moeline::stages {

// Why the gateway refuses a client's message: the code the client sees, a reason for the
// metrics and logs (`moeline_gateway_rejected_total{reason}`), and the text.
struct Refusal {
  wire::ErrorCode code;
  std::string reason;
  std::string text;
};

// A request that passed validation.
struct ValidRequest {
  std::string tenant;  // the API key's tenant where keys are required; "default" when unnamed
  TenantLimits limits;
  std::vector<int32_t> prompt;
  model::SamplingParams sampling;  // max_tokens capped to what the context leaves
  uint32_t asked_levels = 0;       // what its reuse field opts into
  std::chrono::milliseconds deadline{0};
};

class RequestValidator {
 public:
  // Loads the tokenizer of --model; limits from --max-prompt-tokens, --max-prompt-bytes,
  // --tenants, --tenant-*, --default-deadline-ms, --max-deadline-ms, --api-keys.
  RequestValidator(const runtime::Config& config, const model::ModelInfo& model);

  std::variant<ValidRequest, Refusal> validate(const wire::GenerateRequest& request) const;
  // Where API keys are required, control commands need an operator's key. `key_id`: whose key
  // it was ("none" without one), for the log.
  std::optional<Refusal> authorize_operator(const wire::ControlCommand& command,
                                            std::string& key_id) const;
  // Reloads the API key file when it changed; the error when it could not.
  std::optional<std::string> reload_keys() { return api_keys_.reload_if_changed(); }

  const tokenizer::Tokenizer& tokenizer() const { return *tokenizer_; }
  bool keys_required() const { return api_keys_.required(); }
  size_t key_count() const { return api_keys_.size(); }
  int64_t max_prompt_tokens() const { return max_prompt_tokens_; }

 private:
  std::optional<Refusal> check_tenant(const wire::GenerateRequest& request, std::string& tenant,
                                      TenantLimits& limits) const;
  std::variant<std::vector<int32_t>, Refusal> prompt_of(const wire::GenerateRequest& request) const;

  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  runtime::ApiKeys api_keys_;
  std::vector<std::string> tenants_;
  TenantLimits tenant_limits_;
  int64_t vocab_ = 0, context_ = 0, max_prompt_tokens_ = 0;
  size_t max_prompt_bytes_ = 0;
  std::chrono::milliseconds default_deadline_{0}, max_deadline_{0};
};

// Where a stream event goes: the client's connection, its id for the request, the gateway's id
// (0 before there is one), and whether the request reads StreamEventBatch (schema 1.11).
struct EventTo {
  const std::string& client;
  uint64_t client_request_id = 0;
  uint64_t request_id = 0;
  bool batch = false;

  static EventTo of(const Request& r) {
    return {r.client, r.client_request_id, r.id, r.batch_events};
  }
};

// The client ROUTER and the messages the gateway sends on it. A send returns false when the
// client's connection is gone (ROUTER_MANDATORY reports it).
//
// Between hold_events() and flush_events() the events of requests that read StreamEventBatch wait,
// per connection, and leave as one message each: one decode step of eight streams on one
// connection is one message instead of eight, which under CurveZMQ is also one encryption (and one
// decryption in the client) instead of eight. Each request's events keep their order; a lone
// event leaves as a plain StreamEvent.
// What a Delta reports beside its tokens, where the request asked: the token's log-probabilities,
// and on the first, the prompt's (one per prompt token after the first) with the prompt's ids.
using PromptLogprobs = flatbuffers::Vector<flatbuffers::Offset<wire::TokenLogprobs>>;
struct TokenScores {
  const wire::TokenLogprobs* token = nullptr;
  const PromptLogprobs* prompt = nullptr;
  const std::vector<int32_t>* prompt_ids = nullptr;
};

class ClientChannel {
 public:
  // Binds --client-bind; with Curve, a Curve server that admits any client key (the channel is
  // encrypted and the gateway proven; API keys say who).
  ClientChannel(zmq::context_t& context, const runtime::Config& config,
                const runtime::CurveSettings& curve, runtime::ZapHandler* zap,
                size_t max_body_bytes, GatewayMetrics& metrics, runtime::Logger& log);

  zmq::socket_t& socket() { return socket_; }
  bool send(const std::string& client, std::vector<zmq::message_t>&& frames);
  // One StreamEvent; `done`: the finished request whose usage and timings it reports. While events
  // are held, true for a held one: whether its connection is still there shows at the flush.
  bool send_event(const EventTo& to, wire::EventKind kind, const std::string& text = {},
                  const std::vector<int32_t>& tokens = {},
                  wire::FinishReason finish = wire::FinishReason::None,
                  wire::ErrorCode code = wire::ErrorCode::None, const std::string& error = {},
                  const Request* done = nullptr, TokenScores scores = {});
  void reply_error(const std::string& client, wire::ErrorCode code, const std::string& text,
                   uint64_t client_request_id = 0);
  void reply_control(const std::string& client, bool ok, const std::string& text,
                     const std::string& json);

  void hold_events() { holding_ = true; }
  // Sends what was held and stops holding; the ids of the requests whose connection was gone.
  std::vector<uint64_t> flush_events();

 private:
  // The events held for one connection, built in one buffer.
  struct Held {
    flatbuffers::FlatBufferBuilder builder{1024};
    std::vector<flatbuffers::Offset<wire::StreamEvent>> events;
    std::vector<uint64_t> request_ids;
  };
  // Past these a connection's held events leave at once (a burst of stage messages can make many).
  static constexpr size_t kMaxHeldEvents = 512, kMaxHeldBytes = size_t{1} << 20;

  void send_held(const std::string& client, Held& held);

  zmq::socket_t socket_;
  GatewayMetrics& metrics_;
  runtime::Logger& log_;
  bool holding_ = false;
  std::unordered_map<std::string, Held> held_;
  std::vector<uint64_t> gone_;  // requests whose connection was gone at a send of held events
};

}  // namespace moeline::stages
