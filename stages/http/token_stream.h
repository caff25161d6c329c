#pragma once
// One streamed response: each event of its request becomes server-sent events (the text through
// the stop strings, with log-probabilities where asked), then the finish chunk, the usage chunk
// where asked, and [DONE]. Events are written by whichever thread delivers them: the gateway
// bridge's, as they arrive (RequestChannel::attach), so a token costs no wake-up of the
// response's own thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <httplib.h>

#include "sdk/client.h"
#include "stages/http/backend.h"
#include "stages/http/events.h"
#include "stages/http/logprobs.h"
#include "stages/http/openai.h"
#include "stages/http/stop_matcher.h"
#include "stages/runtime/metrics.h"

namespace moeline::stages::http {

class TokenStream {
 public:
  using Clock = std::chrono::steady_clock;
  TokenStream(Endpoint endpoint, const CompletionRequest& request, const Backend& backend,
              std::shared_ptr<Completion> completion, uint32_t prompt_tokens,
              runtime::Histogram* token_delay, runtime::Counter* write_failures);

  // Writes what `event` adds (it reached this process at `arrived`); false when the stream is
  // over: finished, failed, cut by a stop string, or its client gone.
  bool on_event(const sdk::Event& event, Clock::time_point arrived, httplib::DataSink& sink);
  // No event within the request's deadline: the stream ends with a 504 error object.
  void time_out();
  // The closing events: the error object, or the finish chunk (and usage); then [DONE].
  void finish(httplib::DataSink& sink);

  bool client_gone() const { return client_gone_; }
  // The pipeline ended the request (finished or failed): nothing left to cancel.
  bool pipeline_ended() const { return pipeline_ended_; }

 private:
  bool send(httplib::DataSink& sink, const std::string& text);

  Endpoint endpoint_;
  std::shared_ptr<Completion> completion_;
  StopMatcher stops_;
  std::optional<LogprobsWriter> logprobs_;
  TokenEvents token_events_;
  bool include_usage_;
  runtime::Histogram* token_delay_;
  runtime::Counter* write_failures_;
  Outcome outcome_;
  size_t text_offset_ = 0;  // completions' logprobs.text_offset
  bool first_chunk_ = true, client_gone_ = false, pipeline_ended_ = false;
};

}  // namespace moeline::stages::http
