#include "cli/client_command.h"

#include <charconv>
#include <cstring>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/environment.h"
#include "base/suggest.h"
#include "cli/args.h"
#include "schemas/wire.h"
#include "sdk/client.h"

namespace moeline::cli {
namespace {

using sdk::Client;
using sdk::ClientError;
using sdk::Credentials;
using sdk::Event;
using sdk::GenerateOptions;
using sdk::Result;
using sdk::TimeoutError;
using sdk::Timings;
using sdk::TokenLogprob;
using sdk::Usage;

constexpr const char* kUsage =
    R"(usage: moeline client generate --endpoint EP (--prompt TEXT | --tokens 1,2,3) [options]
       moeline client status --endpoint EP
       moeline client reuse --endpoint EP --levels LEVELS [--tenant NAME]
       moeline client approximate --endpoint EP on|off
       moeline client drain --endpoint EP [--replica NAME]

generate streams the text to stdout as it arrives; with --json it prints one JSON object at the
end instead: ids, text, finish_reason, usage, timings (milliseconds).

reuse LEVELS: prefix, full, result, response, blend (comma-separated), or exact, approximate, all,
none; for one tenant or (no --tenant) for all. approximate turns approximate reuse on or off for
the whole stack (an operator's switch; the rollback controller may also turn it off). drain stops
sending work to one replica (--replica, a name from `moeline stack status`: it finishes what it
holds and is then idle, ready to be stopped), or without --replica drains the gateway itself (as
on SIGTERM: it refuses new requests, finishes what it holds, then exits). Operator commands need
an operator key where the gateway has a keys file.

  --endpoint EP        the gateway's client endpoint (ipc://... or tcp://host:port);
                       default: $MOELINE_ENDPOINT
  --prompt TEXT        prompt text (tokenized by the gateway)
  --tokens IDS         prompt token ids, comma-separated
  --max-tokens N       tokens to generate (default 16)
  --temperature T      0 = greedy (default 0)
  --top-k K            keep the K most likely tokens (default 0 = all)
  --top-p P            nucleus mass in (0, 1] (default 1)
  --seed S             sampling seed
  --stop-ids IDS       extra stop token ids
  --ignore-eos         do not stop at end-of-sequence tokens
  --min-tokens N       no end-of-sequence or stop token before N tokens
  --min-p P, --presence-penalty X, --frequency-penalty X, --repetition-penalty R,
  --logit-bias T=B,..., --json-object, --json-schema FILE, --reasoning may-open|open
                       as `moeline run` takes them
  --logprobs N         with --json: each token's log-probability and the N (0..20) most likely
                       tokens' ("logprobs": [{"logprob", "top": [[id, logprob], ...]}])
  --prompt-logprobs N  with --json: the same for every prompt token after the first
                       ("prompt_logprobs"; the prompt is computed in full, without reuse)
  --no-special         do not add the tokenizer's special tokens (BOS) to --prompt
  --tenant NAME        tenant (default: "default")
  --reuse MODE         exact (default), none, or approximate: also reuse the work of a nearly
                       identical earlier prompt (its answer for a deterministic request, or its KV
                       blended with a partial recomputation) where the tenant allows it and the
                       decision rule judges it safe; usage.approximate says what became of it
  --deadline-ms N      the request's deadline (default: the gateway's)
  --timeout-ms N       give up when the stack is silent this long (default 60000)
  --json               one JSON object at the end

every command:
  --api-key KEY        the API key (moeline keys add) where the gateway has a keys file;
                       default: $MOELINE_API_KEY
  --server-key KEY     the gateway's public Curve key (40 Z85 characters, or the path of
                       gateway.pub) for a tcp:// endpoint with Curve; default: $MOELINE_SERVER_KEY
)";

class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// --api-key and --server-key apply to every subcommand (taken out of the arguments first).
Credentials g_credentials;

nlohmann::json usage_json(const Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens}, {"completion_tokens", usage.completion_tokens},
          {"reused_tokens", usage.reused_tokens}, {"reuse_level", usage.reuse_level},
          {"approximate", usage.approximate},     {"similarity", usage.similarity}};
}

nlohmann::json timings_json(const Timings& timings) {
  return {{"queue_ms", timings.queue_ms},
          {"prefill_ms", timings.prefill_ms},
          {"ttft_ms", timings.ttft_ms},
          {"total_ms", timings.total_ms}};
}

int generate(int argc, char** argv) {
  GenerateOptions options;
  std::string endpoint;
  if (const char* env = env::get(env::kEndpoint)) endpoint = env;
  bool json = false;
  int64_t timeout_ms = 60000;
  bool has_prompt = false;
  std::map<std::string, bool> takes_value = {
      {"--endpoint", true},    {"--prompt", true},     {"--tokens", true}, {"--tenant", true},
      {"--deadline-ms", true}, {"--timeout-ms", true}, {"--reuse", true},  {"--json", false},
      {"--no-special", false}, {"--logprobs", true}};
  takes_value.insert(sampling_flags().begin(), sampling_flags().end());
  for (int i = 0; i < argc; ++i) {
    const std::string flag = argv[i];
    auto known = takes_value.find(flag);
    if (known == takes_value.end()) throw UsageError(unknown_option(flag, kUsage));
    std::string value;
    if (known->second) {
      if (i + 1 >= argc) throw UsageError(flag + " needs a value");
      value = argv[++i];
    }
    if (parse_sampling_flag(flag, value, options)) continue;
    if (flag == "--endpoint")
      endpoint = value;
    else if (flag == "--prompt")
      options.prompt = value, has_prompt = true;
    else if (flag == "--tokens")
      options.tokens = parse_id_list(flag, value);
    else if (flag == "--tenant")
      options.tenant = value;
    else if (flag == "--reuse")
      options.reuse = value;
    else if (flag == "--deadline-ms")
      options.deadline_ms = parse_number<uint32_t>(flag, value);
    else if (flag == "--timeout-ms")
      timeout_ms = parse_number<int64_t>(flag, value);
    else if (flag == "--json")
      json = true;
    else if (flag == "--no-special")
      options.add_special_tokens = false;
  }
  if (endpoint.empty()) throw UsageError("--endpoint is required (or set MOELINE_ENDPOINT)");
  if (has_prompt == !options.tokens.empty())
    throw UsageError("give either --prompt TEXT or --tokens IDS");
  if (has_prompt && options.prompt.empty()) throw UsageError("--prompt is empty");
  if (!wire::is_reuse_mode(options.reuse))
    throw UsageError("--reuse must be exact, none, approximate, response or blend, not '" +
                     options.reuse + "'");

  Client client(endpoint, std::chrono::milliseconds(timeout_ms), g_credentials);
  try {
    Result result = client.generate(options, [&](const Event& event) {
      if (!json && !event.text.empty()) std::cout << event.text << std::flush;
    });
    if (json) {
      nlohmann::json out = {{"request_id", result.request_id},
                            {"ids", result.ids},
                            {"text", result.text},
                            {"finish_reason", result.finish_reason},
                            {"usage", usage_json(result.usage)},
                            {"timings", timings_json(result.timings)}};
      auto logprobs_json = [](const std::vector<TokenLogprob>& entries) {
        nlohmann::json logprobs = nlohmann::json::array();
        for (const TokenLogprob& token : entries) {
          nlohmann::json top = nlohmann::json::array();
          for (const auto& [id, logprob] : token.top) top.push_back({id, logprob});
          logprobs.push_back({{"logprob", token.logprob}, {"top", top}});
        }
        return logprobs;
      };
      if (options.logprobs) out["logprobs"] = logprobs_json(result.logprobs);
      if (options.prompt_logprobs) {
        out["prompt_ids"] = result.prompt_ids;
        out["prompt_logprobs"] = logprobs_json(result.prompt_logprobs);
      }
      std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    } else {
      std::cout << '\n';
    }
    return 0;
  } catch (const ClientError& e) {
    if (!json) std::cout << '\n';
    std::cerr << "moeline: error: " << e.what() << '\n';
    return 1;
  } catch (const TimeoutError& e) {
    std::cerr << "moeline: error: " << e.what() << '\n';
    return 1;
  }
}

// Turns exact reuse levels on or off, for one tenant or (no --tenant) for all; effective for the
// next request.
int reuse(int argc, char** argv) {
  std::string endpoint, levels, tenant = "*";
  if (const char* env = env::get(env::kEndpoint)) endpoint = env;
  for (int i = 0; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw UsageError(flag + " needs a value");
    if (flag == "--endpoint")
      endpoint = argv[++i];
    else if (flag == "--levels")
      levels = argv[++i];
    else if (flag == "--tenant")
      tenant = argv[++i];
    else
      throw UsageError(unknown_option(flag, kUsage));
  }
  if (endpoint.empty()) throw UsageError("--endpoint is required");
  if (levels.empty()) throw UsageError("--levels is required (prefix,full,result, all or none)");
  Client client(endpoint, std::chrono::seconds(10), g_credentials);
  const nlohmann::json args = {{"levels", levels}, {"tenant", tenant}};
  std::cout << nlohmann::json::parse(client.control("reuse", args.dump())).dump(2) << '\n';
  return 0;
}

// Turns approximate reuse on or off for the whole stack (after a rollback: on again).
int approximate(int argc, char** argv) {
  std::string endpoint, state;
  if (const char* env = env::get(env::kEndpoint)) endpoint = env;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--endpoint" && i + 1 < argc)
      endpoint = argv[++i];
    else if ((arg == "on" || arg == "off") && state.empty())
      state = arg;
    else
      throw UsageError("unknown argument '" + arg + "'");
  }
  if (endpoint.empty()) throw UsageError("--endpoint is required");
  if (state.empty()) throw UsageError("say on or off");
  Client client(endpoint, std::chrono::seconds(10), g_credentials);
  const nlohmann::json args = {{"enabled", state == "on"}};
  std::cout << nlohmann::json::parse(client.control("approximate", args.dump())).dump(2) << '\n';
  return 0;
}

// Drains one replica (the gateway sends it no more work) or, without --replica, the gateway.
int drain(int argc, char** argv) {
  std::string endpoint, replica;
  if (const char* env = env::get(env::kEndpoint)) endpoint = env;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--endpoint" && i + 1 < argc)
      endpoint = argv[++i];
    else if (arg == "--replica" && i + 1 < argc)
      replica = argv[++i];
    else
      throw UsageError(unknown_option(arg, kUsage));
  }
  if (endpoint.empty()) throw UsageError("--endpoint is required");
  Client client(endpoint, std::chrono::seconds(10), g_credentials);
  nlohmann::json args = nlohmann::json::object();
  if (!replica.empty()) args["replica"] = replica;
  std::cout << nlohmann::json::parse(client.control("drain", args.dump())).dump(2) << '\n';
  return 0;
}

int status(int argc, char** argv) {
  std::string endpoint;
  if (const char* env = env::get(env::kEndpoint)) endpoint = env;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--endpoint") == 0 && i + 1 < argc)
      endpoint = argv[++i];
    else
      throw UsageError(unknown_option(argv[i], kUsage));
  }
  if (endpoint.empty()) throw UsageError("--endpoint is required");
  Client client(endpoint, std::chrono::seconds(10), g_credentials);
  std::cout << nlohmann::json::parse(client.control("status")).dump(2) << '\n';
  return 0;
}

}  // namespace

int client_command(int argc, char** argv) {
  if (argc < 1 || std::strcmp(argv[0], "--help") == 0) {
    std::cout << kUsage;
    return argc < 1 ? 2 : 0;
  }
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0) {
      std::cout << kUsage;
      return 0;
    }
  const std::string sub = argv[0];
  if (const char* env = env::get(env::kApiKey)) g_credentials.api_key = env;
  if (const char* env = env::get(env::kServerKey)) g_credentials.server_key = env;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const bool api = std::strcmp(argv[i], "--api-key") == 0;
    if ((api || std::strcmp(argv[i], "--server-key") == 0) && i + 1 < argc) {
      (api ? g_credentials.api_key : g_credentials.server_key) = argv[++i];
      continue;
    }
    rest.push_back(argv[i]);
  }
  argc = static_cast<int>(rest.size());
  argv = rest.data();
  return run_reporting_errors<std::invalid_argument>(kUsage, [&] {
    if (sub == "generate") return generate(argc - 1, argv + 1);
    if (sub == "status") return status(argc - 1, argv + 1);
    if (sub == "reuse") return reuse(argc - 1, argv + 1);
    if (sub == "approximate") return approximate(argc - 1, argv + 1);
    if (sub == "drain") return drain(argc - 1, argv + 1);
    throw UsageError("unknown client command '" + sub + "'");
  });
}

}  // namespace moeline::cli
