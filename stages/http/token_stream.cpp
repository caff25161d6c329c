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
                         runtime::Counter* write_failures, ReasoningStart reasoning)
    : endpoint_(endpoint),
      completion_(std::move(completion)),
      stops_(request.stop, request.stop_token_ids, request.include_stop_str_in_output,
             request.min_tokens),
      token_events_(endpoint, *completion_),
      token_delay_(token_delay),
      write_failures_(write_failures) {
  if (request.logprobs)
    logprobs_.emplace(endpoint, *backend.tokenizer, request.return_tokens_as_token_ids);
  if (request.echo) echo_ = echo_text(request, backend);
  score_only_ = request.score_only();
  if (endpoint == Endpoint::kChat && reasoning != ReasoningStart::kOff) {
    reasoning_.emplace(reasoning);
    reasoning_events_.emplace(endpoint, *completion_, DeltaField::kReasoning);
  }
  if (endpoint == Endpoint::kChat && !request.chat.tools_json.empty()) {
    if (backend.chat) tool_call_format_ = backend.chat->tool_call_format();
    bare_json_call_ = forces_bare_json_call(request, backend);
    // A bare forced call is held from its first character.
    tool_calls_.emplace(bare_json_call_ ? std::string_view() : tool_call_marker(tool_call_format_));
    tools_json_ = request.chat.tools_json;
    parallel_tool_calls_ = request.parallel_tool_calls;
  }
  outcome_.usage.prompt_tokens = prompt_tokens;
  continuous_usage_ = request.continuous_usage;
}

sdk::Usage TokenStream::usage_so_far() const {
  sdk::Usage usage = outcome_.usage;
  usage.completion_tokens = score_only_ ? 0 : outcome_.completion_tokens;
  return usage;
}

std::string TokenStream::chunk_event(json chunk) const {
  if (continuous_usage_) chunk["usage"] = usage_json(usage_so_far());
  return server_event(chunk);
}

bool TokenStream::send(httplib::DataSink& sink, const std::string& text) {
  if (client_gone_) return false;
  if (!sink.write(text.data(), text.size())) {
    client_gone_ = true;
    write_failures_->inc();
    return false;
  }
  last_write_ = Clock::now();
  return true;
}

bool TokenStream::on_event(const sdk::Event& event, Clock::time_point arrived,
                           httplib::DataSink& sink) {
  if (event.kind == sdk::EventKind::kAccepted) {  // nothing to write (a retry's, or the first's
    // where the stream began before it)
    if (event.usage.prompt_tokens > 0) outcome_.usage.prompt_tokens = event.usage.prompt_tokens;
    return true;
  }
  std::string text;
  const size_t known = outcome_.ids.size();
  const bool over = absorb(event, stops_, outcome_, text);
  // Ended by the pipeline (finished, failed); a stop string still needs a cancel.
  pipeline_ended_ = over && !stops_.stopped();
  if (outcome_.error) return false;
  // Echo: the prompt's chunk (with its tokens' log-probabilities) before the first token's.
  if (echo_ && event.kind != sdk::EventKind::kError) {
    const json prompt_logprobs =
        logprobs_
            ? logprobs_->prompt_object(outcome_.prompt_ids, outcome_.prompt_logprobs, text_offset_)
            : json(nullptr);
    if (!send(sink, chunk_event(stream_chunk(endpoint_, *completion_, *echo_, first_chunk_, "",
                                             prompt_logprobs))))
      return false;
    first_chunk_ = false;
    echo_.reset();
  }
  if (score_only_) return !over;
  std::string reasoning;
  if (reasoning_) {
    ReasoningParts parts = reasoning_->feed(text);
    reasoning = std::move(parts.reasoning);
    text = std::move(parts.content);
  }
  if (tool_calls_) text = tool_calls_->feed(text);
  // With log-probabilities, every token's chunk carries them, text or not.
  json token_logprobs = nullptr;
  if (logprobs_ && outcome_.ids.size() > known)
    token_logprobs = logprobs_->object(
        std::span(outcome_.ids).subspan(known),
        std::span(outcome_.logprobs).subspan(std::min(known, outcome_.logprobs.size())),
        text_offset_);
  const bool first = first_chunk_;
  bool wrote = false;
  if (!reasoning.empty()) {
    // The token's log-probabilities go with its content where it has any.
    if (!send_delta(sink, reasoning, text.empty() ? token_logprobs : json(nullptr),
                    DeltaField::kReasoning))
      return false;
    if (text.empty()) token_logprobs = nullptr;
    wrote = true;
  }
  if (!text.empty() || first_chunk_ || !token_logprobs.is_null()) {
    if (!send_delta(sink, text, token_logprobs, DeltaField::kContent)) return false;
    wrote = true;
  }
  if (wrote && !first && event.kind == sdk::EventKind::kDelta)
    token_delay_->observe(std::chrono::duration<double>(Clock::now() - arrived).count());
  return !over;
}

bool TokenStream::send_delta(httplib::DataSink& sink, const std::string& text, const json& logprobs,
                             DeltaField field) {
  const bool plain = !first_chunk_ && logprobs.is_null();
  const TokenEvents& events = field == DeltaField::kReasoning ? *reasoning_events_ : token_events_;
  const sdk::Usage usage = continuous_usage_ ? usage_so_far() : sdk::Usage();
  const bool sent =
      send(sink, plain ? events.event(text, continuous_usage_ ? &usage : nullptr)
                       : chunk_event(stream_chunk(endpoint_, *completion_, text, first_chunk_, "",
                                                  logprobs, field)));
  first_chunk_ = false;
  return sent;
}

void TokenStream::time_out() {
  if (!outcome_.error)
    outcome_.error = ApiError{504, "the request timed out", "timeout_error", "", ""};
}

void TokenStream::fail(const std::string& what) {
  if (!outcome_.error)
    outcome_.error = ApiError{500, "internal error: " + what, "server_error", "", ""};
}

void TokenStream::finish_choice(httplib::DataSink& sink) {
  completion_->usage = outcome_.usage;
  completion_->usage.completion_tokens = score_only_ ? 0 : outcome_.completion_tokens;
  completion_->timings = outcome_.timings;
  std::string finish_reason = score_only_ ? "length" : outcome_.finish_reason;
  if (reasoning_ && !score_only_) {  // what was held back for the markers and whitespace
    ReasoningParts rest = reasoning_->finish();
    if (!rest.reasoning.empty()) send_delta(sink, rest.reasoning, nullptr, DeltaField::kReasoning);
    if (tool_calls_) rest.content = tool_calls_->feed(rest.content);
    if (!rest.content.empty()) send_delta(sink, rest.content, nullptr, DeltaField::kContent);
  }
  if (tool_calls_ && !tool_calls_->held().empty()) {
    if (auto parsed = parse_tool_calls(tool_calls_->held(), tool_call_format_, tools_json_,
                                       parallel_tool_calls_, bare_json_call_)) {
      completion_->tool_calls = std::move(parsed->calls);
      send(sink, chunk_event(tool_calls_chunk(*completion_)));
      finish_reason = "tool_calls";
    } else {
      send(sink, chunk_event(
                     stream_chunk(endpoint_, *completion_, tool_calls_->held(), first_chunk_, "")));
      first_chunk_ = false;
    }
  }
  if (finish_reason != "tool_calls") completion_->stop_reason = outcome_.stop_reason;
  send(sink, chunk_event(stream_chunk(endpoint_, *completion_, "", false, finish_reason)));
}

StreamedResponse::StreamedResponse(Endpoint endpoint, std::vector<Choice> choices,
                                   bool include_usage, int64_t n)
    : endpoint_(endpoint),
      choices_(std::move(choices)),
      include_usage_(include_usage),
      n_(n),
      ended_(choices_.size(), false),
      open_(choices_.size()) {}

bool StreamedResponse::deliver(size_t i, const sdk::Event& event, Clock::time_point arrived,
                               httplib::DataSink& sink) {
  if (stopped_ || ended_[i]) return false;
  last_event_ = std::max(last_event_, arrived);
  if (on_first_event_ && event.kind != sdk::EventKind::kAccepted) {
    on_first_event_();
    on_first_event_ = nullptr;
  }
  TokenStream& tokens = *choices_[i].tokens;
  // Runs on the gateway bridge's thread for every stream: what goes wrong in one response ends
  // that response (an error event), never the bridge and the other streams with it.
  try {
    if (tokens.on_event(event, arrived, sink)) return true;
    ended_[i] = true;
    --open_;
    if (tokens.error() || tokens.client_gone())
      stopped_ = true;
    else
      tokens.finish_choice(sink);
  } catch (const std::exception& e) {
    if (!ended_[i]) {
      ended_[i] = true;
      --open_;
    }
    tokens.fail(e.what());
    stopped_ = true;
  }
  changed_.notify_all();
  return false;
}

bool StreamedResponse::write(httplib::DataSink& sink, std::chrono::milliseconds idle_timeout,
                             ClientLink& client, std::chrono::milliseconds keep_alive) {
  // A consumer runs holding its channel's lock and then takes mutex_: so mutex_ is never held
  // here while a channel's lock is taken (attach, and the detaching wait_consumed).
  for (size_t i = 0; i < choices_.size(); ++i) {
    bool more = true;
    if (choices_[i].first) {
      std::lock_guard lock(mutex_);
      more = deliver(i, *choices_[i].first, Clock::now(), sink);
    }
    if (more)
      choices_[i].channel->attach([this, i, &sink](const sdk::Event& event, Clock::time_point at) {
        std::lock_guard lock(mutex_);
        return deliver(i, event, at, sink);
      });
  }
  {
    std::unique_lock lock(mutex_);
    const auto over = [&] { return open_ == 0 || stopped_; };
    while (!over()) {
      const auto silent_until = last_event_ + idle_timeout;
      if (changed_.wait_until(
              lock, std::min(silent_until, Clock::now() + ClientLink::kCheckInterval), over))
        break;
      if (Clock::now() >= last_event_ + idle_timeout) {
        for (size_t i = 0; i < choices_.size(); ++i)
          if (!ended_[i]) choices_[i].tokens->time_out();
        stopped_ = true;
        break;
      }
      // Nothing written for a while (a tool call or a stop string held back, a slow step): no
      // write fails to tell that the client left, so look, before any keep-alive goes out (one
      // written into a closed connection would end the stream as a failed write instead).
      const auto last_write = [this] {
        Clock::time_point last = Clock::time_point::min();
        for (const Choice& choice : choices_) last = std::max(last, choice.tokens->last_write());
        return last;
      };
      if (Clock::now() - last_write() < ClientLink::kCheckInterval) continue;
      lock.unlock();
      const bool gone = client.gone();
      lock.lock();
      if (gone) {
        client_gone_ = stopped_ = true;
        break;
      }
      if (over()) break;
      if (Clock::now() - last_write() >= keep_alive &&
          !choices_.front().tokens->send(sink, ": keep-alive\n\n")) {
        stopped_ = true;  // the failed write marked the client gone
        break;
      }
    }
  }
  // Detached: no consumer is called after this (those still attached belong to choices that
  // the failure or the deadline ended, and are cancelled by the caller).
  for (Choice& choice : choices_) choice.channel->wait_consumed(Clock::now());
  std::lock_guard lock(mutex_);
  if (client_gone_) return false;
  for (const Choice& choice : choices_)
    if (choice.tokens->client_gone()) return false;
  TokenStream& first = *choices_.front().tokens;
  const auto failed = std::find_if(choices_.begin(), choices_.end(),
                                   [](const Choice& choice) { return choice.tokens->error(); });
  std::string closing;
  if (failed != choices_.end()) {
    closing = server_event(failed->tokens->error()->body());
  } else if (include_usage_) {
    std::vector<Completion> completions;
    for (const Choice& choice : choices_) completions.push_back(choice.tokens->completion());
    Completion combined = first.completion();
    combined.usage = combined_usage(completions, n_);
    closing = server_event(usage_chunk(endpoint_, combined));
  }
  closing += "data: [DONE]\n\n";
  return first.send(sink, closing);
}

std::vector<std::shared_ptr<RequestChannel>> StreamedResponse::unfinished() const {
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (const Choice& choice : choices_)
    if (!choice.tokens->pipeline_ended()) channels.push_back(choice.channel);
  return channels;
}

}  // namespace moeline::stages::http
