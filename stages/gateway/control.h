#pragma once
// Operator commands (ControlCommand from a client with an operator's key where keys are
// required): `status`, `reuse` (a tenant's levels, or every tenant's), `approximate` (on or off)
// and `drain` (a replica, or the gateway itself).

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "stages/gateway/reuse_control.h"
#include "stages/runtime/hub.h"
#include "stages/runtime/log.h"

namespace moeline::stages {

struct ControlResult {
  bool ok = true;
  std::string text = "ok";
  nlohmann::json body = nlohmann::json::object();
};

// What the commands need of the rest of the gateway.
struct ControlHooks {
  // The requests in flight: where each is, and the gateway's own queues (for `status`).
  std::function<nlohmann::json()> requests;
  // Starts the gateway's drain; returns what to tell the operator.
  std::function<std::string()> drain_gateway;
};

class ControlCommands {
 public:
  ControlCommands(ReuseControl& reuse, runtime::Hub& hub, runtime::Logger& log, ControlHooks hooks)
      : reuse_(reuse), hub_(hub), log_(log), hooks_(std::move(hooks)) {}

  // `arguments`: the command's JSON object (malformed: the command says what it expects).
  ControlResult run(const std::string& name, const std::string& arguments);

 private:
  ControlResult set_reuse(const nlohmann::json& args);
  ControlResult set_approximate(const nlohmann::json& args);
  ControlResult drain(const nlohmann::json& args);
  ControlResult status();

  ReuseControl& reuse_;
  runtime::Hub& hub_;
  runtime::Logger& log_;
  ControlHooks hooks_;
};

}  // namespace moeline::stages
