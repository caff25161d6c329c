#pragma once
// Typed stage configuration. Every key has a default; a value is taken, lowest to highest
// precedence, from the defaults, a JSON file (--config FILE: top-level keys for every stage, an
// object named after the stage for that stage only), the environment (MOELINE_<KEY>, dashes as
// underscores) and the command line (--key value or --key=value). An unknown flag or a value of
// the wrong type is a ConfigError naming the key and where the value came from.

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace moeline::runtime {

struct ConfigKey {
  std::string name;  // dashed, as the flag: "client-bind"
  std::string default_value;
  std::string help;
  bool is_switch = false;  // a flag without value ("--json"): "true" when given
};

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Config {
 public:
  // `stage` names the section of the config file and the usage line.
  static Config load(const std::string& stage, std::span<const ConfigKey> keys, int argc,
                     char** argv);

  const std::string& text(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  double number(const std::string& name) const;
  bool flag(const std::string& name) const;
  // Where a key's value came from: default, file, env or flag.
  const std::string& source(const std::string& name) const;
  bool help_requested() const { return help_; }
  nlohmann::json to_json() const;
  static std::string usage(const std::string& stage, std::span<const ConfigKey> keys);

 private:
  struct Value {
    std::string text;
    std::string source;
  };
  const Value& find(const std::string& name) const;
  std::map<std::string, Value> values_;
  bool help_ = false;
};

// Parses sizes such as "512", "64KiB", "2GiB", "1.5GB".
uint64_t parse_bytes(const std::string& text);
// The items of a comma-separated setting ("a,b,,c" -> a, b, c).
std::vector<std::string> parse_list(const std::string& text);

}  // namespace moeline::runtime
