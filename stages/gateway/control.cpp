#include "stages/gateway/control.h"

#include <stdexcept>

#include "reuse/records.h"

namespace moeline::stages {

ControlResult ControlCommands::run(const std::string& name, const std::string& arguments) {
  const nlohmann::json args = nlohmann::json::parse(arguments, nullptr, false);
  if (name == "reuse") return set_reuse(args);
  if (name == "approximate") return set_approximate(args);
  if (name == "drain") return drain(args);
  if (name == "status") return status();
  return {false,
          "unknown command '" + name.substr(0, 64) + "' (known: status, reuse, approximate, drain)",
          nlohmann::json::object()};
}

// {"tenant": "acme" | "*", "levels": "prefix,full"}: effective for the next request.
ControlResult ControlCommands::set_reuse(const nlohmann::json& args) {
  ControlResult out;
  try {
    if (!args.is_object() || !args.contains("levels") || !args["levels"].is_string())
      throw std::invalid_argument(
          "reuse expects {\"levels\": \"prefix,full,result|none|all\", \"tenant\": \"NAME|*\"}");
    if (args.contains("tenant") && !args["tenant"].is_string())
      throw std::invalid_argument("reuse: \"tenant\" must be a string (a name or \"*\")");
    const uint32_t levels = reuse::parse_levels(args["levels"].get<std::string>());
    const std::string tenant = args.value("tenant", "*");
    reuse_.policy().set_levels(tenant, levels);
    log_.info("reuse_policy", {{"tenant", tenant}, {"levels", reuse::levels_text(levels)}});
    out.text = "reuse for " + tenant + ": " + reuse::levels_text(levels);
  } catch (const std::invalid_argument& e) {
    out.ok = false;
    out.text = e.what();
  }
  out.body["reuse"] = reuse_.policy_json();
  return out;
}

// {"enabled": true|false}: an operator's switch (on again after a rollback, or off).
ControlResult ControlCommands::set_approximate(const nlohmann::json& args) {
  ControlResult out;
  if (!args.is_object() || !args.contains("enabled") || !args["enabled"].is_boolean()) {
    out.ok = false;
    out.text = "approximate expects {\"enabled\": true|false}";
  } else {
    const bool enabled = args["enabled"].get<bool>();
    reuse_.set_enabled(enabled);
    out.text = std::string("approximate reuse ") + (enabled ? "on" : "off");
  }
  out.body["approximate"] = reuse_.controller_json();
  return out;
}

// {"replica": "decode-1"}: that replica gets no new work (stop it once it holds none);
// {}: this gateway drains (as on SIGTERM) and exits.
ControlResult ControlCommands::drain(const nlohmann::json& args) {
  ControlResult out;
  if (!args.is_object() || (args.contains("replica") && !args["replica"].is_string())) {
    out.ok = false;
    out.text = "drain expects {\"replica\": \"NAME\"} or {} (the gateway itself)";
  } else if (args.contains("replica")) {
    const std::string replica = args["replica"].get<std::string>();
    out.ok = hub_.drain(replica);
    out.text = out.ok ? "draining " + replica : "no replica named '" + replica.substr(0, 64) + "'";
    if (out.ok) out.body["draining"] = replica;
  } else {
    out.text = hooks_.drain_gateway();
    out.body["draining"] = "gateway";
  }
  return out;
}

ControlResult ControlCommands::status() {
  ControlResult out;
  out.body = hooks_.requests();
  out.body["reuse"] = reuse_.policy_json();
  out.body["approximate"] = reuse_.controller_json();
  out.body["peers"] = nlohmann::json::array();
  for (const auto& [identity, peer] : hub_.peers())
    out.body["peers"].push_back({{"stage", wire::stage_name(peer.stage)},
                                 {"replica", peer.replica},
                                 {"pid", peer.pid},
                                 {"credits", peer.credits},
                                 {"queue_depth", peer.queue_depth},
                                 {"active", peer.active},
                                 {"http_port", peer.http_port},
                                 {"draining", peer.draining}});
  return out;
}

}  // namespace moeline::stages
