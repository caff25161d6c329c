#include "stages/gateway/client_front.h"

#include <algorithm>
#include <cctype>

#include "model/model_text.h"
#include "reuse/policy.h"
#include "stages/common/common.h"
#include "stages/runtime/trace.h"

namespace moeline::stages {
namespace {

// An upper bound on the text bytes one token covers: the longest vocabulary entry as stored
// (byte-level and "▁" forms spell a byte with up to 3, so this overestimates), at least 4.
size_t longest_token_bytes(const tokenizer::Tokenizer& tokenizer, int64_t vocab) {
  size_t longest = 4;
  for (int64_t id = 0; id < vocab; ++id)
    if (auto token = tokenizer.id_to_token(static_cast<int32_t>(id)))
      longest = std::max(longest, token->size());
  return longest;
}

bool valid_tenant_name(const std::string& tenant) {
  return !tenant.empty() && tenant.size() <= 64 &&
         std::all_of(tenant.begin(), tenant.end(), [](char c) {
           return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
         });
}

}  // namespace

RequestValidator::RequestValidator(const runtime::Config& config, const model::ModelInfo& model)
    : api_keys_(config.text("api-keys")), tenants_(runtime::parse_list(config.text("tenants"))) {
  auto tokenizer = model::load_model_tokenizer(config.text("model"));
  if (!tokenizer) throw std::runtime_error(tokenizer.error().message);
  tokenizer_ = std::make_unique<tokenizer::Tokenizer>(std::move(*tokenizer));
  tenant_limits_.max_in_flight = static_cast<uint32_t>(
      std::clamp<int64_t>(config.integer("tenant-max-in-flight"), 0, 1'000'000'000));
  tenant_limits_.prompt_tokens_per_s = std::max(0.0, config.number("tenant-prompt-tokens-per-s"));
  const model::ModelConfig& cfg = model.config;
  vocab_ = cfg.vocab_size;
  context_ = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
  max_prompt_tokens_ = config.integer("max-prompt-tokens");
  if (max_prompt_tokens_ <= 0 || max_prompt_tokens_ >= context_) max_prompt_tokens_ = context_ - 1;
  max_prompt_bytes_ =
      std::min(static_cast<size_t>(runtime::parse_bytes(config.text("max-prompt-bytes"))),
               static_cast<size_t>(max_prompt_tokens_) * longest_token_bytes(*tokenizer_, vocab_));
  default_deadline_ = std::chrono::milliseconds(config.integer("default-deadline-ms"));
  max_deadline_ = std::chrono::milliseconds(config.integer("max-deadline-ms"));
}

std::optional<Refusal> RequestValidator::check_tenant(const wire::GenerateRequest& request,
                                                      std::string& tenant,
                                                      TenantLimits& limits) const {
  tenant = request.tenant() ? request.tenant()->str() : "";
  limits = tenant_limits_;
  if (api_keys_.required()) {
    // The key names the tenant; a request may repeat it, never choose another.
    const std::string key = request.api_key() ? request.api_key()->str() : "";
    const runtime::ApiKeyEntry* entry = api_keys_.authenticate(key);
    if (entry == nullptr)
      return Refusal{wire::ErrorCode::Unauthenticated, "unauthenticated",
                     key.empty() ? "this gateway requires an API key" : "the API key is not valid"};
    if (!tenant.empty() && tenant != entry->tenant)
      return Refusal{wire::ErrorCode::Forbidden, "forbidden",
                     "the API key is not for tenant '" + tenant.substr(0, 64) + "'"};
    tenant = entry->tenant;
    if (entry->max_in_flight > 0) limits.max_in_flight = entry->max_in_flight;
    if (entry->prompt_tokens_per_s > 0) limits.prompt_tokens_per_s = entry->prompt_tokens_per_s;
  }
  if (tenant.empty()) tenant = "default";
  if (!valid_tenant_name(tenant))
    return Refusal{wire::ErrorCode::UnknownTenant, "bad_tenant",
                   "tenant names are 1-64 characters of [A-Za-z0-9._-]"};
  if (!tenants_.empty() && std::find(tenants_.begin(), tenants_.end(), tenant) == tenants_.end())
    return Refusal{wire::ErrorCode::UnknownTenant, "unknown_tenant",
                   "unknown tenant '" + tenant + "'"};
  return std::nullopt;
}

std::variant<std::vector<int32_t>, Refusal> RequestValidator::prompt_of(
    const wire::GenerateRequest& request) const {
  const bool has_prompt = request.prompt() != nullptr && request.prompt()->size() > 0;
  const bool has_tokens = request.tokens() != nullptr && request.tokens()->size() > 0;
  if (has_prompt == has_tokens)
    return Refusal{wire::ErrorCode::InvalidRequest, "no_prompt", "give either a prompt or tokens"};
  std::vector<int32_t> prompt;
  if (has_prompt) {
    // Refused before tokenizing: a prompt longer than the token limit times the longest token
    // cannot fit, and tokenizing it would stall the gateway's loop for every other request.
    if (request.prompt()->size() > max_prompt_bytes_)
      return Refusal{wire::ErrorCode::PromptTooLong, "prompt_too_long",
                     "prompt of " + std::to_string(request.prompt()->size()) +
                         " bytes exceeds the limit of " + std::to_string(max_prompt_bytes_) +
                         " bytes (" + std::to_string(max_prompt_tokens_) + " tokens)"};
    auto ids = tokenizer_->encode(request.prompt()->string_view(),
                                  {.add_special_tokens = request.add_special_tokens()});
    if (!ids) return Refusal{wire::ErrorCode::InvalidRequest, "bad_prompt", ids.error().message};
    prompt = std::move(*ids);
    if (prompt.empty())
      return Refusal{wire::ErrorCode::InvalidRequest, "no_prompt", "the prompt has no tokens"};
  } else {
    prompt.assign(request.tokens()->begin(), request.tokens()->end());
    for (int32_t token : prompt)
      if (token < 0 || token >= vocab_)
        return Refusal{wire::ErrorCode::InvalidRequest, "bad_token",
                       "token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                           std::to_string(vocab_) + ")"};
  }
  if (static_cast<int64_t>(prompt.size()) > max_prompt_tokens_)
    return Refusal{wire::ErrorCode::PromptTooLong, "prompt_too_long",
                   "prompt of " + std::to_string(prompt.size()) + " tokens exceeds the limit of " +
                       std::to_string(max_prompt_tokens_)};
  return prompt;
}

std::variant<ValidRequest, Refusal> RequestValidator::validate(
    const wire::GenerateRequest& request) const {
  ValidRequest valid;
  if (auto refused = check_tenant(request, valid.tenant, valid.limits)) return *refused;
  valid.sampling = from_wire(request.sampling());
  if (moeline::Status status = valid.sampling.validate(vocab_); !status.ok())
    return Refusal{wire::ErrorCode::InvalidSampling, "invalid_sampling", status.error().message};
  // No request can use more tokens than the context holds: past it, max_tokens is an error
  // (within it, it is capped below to what the prompt leaves).
  if (valid.sampling.max_tokens > context_)
    return Refusal{wire::ErrorCode::InvalidRequest, "bad_max_tokens",
                   "max_tokens " + std::to_string(valid.sampling.max_tokens) +
                       " exceeds the model's context of " + std::to_string(context_) + " tokens"};
  auto prompt = prompt_of(request);
  if (auto* refused = std::get_if<Refusal>(&prompt)) return std::move(*refused);
  valid.prompt = std::move(std::get<std::vector<int32_t>>(prompt));
  // Generation stops at the context anyway: what the prompt leaves of it is the most a request
  // can get.
  valid.sampling.max_tokens = std::min<int64_t>(
      valid.sampling.max_tokens, context_ - static_cast<int64_t>(valid.prompt.size()));
  valid.sampling.min_tokens = std::min(valid.sampling.min_tokens, valid.sampling.max_tokens);
  const std::optional<uint32_t> asked = reuse::ReusePolicy::requested_levels(
      request.reuse() ? request.reuse()->string_view() : std::string_view());
  if (!asked)
    return Refusal{wire::ErrorCode::InvalidRequest, "bad_reuse",
                   "unknown reuse '" + request.reuse()->str() +
                       "' (known: exact, approximate, response, blend, none)"};
  valid.asked_levels = *asked;
  const auto deadline = request.deadline_ms() > 0 ? std::chrono::milliseconds(request.deadline_ms())
                                                  : default_deadline_;
  valid.deadline = std::min(deadline, max_deadline_);
  return valid;
}

std::optional<Refusal> RequestValidator::authorize_operator(const wire::ControlCommand& command,
                                                            std::string& key_id) const {
  key_id = "none";
  if (!api_keys_.required()) return std::nullopt;
  // Operator commands change what every tenant gets (or show every tenant's requests).
  const runtime::ApiKeyEntry* entry =
      api_keys_.authenticate(command.api_key() ? command.api_key()->string_view() : "");
  if (entry != nullptr) key_id = entry->id;
  if (entry == nullptr)
    return Refusal{wire::ErrorCode::Unauthenticated, "unauthenticated",
                   "control commands need an operator's API key"};
  if (entry->role != runtime::ApiRole::kOperator)
    return Refusal{wire::ErrorCode::Forbidden, "forbidden",
                   "control commands need the operator role"};
  return std::nullopt;
}

ClientChannel::ClientChannel(zmq::context_t& context, const runtime::Config& config,
                             const runtime::CurveSettings& curve, runtime::ZapHandler* zap,
                             size_t max_body_bytes, GatewayMetrics& metrics, runtime::Logger& log)
    : socket_(context, zmq::socket_type::router), metrics_(metrics), log_(log) {
  socket_.set(zmq::sockopt::router_mandatory, true);
  socket_.set(zmq::sockopt::linger, 0);
  socket_.set(zmq::sockopt::sndhwm, 0);
  socket_.set(zmq::sockopt::rcvhwm, 0);
  // A hard cap below which the codec answers oversized messages with a clear error.
  socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(max_body_bytes * 16));
  if (curve.enabled()) {
    // Any client key: the channel is encrypted and the gateway proven; API keys say who.
    zap->allow_any(runtime::kClientDomain);
    runtime::make_curve_server(socket_, curve.own.keys, runtime::kClientDomain);
  }
  socket_.bind(config.text("client-bind"));
  runtime::restrict_ipc_endpoint(config.text("client-bind"));
}

bool ClientChannel::send(const std::string& client, std::vector<zmq::message_t>&& frames) {
  return wire::send(socket_, std::move(frames), &client, true);
}

namespace {

flatbuffers::Offset<wire::StreamEvent> build_event(
    flatbuffers::FlatBufferBuilder& builder, const EventTo& to, wire::EventKind kind,
    const std::string& text, const std::vector<int32_t>& tokens, wire::FinishReason finish,
    wire::ErrorCode code, const std::string& error, const Request* done, TokenScores scores) {
  auto text_offset = builder.CreateString(text);
  auto tokens_offset = builder.CreateVector(tokens);
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::TokenLogprobs>>>
      logprobs_offset = 0;
  if (scores.token != nullptr)
    logprobs_offset = builder.CreateVector(std::vector{copy_logprobs(builder, scores.token)});
  decltype(logprobs_offset) prompt_offset = 0;
  if (scores.prompt != nullptr) {
    std::vector<flatbuffers::Offset<wire::TokenLogprobs>> entries;
    entries.reserve(scores.prompt->size());
    for (const wire::TokenLogprobs* entry : *scores.prompt)
      entries.push_back(copy_logprobs(builder, entry));
    prompt_offset = builder.CreateVector(entries);
  }
  flatbuffers::Offset<flatbuffers::Vector<int32_t>> prompt_ids = 0;
  if (scores.prompt != nullptr && scores.prompt_ids != nullptr)
    prompt_ids = builder.CreateVector(*scores.prompt_ids);
  // The deprecated strings next to the typed fields (schema 1.9), for clients of 1.8 and older.
  auto finish_offset = builder.CreateString(wire::name(finish));
  auto error_offset = builder.CreateString(error);
  flatbuffers::Offset<wire::Usage> usage = 0;
  flatbuffers::Offset<wire::Timings> timings = 0;
  if (done != nullptr) {
    const auto now = Clock::now();
    usage = wire::CreateUsage(builder, static_cast<uint32_t>(done->prompt.size()),
                              static_cast<uint32_t>(done->sent.size()), done->reused_tokens,
                              builder.CreateString(wire::name(done->reuse_level)),
                              builder.CreateString(wire::name(done->approximate)), done->similarity,
                              done->reuse_level, done->approximate);
    const double queue_ms = done->prefill_dispatched == Clock::time_point{}
                                ? 0
                                : ms_between(done->received, done->prefill_dispatched);
    timings = wire::CreateTimings(
        builder, queue_ms, done->prefill_ms,
        done->has_first_token ? ms_between(done->received, done->first_token) : 0,
        ms_between(done->received, now));
  }
  return wire::CreateStreamEvent(
      builder, to.client_request_id, to.request_id, kind, text_offset, tokens_offset, finish_offset,
      usage, timings, code, error_offset, logprobs_offset,
      finish == wire::FinishReason::None ? flatbuffers::Optional<wire::FinishReason>() : finish,
      prompt_offset, prompt_ids);
}

}  // namespace

bool ClientChannel::send_event(const EventTo& to, wire::EventKind kind, const std::string& text,
                               const std::vector<int32_t>& tokens, wire::FinishReason finish,
                               wire::ErrorCode code, const std::string& error, const Request* done,
                               TokenScores scores) {
  if (runtime::request_tracing())
    runtime::trace_message(log_,
                           ("StreamEvent:" + std::string(wire::EnumNameEventKind(kind))).c_str(),
                           to.request_id, 0, "client");
  metrics_.stream_events->inc();
  if (holding_ && to.batch) {
    Held& held = held_[to.client];
    held.events.push_back(
        build_event(held.builder, to, kind, text, tokens, finish, code, error, done, scores));
    held.request_ids.push_back(to.request_id);
    if (held.events.size() >= kMaxHeldEvents || held.builder.GetSize() >= kMaxHeldBytes)
      send_held(to.client, held);
    return true;
  }
  metrics_.stream_messages_single->inc();
  flatbuffers::FlatBufferBuilder builder(256 + text.size());
  builder.Finish(build_event(builder, to, kind, text, tokens, finish, code, error, done, scores),
                 wire::GenerateRequestIdentifier());
  return send(to.client, wire::encode(wire::MessageType::StreamEvent, builder));
}

void ClientChannel::send_held(const std::string& client, Held& held) {
  if (held.events.empty()) return;
  bool sent = false;
  if (held.events.size() == 1) {
    metrics_.stream_messages_single->inc();
    held.builder.Finish(held.events.front(), wire::GenerateRequestIdentifier());
    sent = send(client, wire::encode(wire::MessageType::StreamEvent, held.builder));
  } else {
    metrics_.stream_messages_batch->inc();
    held.builder.Finish(
        wire::CreateStreamEventBatch(held.builder, held.builder.CreateVector(held.events)),
        wire::GenerateRequestIdentifier());
    sent = send(client, wire::encode(wire::MessageType::StreamEventBatch, held.builder));
  }
  if (!sent) gone_.insert(gone_.end(), held.request_ids.begin(), held.request_ids.end());
  held.builder.Clear();
  held.events.clear();
  held.request_ids.clear();
}

std::vector<uint64_t> ClientChannel::flush_events() {
  holding_ = false;
  for (auto& [client, held] : held_) send_held(client, held);
  // Connections come and go: keep the buffers of the few that are active, not of every one seen.
  if (held_.size() > 64) held_.clear();
  return std::exchange(gone_, {});
}

void ClientChannel::reply_error(const std::string& client, wire::ErrorCode code,
                                const std::string& text, uint64_t client_request_id) {
  flatbuffers::FlatBufferBuilder builder(256);
  builder.Finish(
      wire::CreateErrorReply(builder, code, builder.CreateString(text), client_request_id),
      wire::HelloIdentifier());
  send(client, wire::encode(wire::MessageType::ErrorReply, builder));
}

void ClientChannel::reply_control(const std::string& client, bool ok, const std::string& text,
                                  const std::string& json) {
  flatbuffers::FlatBufferBuilder builder(512);
  builder.Finish(
      wire::CreateControlReply(builder, ok, builder.CreateString(text), builder.CreateString(json)),
      wire::ControlCommandIdentifier());
  send(client, wire::encode(wire::MessageType::ControlReply, builder));
}

}  // namespace moeline::stages
