#include "stages/gateway/client_requests.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "model/kv_cache.h"
#include "reuse/policy.h"
#include "reuse/records.h"
#include "schemas/vocabulary.h"
#include "stages/common/common.h"
#include "stages/runtime/dispatch.h"
#include "stages/runtime/security.h"
#include "stages/runtime/trace.h"

namespace moeline::stages {

uint64_t first_request_id(std::chrono::system_clock::time_point started) {
  const auto milliseconds =
      std::chrono::duration_cast<std::chrono::milliseconds>(started.time_since_epoch()).count();
  return (static_cast<uint64_t>(std::max<int64_t>(milliseconds, 0)) << 11) + 1;
}

void ClientRequests::reject(const std::string& client, uint64_t client_request_id,
                            wire::ErrorCode code, const std::string& reason,
                            const std::string& text) {
  p_.metrics.rejected(reason).inc();
  p_.metrics.outcome("rejected").inc();
  if (uint64_t suppressed = 0; reject_log_.allow(suppressed))
    p_.log.warn("request_rejected",
                {{"reason", reason}, {"detail", text}, {"suppressed", suppressed}});
  p_.client.send_event({client, client_request_id, 0}, wire::EventKind::Error, {}, {}, {}, code,
                       text);
}

void ClientRequests::on_frames(std::vector<zmq::message_t>&& frames) {
  if (frames.empty()) return;
  const std::string client = frames.front().to_string();
  frames.erase(frames.begin());
  wire::Decoded decoded = wire::decode(std::move(frames), limits_);
  if (decoded.error) {
    p_.metrics.rejected("frame_" + decoded.error->reason).inc();
    runtime::report_rejected_frame(p_.registry, p_.log, frame_log_, "client", *decoded.error);
    p_.client.reply_error(client,
                          decoded.error->reason == "version" ? wire::ErrorCode::VersionMismatch
                                                             : wire::ErrorCode::MalformedMessage,
                          decoded.error->detail);
    return;
  }
  static constexpr runtime::HandlerTable<ClientRequests, 4, const std::string&, wire::Message&>
      kClientHandlers({
          {wire::MessageType::GenerateRequest, &ClientRequests::on_generate},
          {wire::MessageType::CancelRequest, &ClientRequests::on_cancel},
          {wire::MessageType::Feedback, &ClientRequests::on_feedback},
          {wire::MessageType::ControlCommand, &ClientRequests::on_control},
      });
  wire::Message& message = *decoded.message;
  if (kClientHandlers.dispatch(*this, message.type, client, message)) return;
  p_.metrics.rejected("unexpected_type").inc();
  p_.client.reply_error(
      client, wire::ErrorCode::InvalidRequest,
      std::string("a client may not send ") + wire::message_type_name(message.type));
}

void ClientRequests::on_generate(const std::string& client, wire::Message& message) {
  const wire::GenerateRequest& request = *message.as<wire::GenerateRequest>();
  const uint64_t crid = request.client_request_id();
  if (draining_)
    return reject(client, crid, wire::ErrorCode::Draining, "draining",
                  "the gateway is shutting down: send the request to another gateway");
  if (p_.tracker.of_client(client, crid) != nullptr)
    return reject(client, crid, wire::ErrorCode::InvalidRequest, "duplicate_id",
                  "client_request_id " + std::to_string(crid) + " is already in flight");
  if (p_.tracker.size() >= max_in_flight_)
    return reject(client, crid, wire::ErrorCode::Overloaded, "overloaded",
                  "the gateway has " + std::to_string(p_.tracker.size()) +
                      " requests in flight (limit " + std::to_string(max_in_flight_) + ")");
  auto validated = p_.validator.validate(request);
  if (const auto* refused = std::get_if<Refusal>(&validated))
    return reject(client, crid, refused->code, refused->reason, refused->text);
  ValidRequest& valid = std::get<ValidRequest>(validated);
  if (auto over =
          p_.tenant_limiter.admit(valid.tenant, valid.limits, valid.prompt.size(), seconds_now()))
    return reject(client, crid, wire::ErrorCode::Overloaded, "tenant_over_limit", *over);
  // Every sampled request gets a seed, so that a retry after a replica dies replays the
  // tokens the client already has instead of diverging from them.
  model::SamplingParams& sampling = valid.sampling;
  const bool client_seeded = sampling.seed.has_value();
  if (sampling.temperature > 0 && !sampling.seed) sampling.seed = seed_source_();

  Request r;
  r.id = next_request_id_++;
  runtime::trace_message(p_.log, "GenerateRequest", r.id, 1, "client");
  r.client = client;
  r.tenant = valid.tenant;
  r.client_request_id = crid;
  r.batch_events = request.batch_events();
  r.keep_special_tokens = !request.skip_special_tokens();
  r.prompt = std::move(valid.prompt);
  r.sampling = std::move(sampling);
  // Server-derived: a client names its tenant, never the namespace its cache entries live in.
  r.client_deterministic = r.sampling.temperature == 0 || client_seeded;
  reuse::Admission admitted = p_.reuse.policy().admit(r.tenant, valid.asked_levels,
                                                      r.client_deterministic, r.sampling.logprobs);
  r.cache_namespace = std::move(admitted.cache_namespace);
  r.namespace_levels = admitted.namespace_levels;
  // The prompt's log-probabilities come only from computing all of it: nothing cached is looked
  // up (nor stored: the same prompt without them will compute and store it).
  r.allowed_levels = r.sampling.prompt_logprobs ? 0 : admitted.allowed_levels;
  if (!admitted.approximate_refused.empty()) {
    r.approximate = wire::parse_approximate_outcome(admitted.approximate_refused)
                        .value_or(wire::ApproximateOutcome::NotAllowed);
    p_.metrics.approximate(admitted.approximate_refused).inc();
  }
  const uint64_t ns = model::namespace_id(r.cache_namespace);
  const uint64_t model_key = reuse_model_key(model_.model_id);
  r.prompt_key =
      reuse::prompt_key(r.prompt, reuse::block_chain(r.prompt, model_key, ns), model_key, ns);
  r.received = Clock::now();
  r.deadline = r.received + valid.deadline;
  r.text = std::make_unique<tokenizer::DecodeStream>(
      p_.validator.tokenizer(),
      tokenizer::DecodeOptions{.skip_special_tokens = !r.keep_special_tokens});
  // With its usage: the prompt's token count, which a front end that ends the request itself
  // (an HTTP stop string) still reports.
  p_.client.send_event(EventTo::of(r), wire::EventKind::Accepted, {}, {}, {}, wire::ErrorCode::None,
                       {}, &r);
  p_.tracker.add(std::move(r));
}

void ClientRequests::on_cancel(const std::string& client, wire::Message& message) {
  const uint64_t crid = message.as<wire::CancelRequest>()->client_request_id();
  Request* r = p_.tracker.of_client(client, crid);
  if (r == nullptr) return;  // already finished: nothing to do
  p_.log.info("request_cancelled", {{"request_id", r->id}, {"tokens", r->sent.size()}});
  p_.tracker.finish(*r, wire::FinishReason::Cancelled);
}

void ClientRequests::on_feedback(const std::string& client, wire::Message& message) {
  const auto* feedback = message.as<wire::Feedback>();
  p_.log.info("feedback", {{"client_request_id", feedback->client_request_id()},
                           {"score", static_cast<double>(feedback->score())}});
  p_.reuse.on_feedback(client, feedback->client_request_id(), feedback->score());
}

void ClientRequests::on_control(const std::string& client, wire::Message& message) {
  const wire::ControlCommand& command = *message.as<wire::ControlCommand>();
  const std::string name = command.command() ? command.command()->str() : "";
  std::string key_id;
  if (auto refused = p_.validator.authorize_operator(command, key_id)) {
    p_.metrics.rejected(refused->reason).inc();
    p_.log.warn("control_refused", {{"command", name.substr(0, 64)}, {"key", key_id}});
    return p_.client.reply_error(client, refused->code, refused->text);
  }
  const ControlResult result =
      p_.control.run(name, command.arguments() ? command.arguments()->str() : "{}");
  p_.client.reply_control(client, result.ok, result.text, result.body.dump());
}

}  // namespace moeline::stages
