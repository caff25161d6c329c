#pragma once
// One streamed response: each event of its request becomes server-sent events (the text through
// the stop strings, with log-probabilities where asked), then the finish chunk, the usage chunk
// where asked, and [DONE]. Events are written by whichever thread delivers them: the gateway
// bridge's, as they arrive (RequestChannel::attach), so a token costs no wake-up of the
// response's own thread.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <httplib.h>

#include "sdk/client.h"
#include "stages/http/backend.h"
#include "stages/http/client_link.h"
#include "stages/http/events.h"
#include "stages/http/logprobs.h"
#include "stages/http/openai.h"
#include "stages/http/reasoning.h"
#include "stages/http/stop_matcher.h"
#include "stages/http/tool_calls.h"
#include "stages/runtime/metrics.h"

namespace moeline::stages::http {

class TokenStream {
 public:
  using Clock = std::chrono::steady_clock;
  TokenStream(Endpoint endpoint, const CompletionRequest& request, const Backend& backend,
              std::shared_ptr<Completion> completion, uint32_t prompt_tokens,
              runtime::Histogram* token_delay, runtime::Counter* write_failures,
              ReasoningStart reasoning = ReasoningStart::kOff);

  // Writes what `event` adds (it reached this process at `arrived`); false when the stream is
  // over: finished, failed, cut by a stop string, or its client gone.
  bool on_event(const sdk::Event& event, Clock::time_point arrived, httplib::DataSink& sink);
  // No event within the request's timeout: the stream ends with a 504 error object.
  void time_out();
  // Writing the choice failed here (a bug, not the client): it ends with a 500 error object.
  void fail(const std::string& what);
  // The choice is over without an error: its usage and timings into the completion, the text
  // held back for reasoning and tool calls (as reasoning, calls, or as text if it is none), and
  // its finish chunk.
  void finish_choice(httplib::DataSink& sink);
  // The error that ended the choice, if one did.
  const std::optional<ApiError>& error() const { return outcome_.error; }
  const Completion& completion() const { return *completion_; }

  bool client_gone() const { return client_gone_; }
  // When a write last succeeded (the stream's start before any).
  Clock::time_point last_write() const { return last_write_; }
  // The pipeline ended the request (finished or failed): nothing left to cancel.
  bool pipeline_ended() const { return pipeline_ended_; }
  // Writes `text` unless the client is gone; a failed write marks it gone (and is counted).
  bool send(httplib::DataSink& sink, const std::string& text);

 private:
  // A chunk's server-sent event, with the usage so far where the request asked for it in every
  // chunk.
  std::string chunk_event(nlohmann::json chunk) const;
  sdk::Usage usage_so_far() const;
  // One chunk of text in `field` of the delta (with the role on the first chunk, and the tokens'
  // log-probabilities where given).
  bool send_delta(httplib::DataSink& sink, const std::string& text, const nlohmann::json& logprobs,
                  DeltaField field);

  Endpoint endpoint_;
  std::shared_ptr<Completion> completion_;
  StopMatcher stops_;
  std::optional<LogprobsWriter> logprobs_;
  std::optional<ReasoningStream> reasoning_;     // chat answers of a model that thinks
  std::optional<TokenEvents> reasoning_events_;  // their reasoning_content deltas
  std::optional<ToolCallHold> tool_calls_;       // chat with tools on offer: held, then read as
  tokenizer::ToolCallFormat tool_call_format_ = tokenizer::ToolCallFormat::kNone;  // the template's
  std::string tools_json_;                                                         // the request's
  bool parallel_tool_calls_ = true;
  bool bare_json_call_ = false;    // forces_bare_json_call
  bool continuous_usage_ = false;  // stream_options.continuous_usage_stats
  TokenEvents token_events_;
  runtime::Histogram* token_delay_;
  runtime::Counter* write_failures_;
  Outcome outcome_;
  std::optional<std::string> echo_;  // the prompt's text, until echoed before the first token
  bool score_only_ = false;          // echo with max_tokens 0: no token of the completion shown
  size_t text_offset_ = 0;           // completions' logprobs.text_offset
  bool first_chunk_ = true, client_gone_ = false, pipeline_ended_ = false;
  Clock::time_point last_write_ = Clock::now();
};

// The stream of a whole response: its choices' events (n of them, OpenAI's `n`) interleaved in
// one sink as they arrive, each choice's finish chunk when it ends; then, once every choice is
// over, the usage chunk where asked and [DONE]. A choice that fails ends the response with its
// error object (the other choices are cancelled), as does a silence of the whole response longer
// than the request timeout; a client seen gone while nothing is written ends it too.
class StreamedResponse {
 public:
  using Clock = std::chrono::steady_clock;
  struct Choice {
    std::shared_ptr<RequestChannel> channel;
    std::optional<sdk::Event> first;  // none yet: the stream began before its first token
    std::unique_ptr<TokenStream> tokens;
  };

  // `n`: choices per prompt (choice i answers prompt i / n), for the usage.
  StreamedResponse(Endpoint endpoint, std::vector<Choice> choices, bool include_usage,
                   int64_t n = 1);

  // Writes the response to `sink`, the first events on this thread and the rest on the bridge's
  // as they arrive; false when the client went away (a failed write, or `client` seen gone).
  // `idle_timeout`: the longest wait for an event of any choice (a stream that keeps producing is
  // never cut for its length). A stream with nothing written for `keep_alive` writes an SSE
  // comment (": keep-alive"), which clients skip and proxies count as traffic (nginx and cloud
  // load balancers cut a connection idle for 60 s by default).
  bool write(httplib::DataSink& sink, std::chrono::milliseconds idle_timeout, ClientLink& client,
             std::chrono::milliseconds keep_alive = std::chrono::seconds(10));
  // The choices' requests the pipeline has not ended (to cancel).
  std::vector<std::shared_ptr<RequestChannel>> unfinished() const;
  // Called once, on the first event of any choice (with the response's lock held): for a stream
  // that began before its first token, the time to first token.
  void on_first_event(std::function<void()> callback) { on_first_event_ = std::move(callback); }

 private:
  // With mutex_ held: one event of choice i; false once the choice is over or the response is.
  bool deliver(size_t i, const sdk::Event& event, Clock::time_point arrived,
               httplib::DataSink& sink);

  Endpoint endpoint_;
  std::vector<Choice> choices_;
  bool include_usage_;
  int64_t n_;
  // Serialises the writes of the choices (each choice's events come on the bridge thread, the
  // first ones on the response's) and guards what follows.
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<bool> ended_;
  size_t open_ = 0;
  bool stopped_ = false;      // a choice failed or the client went away: nothing more is written
  bool client_gone_ = false;  // seen gone while waiting (not by a failed write)
  std::function<void()> on_first_event_;
  Clock::time_point last_event_ = Clock::now();
};

}  // namespace moeline::stages::http
