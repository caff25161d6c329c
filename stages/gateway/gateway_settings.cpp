#include "stages/gateway/gateway_settings.h"

#include <algorithm>
#include <stdexcept>

#include "reuse/records.h"
#include "stages/common/common.h"

namespace moeline::stages {

std::vector<runtime::ConfigKey> gateway_keys() {
  std::vector<runtime::ConfigKey> keys = common_keys();
  // The gateway computes nothing, but its hub admits only stages of the same arithmetic.
  for (runtime::ConfigKey& key : arithmetic_keys()) keys.push_back(std::move(key));
  keys.push_back({"client-bind", "tcp://127.0.0.1:5555", "client endpoint (ROUTER)"});
  keys.push_back({"hub-bind", "tcp://127.0.0.1:5556", "endpoint the stage processes connect to"});
  keys.push_back({"max-prompt-tokens", "0", "longest prompt accepted (0: the context minus one)"});
  keys.push_back({"max-prompt-bytes", "1MiB", "longest prompt text accepted"});
  keys.push_back({"max-message-bytes", "4MiB", "largest client message accepted"});
  keys.push_back({"default-deadline-ms", "300000", "deadline of a request that sets none"});
  keys.push_back({"max-deadline-ms", "3600000", "upper bound on any request's deadline"});
  keys.push_back({"max-retries", "2", "restarts of a request whose replica died"});
  keys.push_back({"probe-timeout-ms", "2000",
                  "a request whose probe has not answered this long goes to prefill without "
                  "reuse (0: wait for the probe)"});
  keys.push_back({"handover-timeout-ms", "10000",
                  "a decode replica that has not confirmed a hand-over this long after prefill "
                  "sent it: the request is retried"});
  keys.push_back({"max-in-flight", "4096", "requests in flight before new ones are refused"});
  keys.push_back({"max-decode-backlog", "64",
                  "prefilled requests waiting for a decode replica before prefill pauses"});
  keys.push_back({"tenants", "", "comma-separated tenant names accepted (empty: any)"});
  keys.push_back({"api-keys", "",
                  "keys file (moeline keys add): every request needs an API key, which names its "
                  "tenant and role; control commands need the operator role. Empty: open (the "
                  "client names its tenant)"});
  keys.push_back({"tenant-max-in-flight", "1024",
                  "requests one tenant may have in flight (0: no limit; a key may set its own)"});
  keys.push_back({"tenant-prompt-tokens-per-s", "0",
                  "prompt tokens one tenant may submit per second (0: no limit; a key may set "
                  "its own)"});
  keys.push_back({"shared-tenants", "",
                  "tenants whose cache entries are shared with each other (default: none; every "
                  "tenant reuses only its own work)"});
  keys.push_back({"reuse-levels", "prefix,full,result",
                  "reuse levels a namespace allows by default (prefix, full, result, response, "
                  "blend; exact, approximate, all, none); approximate modes also need the "
                  "request to opt in; change at run time with `moeline client reuse`"});
  keys.push_back({"approximate-enabled", "true",
                  "approximate reuse on at start (the rollback controller may turn it off)"});
  keys.push_back(
      {"approximate-hit-window-s", "300", "rollback: the served hit rate over this window..."});
  keys.push_back({"approximate-min-hit-rate", "0.05", "...must not stay under this"});
  keys.push_back({"approximate-min-lookups", "20", "...judged with at least this many lookups"});
  keys.push_back(
      {"approximate-agreement-window-s", "300", "rollback: shadow agreement over this window..."});
  keys.push_back({"approximate-max-agreement-drop", "0.03",
                  "...must not fall more than this below its baseline (the first checks)"});
  keys.push_back({"approximate-min-checks", "20",
                  "...judged with at least this many checks (also the baseline's size)"});
  keys.push_back({"approximate-feedback-window-s", "300",
                  "rollback: negative feedback on reused answers over this window..."});
  keys.push_back({"approximate-max-negative-feedback", "0.005",
                  "...must not pass this share of reused answers"});
  keys.push_back({"approximate-min-served", "20", "...judged with this much feedback"});
  keys.push_back({"approximate-probation-s", "0",
                  "after a rollback, on again after this long (0: only an operator turns it on)"});
  keys.push_back(
      {"shadow-tokens", "8", "response reuse's shadow check compares this many first tokens"});
  keys.push_back({"blend-max-kl", "0.05",
                  "a blend's shadow check agrees when the top token matches and KL(full||blend) "
                  "is at most this (nats)"});
  return keys;
}

reuse::PolicySettings reuse_settings(const runtime::Config& config) {
  reuse::PolicySettings policy;
  policy.shared_tenants = runtime::parse_list(config.text("shared-tenants"));
  try {
    policy.default_levels = reuse::parse_levels(config.text("reuse-levels"));
  } catch (const std::invalid_argument& e) {
    throw runtime::ConfigError(std::string("--reuse-levels: ") + e.what());
  }
  reuse::RollbackOptions& rollback = policy.rollback;
  rollback.hit_window_s = config.number("approximate-hit-window-s");
  rollback.min_hit_rate = config.number("approximate-min-hit-rate");
  rollback.min_lookups = static_cast<uint64_t>(config.integer("approximate-min-lookups"));
  rollback.agreement_window_s = config.number("approximate-agreement-window-s");
  rollback.max_agreement_drop = config.number("approximate-max-agreement-drop");
  rollback.min_checks = static_cast<uint64_t>(config.integer("approximate-min-checks"));
  rollback.feedback_window_s = config.number("approximate-feedback-window-s");
  rollback.max_negative_feedback = config.number("approximate-max-negative-feedback");
  rollback.min_served = static_cast<uint64_t>(config.integer("approximate-min-served"));
  rollback.probation_s = config.number("approximate-probation-s");
  policy.approximate_enabled = config.flag("approximate-enabled");
  policy.shadow_tokens = static_cast<size_t>(std::max<int64_t>(1, config.integer("shadow-tokens")));
  return policy;
}

}  // namespace moeline::stages
