#pragma once
// The C++ client of a moeline stack. It speaks the wire contract only (schemas/), never engine
// internals. One Client is one DEALER connection to the gateway's client endpoint; any number of
// requests may be in flight on it at once.
//
//   moeline::sdk::Client client("ipc:///run/moeline/client.sock");
//   auto result = client.generate({.prompt = "to swim:", .max_tokens = 16},
//                                 [](const Event& e) { std::cout << e.text << std::flush; });
//
// Blocking: generate() returns when the request finishes (its events go to the callback as they
// arrive). Concurrent: start() several requests, then next_event() returns events of any of them.
// A wait longer than the timeout cancels what is in flight, reconnects (a fresh socket) and throws
// TimeoutError. An Error event becomes a ClientError in generate(). When the connection to the
// gateway drops (it was killed or restarted, or stopped answering ZMTP heartbeats for 5 s), every
// request in flight ends at once with a StageFailed error: a new gateway knows nothing of them.
//
// Not thread-safe: one thread per Client.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <zmq.hpp>

namespace moeline::sdk {

// Structured output (OpenAI's response_format).
enum class StructuredOutput : uint8_t {
  kNone,        // free text
  kJsonObject,  // any JSON object
  kJsonSchema,  // a document the JSON Schema in GenerateOptions::json_schema accepts
  // That document inside Qwen's <tool_call> tags: a forced tool call (the HTTP front's
  // tool_choice "required" or a named function, for templates that write Hermes-style calls).
  kHermesToolCall,
};

// Where structured output's grammar begins on a model that thinks in <think> blocks (Qwen3,
// DeepSeek-R1): at once, or after the reasoning block ("</think>" ends it; any text before).
enum class ReasoningBlock : uint8_t {
  kNone,     // the document from the first token
  kMayOpen,  // after a block the answer may open at its start, or at once if it opens none
  kOpen,     // after the block the prompt opened (its template ends the prompt with <think>)
};

struct GenerateOptions {
  std::string prompt;           // text, tokenized by the gateway; or
  std::vector<int32_t> tokens;  // token ids
  int64_t max_tokens = 16;
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;
  double top_p = 1.0;
  std::optional<uint64_t> seed;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int64_t min_tokens = 0;           // no end-of-sequence or stop token before this many (vLLM's)
  double min_p = 0.0;               // keep tokens at least min_p times as likely as the best
  double presence_penalty = 0.0;    // OpenAI's, in [-2, 2], on tokens already generated
  double frequency_penalty = 0.0;   // likewise, per occurrence
  double repetition_penalty = 1.0;  // > 0, on prompt and output tokens (1: off)
  // Each token's log-probability (Event::logprobs), and the top_logprobs (0..20) most likely
  // tokens' with it.
  bool logprobs = false;
  int32_t top_logprobs = 0;
  // Every prompt token's log-probability after the first, under the tokens before it, with the
  // top_logprobs most likely tokens' (Event::prompt_logprobs; OpenAI's echo with logprobs). The
  // prompt is then computed in full: no cached work is reused for it.
  bool prompt_logprobs = false;
  // OpenAI's logit_bias: (token id, bias in [-100, 100]) added to that token's logit before the
  // penalties and the choice, greedy included; each token at most once.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // The answer is constrained token by token to a JSON document: properties in the schema's
  // order, the end only where the document is complete (the gateway refuses a schema outside
  // the supported subset with InvalidSampling, naming the keyword).
  StructuredOutput structured = StructuredOutput::kNone;
  std::string json_schema;                           // the schema's text, for kJsonSchema
  ReasoningBlock reasoning = ReasoningBlock::kNone;  // with structured output only
  std::string tenant;
  uint32_t deadline_ms = 0;  // 0: the gateway's default
  bool add_special_tokens = true;
  // false: the events' text keeps the special tokens the model writes (the stopping token aside);
  // a gateway older than schema 1.17 skips them regardless.
  bool skip_special_tokens = true;
  // Which reuse the request opts into: "" (the tenant's exact levels), "exact", "none",
  // "approximate" (also response and blended reuse, where the tenant allows them), "response",
  // "blend".
  std::string reuse;
  // This request's API key, where it is not the connection's (Credentials::api_key): a front end
  // such as the HTTP stage passes on each of its callers' keys.
  std::string api_key;
};

struct Usage {
  uint32_t prompt_tokens = 0, completion_tokens = 0, reused_tokens = 0;
  std::string reuse_level;  // none, prefix, full, result, response, blend
  // For a request that asked for approximate reuse: what became of it (response, blend, shadow,
  // no_candidate, rejected, disabled, not_allowed), and the nearest cached prompt's similarity.
  std::string approximate;
  float similarity = 0;
};

struct Timings {
  double queue_ms = 0, prefill_ms = 0, ttft_ms = 0, total_ms = 0;
};

enum class EventKind { kAccepted, kDelta, kFinished, kError };

// A generated token's log-probability under the model's distribution, and the most likely
// tokens' (id, log-probability), best first.
struct TokenLogprob {
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

struct Event {
  uint64_t client_request_id = 0;
  uint64_t request_id = 0;
  EventKind kind = EventKind::kAccepted;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprob> logprobs;  // one per token id, where the request asked
  // On the first Delta, where the request asked: the prompt's token ids as the gateway read them
  // (tokenized there from a text prompt), and one entry per prompt token after the first.
  std::vector<int32_t> prompt_token_ids;
  std::vector<TokenLogprob> prompt_logprobs;
  std::string finish_reason;
  Usage usage;
  Timings timings;
  int error_code = 0;
  std::string error_name;
  std::string error_message;
  bool terminal() const { return kind == EventKind::kFinished || kind == EventKind::kError; }
};

struct Result {
  uint64_t request_id = 0;
  std::vector<int32_t> ids;
  std::vector<TokenLogprob> logprobs;
  std::vector<int32_t> prompt_ids;            // where the request asked for prompt_logprobs
  std::vector<TokenLogprob> prompt_logprobs;  // one per prompt id after the first
  std::string text;
  std::string finish_reason;
  Usage usage;
  Timings timings;
};

class ClientError : public std::runtime_error {
 public:
  ClientError(int code, std::string name, const std::string& message)
      : std::runtime_error(name + ": " + message), code_(code), name_(std::move(name)) {}
  int code() const { return code_; }
  const std::string& name() const { return name_; }

 private:
  int code_;
  std::string name_;
};

class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How the client proves itself. `api_key` (from `moeline keys add`) goes with every request and
// control command where the gateway has a keys file; it names the tenant and the role.
// `server_key` (the gateway's public Curve key: 40 Z85 characters, or the path of gateway.pub)
// turns on CurveZMQ for a tcp:// endpoint, with a key pair made for this connection.
struct Credentials {
  std::string api_key;
  std::string server_key;
};

class Client {
 public:
  explicit Client(std::string endpoint,
                  std::chrono::milliseconds timeout = std::chrono::seconds(60),
                  Credentials credentials = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends the request; returns its client_request_id.
  uint64_t start(const GenerateOptions& options);
  // The next event of any request in flight; nullopt after `timeout` without one, or as soon as
  // the wake descriptor (set_wake_fd) is readable: the caller drains it.
  std::optional<Event> next_event(std::chrono::milliseconds timeout);
  // A descriptor (an eventfd, a pipe's read end) that another thread makes readable to end a
  // wait in next_event early: how a thread that owns this Client learns that it has new work.
  void set_wake_fd(int fd) { wake_fd_ = fd; }
  Result generate(const GenerateOptions& options,
                  const std::function<void(const Event&)>& on_event = {});
  void cancel(uint64_t client_request_id);
  void feedback(uint64_t client_request_id, float score, const std::string& comment = {});
  // An operator command ("status"); returns the reply's JSON text.
  std::string control(const std::string& command, const std::string& arguments = {});
  // Cancels every request in flight (best effort), drops them and opens a fresh connection.
  void reconnect();
  size_t in_flight() const { return in_flight_.size(); }

 private:
  std::optional<Event> receive(std::chrono::milliseconds timeout);
  void open();
  void close_socket();
  // The gateway went away: every open request ends with an error event (queued in pending_).
  void connection_lost();
  // Whether an event from the gateway belongs to a request still in flight (its terminal event
  // ends that).
  bool still_in_flight(const Event& event);

  std::string endpoint_;
  std::chrono::milliseconds timeout_;
  Credentials credentials_;
  zmq::context_t context_{1};
  std::unique_ptr<zmq::socket_t> socket_;
  // Disconnect events of socket_ (a PAIR on the socket monitor): the gateway died or restarted.
  std::unique_ptr<zmq::socket_t> monitor_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, bool> in_flight_;
  std::deque<Event> pending_;  // events received while waiting for another request's
  // The events of a StreamEventBatch that receive() has not returned yet, in their order: each is
  // returned before anything newer is read from the socket.
  std::deque<Event> unread_;
  std::deque<std::string> control_replies_;
  bool awaiting_control_ = false;  // receive() returns as soon as a control reply is queued
  int wake_fd_ = -1;
};

const char* error_name(int code);

}  // namespace moeline::sdk
