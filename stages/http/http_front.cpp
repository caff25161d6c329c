#include "stages/http/http_front.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <ctime>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "stages/common/common.h"
#include "stages/http/backend.h"
#include "stages/http/bridge.h"
#include "stages/http/client_link.h"
#include "stages/http/connection_threads.h"
#include "stages/http/events.h"
#include "stages/http/logprobs.h"
#include "stages/http/messages.h"
#include "stages/http/openai.h"
#include "stages/http/responses.h"
#include "stages/http/stop_matcher.h"
#include "stages/http/token_stream.h"
#include "stages/http/tokenize.h"
#include "stages/http/tool_calls.h"
#include "stages/runtime/api_keys.h"
#include "stages/runtime/service.h"

namespace moeline::stages {
namespace {

using http::ApiError;
using http::Backend;
using http::CompletionRequest;
using http::Endpoint;
using http::Outcome;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

const char* endpoint_label(Endpoint endpoint) {
  switch (endpoint) {
    case Endpoint::kChat:
      return "chat";
    case Endpoint::kCompletions:
      return "completions";
    case Endpoint::kGenerate:
      return "generate";
  }
  return "other";
}

// What a request whose client left is recorded as (nginx's 499): nobody reads the answer.
ApiError client_closed() {
  return ApiError{499, "the client closed the connection", "client_closed", "", ""};
}

ApiError timed_out(const char* what) {
  return ApiError{504, what, "timeout_error", "", ""};
}

// The request's API key: "Authorization: Bearer KEY" (the scheme's name in any case, RFC 7235,
// and spaces around the key ignored), or else "x-api-key: KEY", as Anthropic's clients send it.
std::string api_key_of(const httplib::Request& request) {
  const std::string header = request.get_header_value("Authorization");
  constexpr std::string_view kBearer = "bearer";
  if (header.empty()) return request.get_header_value("x-api-key");
  if (header.size() <= kBearer.size() ||
      !std::equal(kBearer.begin(), kBearer.end(), header.begin(),
                  [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); }))
    return {};
  const size_t start = header.find_first_not_of(' ', kBearer.size());
  if (start == kBearer.size() || start == std::string::npos) return {};  // "BearerX", "Bearer "
  const size_t end = header.find_last_not_of(' ');
  return header.substr(start, end + 1 - start);
}

class HttpFront {
 public:
  HttpFront(const runtime::Config& config, runtime::StageService& service)
      : service_(service), log_(service.log), backends_(config, service) {
    request_timeout_ =
        std::chrono::seconds(std::max<int64_t>(1, config.integer("request-timeout-s")));
    const double stream_head_s = config.number("stream-head-s");
    if (!(stream_head_s >= 0 && stream_head_s <= 3600))
      throw runtime::ConfigError("--stream-head-s must be 0 to 3600");
    stream_head_ = std::chrono::milliseconds(static_cast<int64_t>(stream_head_s * 1000));
    max_body_bytes_ = runtime::parse_bytes(config.text("max-body-bytes"));
    if (!config.text("api-keys").empty()) api_keys_.emplace(config.text("api-keys"));
    for (std::string origin : runtime::parse_list(config.text("allowed-origins"))) {
      origin.erase(0, origin.find_first_not_of(' '));
      while (!origin.empty() && (origin.back() == '/' || origin.back() == ' ')) origin.pop_back();
      if (!origin.empty()) allowed_origins_.push_back(origin);
    }
    threads_ =
        static_cast<size_t>(std::clamp<int64_t>(config.integer("max-connections"), 4, 65536));
    write_timeout_ms_ = std::clamp<int64_t>(config.integer("write-timeout-ms"), 10, 600000);
    send_buffer_bytes_ = static_cast<int>(
        std::min<uint64_t>(runtime::parse_bytes(config.text("send-buffer-bytes")), 64ull << 20));
    ttft_ = &service.metrics.histogram("moeline_http_ttft_seconds",
                                       "Request received to its first token written",
                                       {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
    in_flight_ = &service.metrics.gauge("moeline_http_requests_in_flight", "Requests open");
    write_failures_ = &service.metrics.counter(
        "moeline_http_stream_write_failures_total",
        "Streams cut off because a write failed: the client went away, or let its socket stay "
        "full for --write-timeout-ms");
    client_disconnects_ = &service.metrics.counter(
        "moeline_http_client_disconnects_total",
        "Requests cancelled because their client closed the connection while nothing was being "
        "written to it (waiting for a token, or for a held-back tool call or stop string); "
        "failed writes are moeline_http_stream_write_failures_total");
    token_delay_ = &service.metrics.histogram(
        "moeline_http_token_delay_seconds",
        "A streamed token's event received from the gateway to its chunk written to the client "
        "(what this stage adds per token)",
        {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1});
    created_ = static_cast<int64_t>(std::time(nullptr));
  }

  // Serves until SIGTERM/SIGINT.
  void serve(const std::string& listen) {
    const auto colon = listen.rfind(':');
    if (colon == std::string::npos) throw runtime::ConfigError("--listen wants HOST:PORT");
    const std::string host = listen.substr(0, colon);
    const int port = std::stoi(listen.substr(colon + 1));
    httplib::Server server;
    // A thread per open connection: a streaming response holds its thread while it streams.
    const size_t threads = threads_;
    server.new_task_queue = [threads] { return new http::ConnectionThreads(threads); };
    server.set_payload_max_length(max_body_bytes_);
    // Each token is a small write: Nagle's algorithm would hold it until the previous one is
    // acknowledged (up to the peer's delayed-ACK timer, tens of milliseconds).
    server.set_tcp_nodelay(true);
    server.set_read_timeout(30, 0);
    // Tokens are written by the gateway bridge's thread for every stream: a client whose socket
    // stays full this long is cut off (its request cancelled) rather than stall the others.
    server.set_write_timeout(write_timeout_ms_ / 1000, (write_timeout_ms_ % 1000) * 1000);
    server.set_keep_alive_timeout(30);
    server.set_keep_alive_max_count(1000);
    routes(server);
    // cpp-httplib listens with a backlog of 5 (a compile-time constant of the Debian library): a
    // burst of connections overflows it, and clients see resets and retransmission delays. The
    // socket is listened on again with the system's limit once bound.
    int listener = -1;
    const int send_buffer = send_buffer_bytes_;
    server.set_socket_options([&listener, send_buffer](int socket) {
      int yes = 1;
      setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
      // Accepted connections inherit it: the kernel memory one stream may hold unsent.
      if (send_buffer > 0)
        setsockopt(socket, SOL_SOCKET, SO_SNDBUF, &send_buffer, sizeof(send_buffer));
      listener = socket;
    });
    if (!server.bind_to_port(host, port)) throw std::runtime_error("cannot listen on " + listen);
    if (listener >= 0 && ::listen(listener, SOMAXCONN) != 0)
      log_.warn("listen_backlog", {{"detail", "cannot raise the listen backlog"}});
    std::atomic<bool> listen_returned{false};
    std::thread stopper([&] {
      while (!runtime::StageService::stop_requested() &&
             !runtime::StageService::drain_requested() && !listen_returned.load()) {
        service_.tick();  // the loop of this stage is the server: alive while it listens
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      // stop() does nothing until listening has begun (StageService::stop_http).
      while (!server.is_running() && !listen_returned.load())
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      server.stop();
    });
    log_.info("listening", {{"address", listen},
                            {"model", backends_.primary().name},
                            {"fallback", backends_.fallback() ? backends_.fallback()->name
                                                              : std::string("none")},
                            {"max_connections", static_cast<int64_t>(threads)}});
    server.listen_after_bind();
    listen_returned.store(true);
    stopper.join();
  }

 private:
  // Browsers' cross-origin rules (CORS), for the origins of --allowed-origins only: a web page of
  // another origin may call the API, with its key, only when the operator said so.
  std::string allowed_origin(const httplib::Request& request) const {
    const std::string origin = request.get_header_value("Origin");
    if (origin.empty()) return {};
    for (const std::string& allowed : allowed_origins_)
      if (allowed == "*" || allowed == origin) return allowed == "*" ? "*" : origin;
    return {};
  }

  void cors(httplib::Server& server) {
    if (allowed_origins_.empty()) return;
    server.set_post_routing_handler(
        [this](const httplib::Request& request, httplib::Response& response) {
          const std::string origin = allowed_origin(request);
          if (origin.empty()) return;
          response.set_header("Access-Control-Allow-Origin", origin);
          if (origin != "*") response.set_header("Vary", "Origin");
        });
    // A preflight: what a cross-origin POST with a key and a JSON body may send.
    server.Options(".*", [this](const httplib::Request& request, httplib::Response& response) {
      if (allowed_origin(request).empty()) {
        response.status = 403;
        return;
      }
      response.status = 204;
      response.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      // The headers the page's request will carry, as it asks (an allowed origin's page may
      // send what its client library sends: Anthropic's sends x-api-key, anthropic-version and
      // its own x-stainless-* headers), or the API's own.
      const std::string asked = request.get_header_value("Access-Control-Request-Headers");
      response.set_header("Access-Control-Allow-Headers",
                          asked.empty() ? "Authorization, Content-Type, x-api-key" : asked);
      response.set_header("Access-Control-Max-Age", "600");
    });
  }

  // The endpoints answered here, without the gateway (which checks the keys of everything it
  // serves): with --api-keys, a valid key too. A key's tenant and role do not matter here.
  std::optional<ApiError> refuse_without_key(const httplib::Request& request) {
    if (!api_keys_) return std::nullopt;
    std::lock_guard lock(api_keys_mutex_);
    if (auto error = api_keys_->reload_if_changed())
      log_.warn("api_keys_reload", {{"error", *error}});
    if (api_keys_->authenticate(api_key_of(request)) != nullptr) return std::nullopt;
    ApiError error;
    error.status = 401;
    error.type = "authentication_error";
    error.code = "invalid_api_key";
    error.message = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)";
    return error;
  }

  void routes(httplib::Server& server) {
    cors(server);
    server.Get("/health", [this](const httplib::Request&, httplib::Response& response) {
      const bool up = backends_.primary().bridge->connected();
      response.status = up ? 200 : 503;
      response.set_content(http::to_text(json{{"status", up ? "ok" : "gateway unreachable"}}),
                           "application/json");
    });
    server.Get("/v1/models", [this](const httplib::Request& request, httplib::Response& response) {
      if (auto error = refuse_without_key(request))
        return respond_error("models", *error, response);
      json data = json::array();
      for (const Backend* backend : {&backends_.primary(), backends_.fallback()})
        if (backend != nullptr) data.push_back(model_object(*backend));
      // Anthropic's list fields beside OpenAI's (its clients page with has_more and the ids).
      json list = {{"object", "list"}, {"data", data}, {"has_more", false}};
      list["first_id"] = data.empty() ? json(nullptr) : data.front()["id"];
      list["last_id"] = data.empty() ? json(nullptr) : data.back()["id"];
      response.set_content(http::to_text(list), "application/json");
    });
    // One model by its id (the SDKs' models.retrieve); ids may hold slashes ("org/name").
    server.Get(R"(/v1/models/(.+))",
               [this](const httplib::Request& request, httplib::Response& response) {
                 if (auto error = refuse_without_key(request))
                   return respond_error("models", *error, response);
                 const std::string id = request.matches[1];
                 const Backend* backend = backends_.find(id);
                 if (id.empty() || backend == nullptr)
                   return respond_error("models", unknown_model(id), response);
                 response.set_content(http::to_text(model_object(*backend)), "application/json");
               });
    // vLLM's tokenizer endpoints: answered here, from the model folder (stages/http/tokenize.h).
    server.Post("/tokenize", [this](const httplib::Request& request, httplib::Response& response) {
      answer_locally("tokenize", request, response, http::parse_tokenize, http::tokenize,
                     [](const auto& parsed) { return parsed.text.model; });
    });
    server.Post("/detokenize",
                [this](const httplib::Request& request, httplib::Response& response) {
                  answer_locally("detokenize", request, response, http::parse_detokenize,
                                 http::detokenize, [](const auto& parsed) { return parsed.model; });
                });
    for (const auto& [path, endpoint] : {std::pair{"/v1/chat/completions", Endpoint::kChat},
                                         std::pair{"/v1/completions", Endpoint::kCompletions},
                                         std::pair{"/generate", Endpoint::kGenerate}}) {
      const Endpoint which = endpoint;
      server.Post(path,
                  [this, which](const httplib::Request& request, httplib::Response& response) {
                    handle(which, request, response);
                  });
    }
    server.Post("/v1/responses",
                [this](const httplib::Request& request, httplib::Response& response) {
                  respond(request, response);
                });
    server.Post("/v1/messages",
                [this](const httplib::Request& request, httplib::Response& response) {
                  answer_message(request, response);
                });
    server.Post("/v1/messages/count_tokens",
                [this](const httplib::Request& request, httplib::Response& response) {
                  count_message_tokens(request, response);
                });
    // What the server itself refuses (no such path, a body over --max-body-bytes, a method not
    // served) in OpenAI's error shape too.
    server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
      if (!response.body.empty()) return;
      ApiError error;
      error.status = response.status;
      error.message = response.status == 404   ? "no such endpoint: " + request.path
                      : response.status == 413 ? std::string("the request body is too large")
                                               : "the request was refused (HTTP " +
                                                     std::to_string(response.status) + ")";
      response.set_content(http::to_text(error.body()), "application/json");
    });
    server.set_exception_handler(
        [this](const httplib::Request&, httplib::Response& response, std::exception_ptr error) {
          std::string what = "unknown error";
          try {
            std::rethrow_exception(error);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          log_.error("handler_exception", {{"error", what}});
          ApiError api;
          api.status = 500;
          api.type = "server_error";
          api.message = "internal error";
          respond_error(Endpoint::kGenerate, api, response);
        });
  }

  void respond_error(Endpoint endpoint, const ApiError& error, httplib::Response& response) {
    respond_error(endpoint_label(endpoint), error, response);
  }
  void respond_error(const char* label, const ApiError& error, httplib::Response& response) {
    if (error.status == 499) client_disconnects_->inc();
    response.status = error.status;
    if (error.status == 429) response.set_header("Retry-After", "1");
    response.set_content(http::to_text(error.body()), "application/json");
    count(label, error.status);
  }

  void count(Endpoint endpoint, int status) { count(endpoint_label(endpoint), status); }
  void count(const char* label, int status) {
    service_.metrics
        .counter("moeline_http_requests_total", "HTTP requests by endpoint and status",
                 {{"endpoint", label}, {"status", std::to_string(status)}})
        .inc();
  }

  // An endpoint the HTTP stage answers from a backend's model folder: the body parsed by `parse`,
  // the backend named by its model (`model_of`), the answer from `answer`.
  template <class Parse, class Answer, class ModelOf>
  void answer_locally(const char* label, const httplib::Request& request,
                      httplib::Response& response, Parse parse, Answer answer, ModelOf model_of) {
    if (auto error = refuse_without_key(request)) return respond_error(label, *error, response);
    auto parsed = parse(request.body);
    if (auto* error = std::get_if<ApiError>(&parsed)) return respond_error(label, *error, response);
    const auto& body = std::get<0>(parsed);
    const Backend* backend = backends_.find(model_of(body));
    if (backend == nullptr) return respond_error(label, unknown_model(model_of(body)), response);
    auto answered = answer(*backend, body);
    if (auto* error = std::get_if<ApiError>(&answered))
      return respond_error(label, *error, response);
    response.set_content(http::to_text(std::get<json>(answered)), "application/json");
    count(label, 200);
  }

  // OpenAI's model object, with Anthropic's fields beside (type, display_name, created_at).
  json model_object(const Backend& backend) const {
    char created_at[32];
    const std::time_t created = static_cast<std::time_t>(created_);
    std::tm utc{};
    gmtime_r(&created, &utc);
    std::strftime(created_at, sizeof(created_at), "%Y-%m-%dT%H:%M:%SZ", &utc);
    return {{"id", backend.name},
            {"object", "model"},
            {"created", created_},
            {"owned_by", "moeline"},
            {"max_model_len", backend.context},
            {"type", "model"},
            {"display_name", backend.name},
            {"created_at", created_at}};
  }

  ApiError unknown_model(const std::string& model) {
    ApiError error;
    error.status = 404;
    error.param = "model";
    error.code = "model_not_found";
    error.message = "The model '" + model + "' does not exist (this server serves '" +
                    backends_.primary().name + "')";
    return error;
  }

  // A choice's request: choice i answers prompt i / n (of a batch of prompts) and samples with
  // seed + i % n where a seed is given (as vLLM), so that the n choices of a prompt differ and
  // each is reproducible on its own.
  static CompletionRequest choice_request(const CompletionRequest& request, int64_t choice) {
    CompletionRequest one = request;
    const auto prompt = static_cast<size_t>(choice / request.n);
    if (!request.batch_prompts.empty()) one.prompt = request.batch_prompts[prompt];
    if (!request.batch_prompt_tokens.empty())
      one.prompt_tokens = request.batch_prompt_tokens[prompt];
    one.batch_prompts.clear();
    one.batch_prompt_tokens.clear();
    if (one.seed) *one.seed += static_cast<uint64_t>(choice % request.n);
    return one;
  }

  // A choice on its way: its request's events, the first of them, its prompt's length.
  struct Started {
    std::shared_ptr<http::RequestChannel> channel;
    std::optional<sdk::Event> first;  // none yet: a stream's head went out before it
    uint32_t prompt_tokens = 0;
    http::ReasoningStart reasoning = http::ReasoningStart::kOff;
  };

  // Choices 1 .. n-1, sent to the backend that took choice 0 once choice 0 has its first token
  // (its prompt is then in the pipeline's reuse store, so theirs is not computed again); each
  // waited for up to its first event. An error of any is the response's.
  std::optional<ApiError> start_more_choices(const CompletionRequest& request,
                                             const std::string& api_key, Backend& backend,
                                             http::ClientLink& client,
                                             std::vector<Started>& started) {
    std::vector<std::shared_ptr<http::RequestChannel>> sent;
    std::vector<http::ReasoningStart> reasoning;
    for (int64_t i = 1; i < request.n * request.prompt_count(); ++i) {
      http::Attempt attempt = backends_.submit(choice_request(request, i), api_key, backend);
      if (attempt.refused) {
        for (const auto& channel : sent) backend.bridge->cancel(channel);
        return attempt.refused;
      }
      sent.push_back(attempt.channel);
      reasoning.push_back(attempt.reasoning);
    }
    for (size_t i = 0; i < sent.size(); ++i) {
      uint32_t prompt_tokens = 0;
      std::optional<sdk::Event> first =
          http::next_event(*sent[i], Clock::now() + request_timeout_, prompt_tokens, &client);
      std::optional<ApiError> error;
      if (!first)
        error = client.gone() ? client_closed()
                              : timed_out("no first token within the request timeout");
      else if (first->kind == sdk::EventKind::kError)
        error = http::gateway_error(first->error_code, first->error_name, first->error_message);
      if (error) {
        // The failed choice's request is over unless it timed out or its client left; the later
        // ones are cancelled here, the earlier ones (in `started`) by the caller.
        for (size_t j = i + (first ? 1 : 0); j < sent.size(); ++j) backend.bridge->cancel(sent[j]);
        return error;
      }
      started.push_back({sent[i], std::move(*first), prompt_tokens, reasoning[i]});
    }
    return std::nullopt;
  }

  // POST /v1/responses: served as the chat completion it translates to. An error is the same
  // object in both APIs.
  void respond(const httplib::Request& request, httplib::Response& response) {
    auto parsed = http::parse_responses_request(request.body);
    if (auto* error = std::get_if<ApiError>(&parsed))
      return respond_error("responses", *error, response);
    const http::ResponsesRequest& asked = std::get<http::ResponsesRequest>(parsed);
    serve_as_chat(request, response, asked.chat_body,
                  std::make_shared<http::ResponsesStream>(asked),
                  [&asked](const json& chat) { return http::response_from_chat(asked, chat); });
  }

  // POST /v1/messages (Anthropic's Messages API): served as the chat completion it translates
  // to; its errors, before the stream or in it, in Anthropic's shape.
  void answer_message(const httplib::Request& request, httplib::Response& response) {
    auto parsed = http::parse_messages_request(request.body, http::MessagesUse::kGenerate);
    if (auto* error = std::get_if<ApiError>(&parsed)) {
      respond_error("messages", *error, response);
    } else {
      const http::MessagesRequest& asked = std::get<http::MessagesRequest>(parsed);
      serve_as_chat(request, response, asked.chat_body,
                    std::make_shared<http::MessagesStream>(asked),
                    [&asked](const json& chat) { return http::message_from_chat(asked, chat); });
    }
    in_anthropic_shape(response);
  }

  // POST /v1/messages/count_tokens: the prompt's tokens as /tokenize counts the chat it
  // translates to (its system prompt, messages and tools through the chat template).
  void count_message_tokens(const httplib::Request& request, httplib::Response& response) {
    auto parsed = http::parse_messages_request(request.body, http::MessagesUse::kCountTokens);
    if (auto* error = std::get_if<ApiError>(&parsed)) {
      respond_error("count_tokens", *error, response);
    } else {
      httplib::Request as_tokenize = request;
      as_tokenize.body = std::get<http::MessagesRequest>(parsed).chat_body;
      answer_locally("count_tokens", as_tokenize, response, http::parse_tokenize, http::tokenize,
                     [](const auto& body) { return body.text.model; });
      const json counted = json::parse(response.body, nullptr, /*allow_exceptions=*/false);
      // (The status is still unset, -1, where the answer is a 200.)
      if (response.status < 400 && counted.is_object() && counted.contains("count"))
        response.set_content(http::to_text(json{{"input_tokens", counted["count"]}}),
                             "application/json");
    }
    in_anthropic_shape(response);
  }

  // An error answered in OpenAI's shape, put in Anthropic's.
  static void in_anthropic_shape(httplib::Response& response) {
    if (response.status < 400) return;
    const json body = json::parse(response.body, nullptr, /*allow_exceptions=*/false);
    response.set_content(http::to_text(http::anthropic_error_from(response.status, body)),
                         "application/json");
  }

  // A request of another API served as the chat completion `chat_body` (and counted as one in
  // moeline_http_requests_total): the answer translated by `whole` (a chat.completion to that
  // API's object), the stream's events by `translator` (a ResponsesStream or MessagesStream).
  template <class Translator, class Whole>
  void serve_as_chat(const httplib::Request& request, httplib::Response& response,
                     const std::string& chat_body, std::shared_ptr<Translator> translator,
                     Whole whole) {
    httplib::Request as_chat = request;
    as_chat.body = chat_body;
    handle(Endpoint::kChat, as_chat, response);
    if (response.status != -1 && response.status != 200) return;
    if (!response.content_provider_) {
      const json chat = json::parse(response.body, nullptr, /*allow_exceptions=*/false);
      if (chat.is_object() && chat.contains("choices"))
        response.set_content(http::to_text(whole(chat)), "application/json");
      return;
    }
    auto chat_stream = std::move(response.content_provider_);
    response.content_provider_ = [chat_stream = std::move(chat_stream), translator](
                                     size_t offset, size_t length, httplib::DataSink& sink) {
      // The chat stream writes into this sink (and waits until it is over), each write turned
      // into the events of the API it is translated to.
      httplib::DataSink chat;
      chat.write = [&](const char* data, size_t size) {
        return translator->feed(data, size, sink);
      };
      chat.done = [&] { sink.done(); };
      chat.is_writable = [&] { return !sink.is_writable || sink.is_writable(); };
      return chat_stream(offset, length, chat);
    };
  }

  void handle(Endpoint endpoint, const httplib::Request& request, httplib::Response& response) {
    const auto received = Clock::now();
    auto parsed = http::parse_request(endpoint, request.body);
    if (auto* error = std::get_if<ApiError>(&parsed))
      return respond_error(endpoint, *error, response);
    const CompletionRequest& api_request = std::get<CompletionRequest>(parsed);
    Backend* backend = backends_.find(api_request.model);
    if (backend == nullptr)
      return respond_error(endpoint, unknown_model(api_request.model), response);
    const std::string api_key = api_key_of(request);
    http::ClientLink client(request);
    in_flight_->add(1);
    // Wait for the first token (or an error) before answering: an early error gets its own
    // status instead of a 200 that carries it in the stream. A stream of one choice waits up to
    // --stream-head-s: then its head goes out and keep-alive comments until the first token, so
    // that a proxy does not cut a long prefill.
    const bool head_early = api_request.stream && endpoint != Endpoint::kGenerate &&
                            api_request.n * api_request.prompt_count() == 1 &&
                            stream_head_.count() > 0;
    http::Attempt attempt = backends_.start(
        choice_request(api_request, 0), api_key, *backend, received, received + request_timeout_,
        client, head_early ? received + stream_head_ : Clock::time_point::max());
    if (attempt.refused) {
      in_flight_->add(-1);
      return respond_error(endpoint, *attempt.refused, response);
    }
    http::GatewayBridge* bridge = attempt.backend->bridge.get();
    std::optional<sdk::Event>& first = attempt.first;
    const uint32_t prompt_tokens = attempt.prompt_tokens;
    if (attempt.pending) {
      std::vector<Started> started;
      started.push_back({attempt.channel, std::nullopt, prompt_tokens, attempt.reasoning});
      return stream(endpoint, api_request, *attempt.backend, std::move(started),
                    completion_base(endpoint, attempt, *backend), response, std::move(client),
                    received);
    }
    if (!first) {
      bridge->cancel(attempt.channel);
      in_flight_->add(-1);
      return respond_error(
          endpoint,
          client.gone() ? client_closed() : timed_out("no first token within the request timeout"),
          response);
    }
    if (first->kind == sdk::EventKind::kError) {
      in_flight_->add(-1);
      return respond_error(
          endpoint, http::gateway_error(first->error_code, first->error_name, first->error_message),
          response);
    }
    ttft_->observe(std::chrono::duration<double>(Clock::now() - received).count());
    std::vector<Started> started;
    started.push_back({attempt.channel, std::move(*first), prompt_tokens, attempt.reasoning});
    if (auto error = start_more_choices(api_request, api_key, *attempt.backend, client, started)) {
      for (const Started& choice : started) bridge->cancel(choice.channel);
      in_flight_->add(-1);
      return respond_error(endpoint, *error, response);
    }

    const http::Completion base = completion_base(endpoint, attempt, *backend);
    if (api_request.stream && endpoint != Endpoint::kGenerate)
      return stream(endpoint, api_request, *attempt.backend, std::move(started), base, response,
                    std::move(client));

    std::vector<http::Completion> choices;
    for (size_t i = 0; i < started.size(); ++i) {
      auto choice = collect(endpoint, choice_request(api_request, static_cast<int64_t>(i)),
                            *attempt.backend, started[i], client, base);
      if (auto* error = std::get_if<ApiError>(&choice)) {
        for (size_t j = i + 1; j < started.size(); ++j) bridge->cancel(started[j].channel);
        in_flight_->add(-1);
        return respond_error(endpoint, *error, response);
      }
      choices.push_back(std::move(std::get<http::Completion>(choice)));
      choices.back().index = static_cast<int64_t>(i);
    }
    in_flight_->add(-1);
    if (endpoint == Endpoint::kGenerate) {
      response.set_content(http::to_text(json{{"text", choices.front().text}}), "application/json");
    } else {
      response.set_content(
          http::to_text(http::completion_response(endpoint, choices, api_request.n)),
          "application/json");
    }
    count(endpoint, 200);
  }

  // What every choice of the response shares: its id, time and model (the fallback's where it
  // served the request asked of `asked`).
  http::Completion completion_base(Endpoint endpoint, const http::Attempt& attempt,
                                   const Backend& asked) {
    http::Completion base;
    base.id = http::new_completion_id(endpoint);
    base.created = static_cast<int64_t>(std::time(nullptr));
    base.model = attempt.backend->name;
    base.fallback = attempt.backend == backends_.fallback() && &asked == &backends_.primary();
    return base;
  }

  // One choice (`api_request` is the choice's: its own prompt), not streamed: its events up to the
  // end (a stop string, a silence past the request timeout or the client's leaving cancels the
  // rest).
  std::variant<http::Completion, ApiError> collect(Endpoint endpoint,
                                                   const CompletionRequest& api_request,
                                                   const Backend& backend, Started& started,
                                                   http::ClientLink& client,
                                                   const http::Completion& base) {
    http::StopMatcher stops(api_request.stop, api_request.stop_token_ids,
                            api_request.include_stop_str_in_output, api_request.min_tokens);
    Outcome outcome;
    outcome.usage.prompt_tokens = started.prompt_tokens;
    bool over = http::absorb(*started.first, stops, outcome, outcome.text);
    while (!over) {
      uint32_t ignored = 0;
      std::optional<sdk::Event> event =
          http::next_event(*started.channel, Clock::now() + request_timeout_, ignored, &client);
      if (!event) {
        outcome.error = client.gone() ? client_closed() : timed_out("the request timed out");
        break;
      }
      over = http::absorb(*event, stops, outcome, outcome.text);
    }
    if (stops.stopped() || outcome.error) backend.bridge->cancel(started.channel);
    if (outcome.error) return *outcome.error;
    http::Completion completion = base;
    completion.text = std::move(outcome.text);
    completion.finish_reason = outcome.finish_reason;
    completion.stop_reason = outcome.stop_reason;
    if (started.reasoning != http::ReasoningStart::kOff) {
      http::ReasoningParts parts = http::split_reasoning(completion.text, started.reasoning);
      completion.reasoning = std::move(parts.reasoning);
      completion.text = std::move(parts.content);
    }
    if (!api_request.chat.tools_json.empty())
      if (auto parsed = http::parse_tool_calls(
              completion.text,
              backend.chat ? backend.chat->tool_call_format() : tokenizer::ToolCallFormat::kNone,
              api_request.chat.tools_json, api_request.parallel_tool_calls,
              http::forces_bare_json_call(api_request, backend))) {
        completion.text = std::move(parsed->content);
        completion.tool_calls = std::move(parsed->calls);
        completion.finish_reason = "tool_calls";
        completion.stop_reason = nullptr;
      }
    completion.usage = outcome.usage;
    completion.usage.completion_tokens = outcome.completion_tokens;
    completion.timings = outcome.timings;
    if (api_request.score_only()) {  // the token drawn for it is left out
      completion.text.clear();
      completion.finish_reason = "length";
      completion.usage.completion_tokens = 0;
      outcome.ids.clear();
      outcome.logprobs.clear();
    }
    if (api_request.echo) completion.text = http::echo_text(api_request, backend) + completion.text;
    if (api_request.logprobs) {
      size_t offset = 0;  // the prompt's entries first, where echoed
      const http::LogprobsWriter writer(endpoint, *backend.tokenizer,
                                        api_request.return_tokens_as_token_ids);
      json echoed = api_request.echo
                        ? writer.prompt_object(outcome.prompt_ids, outcome.prompt_logprobs, offset)
                        : json(nullptr);
      completion.logprobs = writer.object(outcome.ids, outcome.logprobs, offset);
      if (api_request.echo) {
        http::LogprobsWriter::append(echoed, completion.logprobs);
        completion.logprobs = std::move(echoed);
      }
    }
    return completion;
  }

  // `received`: where the stream's head went out before its first token, when the request came
  // (its time to first token is observed when that token arrives).
  void stream(Endpoint endpoint, const CompletionRequest& api_request, const Backend& backend,
              std::vector<Started> started, const http::Completion& base,
              httplib::Response& response, http::ClientLink client,
              std::optional<Clock::time_point> received = std::nullopt) {
    count(endpoint, 200);
    response.set_header("Cache-Control", "no-cache");
    std::vector<http::StreamedResponse::Choice> choices;
    for (size_t i = 0; i < started.size(); ++i) {
      auto completion = std::make_shared<http::Completion>(base);
      completion->index = static_cast<int64_t>(i);
      choices.push_back(
          {started[i].channel, std::move(started[i].first),
           std::make_unique<http::TokenStream>(
               endpoint, choice_request(api_request, static_cast<int64_t>(i)), backend, completion,
               started[i].prompt_tokens, token_delay_, write_failures_, started[i].reasoning)});
    }
    auto streamed = std::make_shared<http::StreamedResponse>(
        endpoint, std::move(choices), api_request.include_usage, api_request.n);
    if (received)
      streamed->on_first_event([this, at = *received] {
        ttft_->observe(std::chrono::duration<double>(Clock::now() - at).count());
      });
    http::GatewayBridge* bridge = backend.bridge.get();
    auto link = std::make_shared<http::ClientLink>(std::move(client));
    response.set_chunked_content_provider(
        "text/event-stream",
        [this, streamed, link](size_t, httplib::DataSink& sink) {
          // A client that went away: false, and the releaser cancels the requests.
          // Keep-alive comments as often as the head goes out early (the proxy's patience).
          const auto keep_alive =
              stream_head_.count() > 0 ? stream_head_ : std::chrono::milliseconds(10000);
          if (!streamed->write(sink, request_timeout_, *link, keep_alive)) {
            if (link->gone()) client_disconnects_->inc();
            return false;
          }
          sink.done();
          return true;
        },
        [this, bridge, streamed](bool) {
          for (const auto& channel : streamed->unfinished()) bridge->cancel(channel);
          in_flight_->add(-1);
        });
  }

  runtime::StageService& service_;
  runtime::Logger& log_;
  http::Backends backends_;
  int64_t created_ = 0;
  std::chrono::seconds request_timeout_{600};
  std::chrono::milliseconds stream_head_{10000};
  std::vector<std::string> allowed_origins_;
  std::optional<runtime::ApiKeys> api_keys_;  // --api-keys: the local endpoints' check
  std::mutex api_keys_mutex_;                 // ApiKeys is not thread-safe
  size_t max_body_bytes_ = 0;
  size_t threads_ = 1024;
  int64_t write_timeout_ms_ = 1000;
  int send_buffer_bytes_ = 0;
  runtime::Histogram* ttft_ = nullptr;
  runtime::Gauge* in_flight_ = nullptr;
  runtime::Histogram* token_delay_ = nullptr;
  runtime::Counter* write_failures_ = nullptr;
  runtime::Counter* client_disconnects_ = nullptr;
};

int http_body(const runtime::Config& config) {
  runtime::StageService service("http", replica_name(config, "http"));
  runtime::StageService::install_signal_handlers();
  HttpFront front(config, service);
  service.start_http(config.text("http"), config.text("port-file"));
  service.set_ready(true);
  front.serve(config.text("listen"));
  service.stop_http();
  service.log.info("stopped");
  return 0;
}

std::vector<runtime::ConfigKey> http_keys() {
  std::vector<runtime::ConfigKey> keys = common_keys();
  keys.push_back({"listen", "127.0.0.1:8000", "HOST:PORT of the OpenAI-compatible API"});
  keys.push_back({"gateway", "tcp://127.0.0.1:5555", "the gateway's client endpoint"});
  keys.push_back({"server-key", "",
                  "the gateway's public Curve key (gateway.pub, or its 40 Z85 characters) for a "
                  "tcp:// gateway with Curve on (default with --curve-dir: its gateway.pub)"});
  keys.push_back({"served-model-name", "",
                  "the model name clients ask for (default: the checkpoint folder's name)"});
  keys.push_back({"chat-template", "",
                  "a Jinja chat template file used instead of the checkpoint's (as vLLM's "
                  "--chat-template: a template that writes the tools, where the model's own does "
                  "not); its tool-call format is read from it"});
  keys.push_back({"max-connections", "1024",
                  "connections served at once (a thread each; a stream holds its thread)"});
  keys.push_back({"request-timeout-s", "600",
                  "a request that waits this long for its first token, or for any next one, "
                  "ends with a 504 (a request that keeps producing tokens is never cut by it)"});
  keys.push_back({"stream-head-s", "10",
                  "a streamed request with no first token this long gets its response's head "
                  "(200), and a stream silent this long a keep-alive comment, so that a proxy "
                  "does not cut a long prefill; an error after the head comes as the stream's "
                  "error event (0: the head waits for the first token; comments every 10 s)"});
  keys.push_back({"max-request-s", "3600",
                  "the longest a request may run in all (its deadline at the gateway, which caps "
                  "it at its own --max-deadline-ms)"});
  keys.push_back({"fallback-endpoint", "",
                  "a second gateway serving a smaller model: a request the primary answers "
                  "Overloaded, or gives no first token within --fallback-ttft-ms, is served by it "
                  "(the response's model is the fallback's, and moeline.fallback is true)"});
  keys.push_back(
      {"fallback-model", "", "the fallback's checkpoint folder (its chat template and context)"});
  keys.push_back({"fallback-model-name", "", "its name (default: its folder's name)"});
  keys.push_back({"fallback-server-key", "",
                  "the fallback gateway's public Curve key (default: --server-key's)"});
  keys.push_back({"fallback-ttft-ms", "0",
                  "with a fallback: the primary's longest time to first token before the "
                  "request goes to the fallback (0: only Overloaded falls back)"});
  keys.push_back({"reasoning-parser", "auto",
                  "auto: a chat answer's <think> block (Qwen3, DeepSeek-R1, GLM-4.5: the models "
                  "whose chat template thinks) is given out as the message's reasoning_content, "
                  "not in its content; none: answers as generated"});
  keys.push_back({"max-body-bytes", "8MiB", "largest request body accepted"});
  keys.push_back({"api-keys", "",
                  "the gateway's API keys file: /v1/models, /tokenize and /detokenize, answered "
                  "here, then need a valid key too (the gateway checks every other request)"});
  keys.push_back({"allowed-origins", "",
                  "web origins whose pages may call the API from a browser (CORS), comma-separated "
                  "(https://app.example.com), or * for any; empty: none (browsers refuse "
                  "cross-origin calls)"});
  keys.push_back({"send-buffer-bytes", "0",
                  "each connection's socket send buffer (SO_SNDBUF; 0: the system's, which grows "
                  "up to net.ipv4.tcp_wmem's maximum): the unsent output a stream may hold in "
                  "the kernel"});
  keys.push_back({"write-timeout-ms", "1000",
                  "a client that reads nothing for this long while its socket is full is cut "
                  "off and its request cancelled (tokens are written by one thread for every "
                  "stream, which such a client would hold up)"});
  return keys;
}

}  // namespace

int http_main(int argc, char** argv) {
  return run_stage("http", http_keys(), argc, argv, http_body);
}

}  // namespace moeline::stages
