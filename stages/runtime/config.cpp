#include "stages/runtime/config.h"
#include "base/environment.h"
#include "base/suggest.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace moeline::runtime {
namespace {

std::string env_name(const std::string& key) {
  std::string name = "MOELINE_";
  for (char c : key) name += c == '-' ? '_' : static_cast<char>(std::toupper(c));
  return name;
}

std::string dashed(std::string key) {
  for (char& c : key)
    if (c == '_') c = '-';
  return key;
}

std::string scalar_text(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "true" : "false";
  return value.dump();
}

}  // namespace

Config Config::load(const std::string& stage, std::span<const ConfigKey> keys, int argc,
                    char** argv) {
  Config config;
  std::map<std::string, const ConfigKey*> known;
  auto known_flags = [&keys] {
    std::vector<std::string> flags = {"--config", "--help"};
    for (const ConfigKey& key : keys) flags.push_back("--" + key.name);
    return flags;
  };
  for (const ConfigKey& key : keys) {
    known[key.name] = &key;
    config.values_[key.name] = {key.default_value, "default"};
  }

  // Flags first only to find --config; they are applied last.
  std::vector<std::pair<std::string, std::string>> flags;
  std::string config_file;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      config.help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) throw ConfigError("unexpected argument '" + arg + "'");
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "config") {
      if (!has_value) {
        if (i + 1 >= argc) throw ConfigError("--config needs a file");
        value = argv[++i];
      }
      config_file = value;
      continue;
    }
    auto it = known.find(name);
    if (it == known.end())
      throw ConfigError("unknown option '--" + name + "' for " + stage +
                        did_you_mean("--" + name, known_flags()));
    if (!has_value) {
      if (it->second->is_switch) {
        value = "true";
      } else {
        if (i + 1 >= argc) throw ConfigError("--" + name + " needs a value");
        value = argv[++i];
      }
    }
    flags.emplace_back(name, value);
  }

  if (!config_file.empty()) {
    std::ifstream in(config_file);
    if (!in) throw ConfigError("cannot read config file " + config_file);
    nlohmann::json file;
    try {
      file = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw ConfigError("config file " + config_file + " is not valid JSON: " + e.what());
    }
    if (!file.is_object()) throw ConfigError("config file " + config_file + " must hold an object");
    // Top-level keys are shared by every stage (each takes those it has); a stage's own section
    // names only its settings, so a key it does not have there is a mistake, not ignored.
    auto apply = [&](const nlohmann::json& object, bool own_section) {
      for (auto& [raw_key, value] : object.items()) {
        if (value.is_object()) continue;  // another stage's section
        const std::string key = dashed(raw_key);
        if (known.count(key))
          config.values_[key] = {scalar_text(value), "file"};
        else if (own_section)
          throw ConfigError("config file " + config_file + ": the \"" + stage +
                            "\" section has no setting '" + raw_key + "'" +
                            did_you_mean("--" + key, known_flags()));
      }
    };
    apply(file, false);
    if (auto section = file.find(stage); section != file.end() && section->is_object())
      apply(*section, true);
  }
  for (const ConfigKey& key : keys) {
    if (const char* env = env::get_setting(env_name(key.name).c_str()); env != nullptr)
      config.values_[key.name] = {env, "env"};
  }
  for (auto& [name, value] : flags) config.values_[name] = {value, "flag"};
  return config;
}

const Config::Value& Config::find(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw ConfigError("internal: no config key '" + name + "'");
  return it->second;
}

const std::string& Config::text(const std::string& name) const {
  return find(name).text;
}
const std::string& Config::source(const std::string& name) const {
  return find(name).source;
}

int64_t Config::integer(const std::string& name) const {
  const Value& value = find(name);
  int64_t out = 0;
  const char* end = value.text.data() + value.text.size();
  auto [ptr, ec] = std::from_chars(value.text.data(), end, out);
  if (ec != std::errc() || ptr != end || value.text.empty())
    throw ConfigError(name + " expects an integer, got '" + value.text + "' (from " + value.source +
                      ")");
  return out;
}

double Config::number(const std::string& name) const {
  const Value& value = find(name);
  char* end = nullptr;
  const double out = std::strtod(value.text.c_str(), &end);
  if (value.text.empty() || end != value.text.c_str() + value.text.size())
    throw ConfigError(name + " expects a number, got '" + value.text + "' (from " + value.source +
                      ")");
  return out;
}

bool Config::flag(const std::string& name) const {
  const Value& value = find(name);
  if (value.text == "true" || value.text == "1" || value.text == "yes") return true;
  if (value.text == "false" || value.text == "0" || value.text == "no" || value.text.empty())
    return false;
  throw ConfigError(name + " expects true or false, got '" + value.text + "' (from " +
                    value.source + ")");
}

nlohmann::json Config::to_json() const {
  nlohmann::json out = nlohmann::json::object();
  for (auto& [name, value] : values_) out[name] = value.text;
  return out;
}

std::string Config::usage(const std::string& stage, std::span<const ConfigKey> keys) {
  std::ostringstream out;
  out << "usage: moeline " << stage << " [--config FILE] [--key value ...]\n\n";
  out << "Each key can also come from the config file (top level, or the \"" << stage
      << "\" section) or the environment (MOELINE_KEY).\n\n";
  for (const ConfigKey& key : keys) {
    std::string head = "  --" + key.name;
    if (head.size() < 26) head.resize(26, ' ');
    out << head << ' ' << key.help;
    if (!key.default_value.empty()) out << " (default: " << key.default_value << ')';
    out << '\n';
  }
  return out.str();
}

std::vector<std::string> parse_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    if (comma > start) out.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

uint64_t parse_bytes(const std::string& text) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw ConfigError("'" + text + "' is not a size (e.g. 512MiB)");
  }
  std::string unit = text.substr(pos);
  static const std::map<std::string, double> units = {{"", 1},
                                                      {"B", 1},
                                                      {"KB", 1e3},
                                                      {"MB", 1e6},
                                                      {"GB", 1e9},
                                                      {"KiB", 1024.0},
                                                      {"MiB", 1048576.0},
                                                      {"GiB", 1073741824.0},
                                                      {"TB", 1e12},
                                                      {"TiB", 1099511627776.0}};
  auto it = units.find(unit);
  const double bytes = value * (it == units.end() ? 0.0 : it->second);
  // 2^64: anything at or above it (and NaN, infinities) is not a size a uint64 can hold.
  if (it == units.end() || !std::isfinite(value) || value < 0 || bytes >= 18446744073709551616.0)
    throw ConfigError("'" + text + "' is not a size (e.g. 512MiB)");
  return static_cast<uint64_t>(bytes);
}

}  // namespace moeline::runtime
