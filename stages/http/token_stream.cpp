#include "stages/http/token_stream.h"

#include <algorithm>
#include <span>

namespace moeline::stages::http {

using nlohmann::json;

namespace {

std::string server_event(const json& data) {
  return "data: " + to_text(data) + "\n\n";
}

}  // namespace

TokenStream::TokenStream(Endpoint endpoint, const CompletionRequest& request,
                         const Backend& backend, std::shared_ptr<Completion> completion,
                         uint32_t prompt_tokens, runtime::Histogram* token_delay,
                         runtime::Counter* write_failures)
    : endpoint_(endpoint),
      completion_(std::move(completion)),
      stops_(request.stop),
      token_events_(endpoint, *completion_),
      include_usage_(request.include_usage),
      token_delay_(token_delay),
      write_failures_(write_failures) {
  if (request.logprobs) logprobs_.emplace(endpoint, *backend.tokenizer);
  outcome_.usage.prompt_tokens = prompt_tokens;
}

bool TokenStream::send(httplib::DataSink& sink, const std::string& text) {
  if (!client_gone_ && !sink.write(text.data(), text.size())) {
    client_gone_ = true;
    write_failures_->inc();
  }
  return !client_gone_;
}

bool TokenStream::on_event(const sdk::Event& event, Clock::time_point arrived,
                           httplib::DataSink& sink) {
  if (event.kind == sdk::EventKind::kAccepted) return true;  // a retry's: nothing to write
  std::string text;
  const size_t known = outcome_.ids.size();
  const bool over = absorb(event, stops_, outcome_, text);
  // Ended by the pipeline (finished, failed); a stop string still needs a cancel.
  pipeline_ended_ = over && !stops_.stopped();
  if (outcome_.error) return false;
  // With log-probabilities, every token's chunk carries them, text or not.
  json token_logprobs = nullptr;
  if (logprobs_ && outcome_.ids.size() > known)
    token_logprobs = logprobs_->object(
        std::span(outcome_.ids).subspan(known),
        std::span(outcome_.logprobs).subspan(std::min(known, outcome_.logprobs.size())),
        text_offset_);
  if (!text.empty() || first_chunk_ || !token_logprobs.is_null()) {
    const bool plain = !first_chunk_ && token_logprobs.is_null();
    if (!send(sink, plain ? token_events_.event(text)
                          : server_event(stream_chunk(endpoint_, *completion_, text, first_chunk_,
                                                      "", token_logprobs))))
      return false;
    if (!first_chunk_ && event.kind == sdk::EventKind::kDelta)
      token_delay_->observe(std::chrono::duration<double>(Clock::now() - arrived).count());
    first_chunk_ = false;
  }
  return !over;
}

void TokenStream::time_out() {
  if (!outcome_.error)
    outcome_.error = ApiError{504, "the request timed out", "timeout_error", "", ""};
}

void TokenStream::finish(httplib::DataSink& sink) {
  if (outcome_.error) {
    send(sink, server_event(outcome_.error->body()));
  } else {
    completion_->usage = outcome_.usage;
    completion_->usage.completion_tokens = outcome_.completion_tokens;
    completion_->timings = outcome_.timings;
    send(sink,
         server_event(stream_chunk(endpoint_, *completion_, "", false, outcome_.finish_reason)));
    if (include_usage_) send(sink, server_event(usage_chunk(endpoint_, *completion_)));
  }
  send(sink, "data: [DONE]\n\n");
}

}  // namespace moeline::stages::http
