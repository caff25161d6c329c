#include "cli/keys_command.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "base/suggest.h"
#include "stages/runtime/api_keys.h"
#include "stages/runtime/config.h"
#include "stages/runtime/security.h"

namespace moeline::cli {
namespace {
namespace fs = std::filesystem;
using runtime::ConfigError;

constexpr const char* kUsage = R"(usage: moeline keys <command> [options]

Stage keys (CurveZMQ on every tcp:// socket; give each stage --curve-dir DIR):
  init   --dir DIR [--force]   a key directory (mode 0700): gateway.key and gateway.pub (the server
                               key; clients and stages need only gateway.pub), probe.key,
                               prefill.key, decode.key, offload.key, and stages.allow (the hub's
                               allow-list). Existing keys are kept unless --force.
  rotate --dir DIR --role R    a new key pair for R (a stage role, or gateway). A stage role's old
                               public key stays allowed until `prune`: restart its replicas with
                               the new key, then prune. A new gateway key needs every stage and
                               client restarted with the new gateway.pub.
  prune  --dir DIR --role R    allow only the current key of R on the hub (the gateway reads
                               stages.allow when it starts: restart it)

Client API keys (the gateway's --api-keys FILE; reread within a second of a change):
  add    --file FILE --tenant NAME [--role user|operator] [--max-in-flight N]
         [--prompt-tokens-per-s R]     prints the new key once; the file keeps only its SHA-256
  list   --file FILE                   id, tenant, role and limits of every key (never the key)
  remove --file FILE --id ID           revokes a key
)";

std::map<std::string, std::string> parse_flags(int argc, char** argv,
                                               const std::vector<std::string>& valued,
                                               const std::vector<std::string>& switches) {
  std::map<std::string, std::string> flags;
  for (int i = 0; i < argc; ++i) {
    const std::string flag = argv[i];
    const std::string name = flag.rfind("--", 0) == 0 ? flag.substr(2) : flag;
    if (std::find(switches.begin(), switches.end(), name) != switches.end()) {
      flags[name] = "true";
    } else if (std::find(valued.begin(), valued.end(), name) != valued.end()) {
      if (i + 1 >= argc) throw ConfigError(flag + " needs a value");
      flags[name] = argv[++i];
    } else {
      throw ConfigError(unknown_option(flag, kUsage));
    }
  }
  return flags;
}

std::string required(const std::map<std::string, std::string>& flags, const std::string& name) {
  auto it = flags.find(name);
  if (it == flags.end() || it->second.empty()) throw ConfigError("--" + name + " is required");
  return it->second;
}

bool known_role(const std::string& role) {
  if (role == "gateway") return true;
  for (const char* stage : runtime::kStageRoles)
    if (role == stage) return true;
  return false;
}

int init(int argc, char** argv) {
  const auto flags = parse_flags(argc, argv, {"dir"}, {"force"});
  const fs::path dir = required(flags, "dir");
  for (const std::string& line : runtime::init_key_directory(dir, flags.count("force") > 0))
    std::cout << line << '\n';
  std::cout << "clients and stages need " << (dir / "gateway.pub").string()
            << "; keep the .key files secret\n";
  return 0;
}

int rotate(int argc, char** argv) {
  const auto flags = parse_flags(argc, argv, {"dir", "role"}, {});
  const fs::path dir = required(flags, "dir");
  const std::string role = required(flags, "role");
  if (!known_role(role))
    throw ConfigError("--role must be gateway, probe, prefill, decode or offload");
  const runtime::KeyFile key = runtime::issue_key(dir, role);
  if (role != "gateway") {
    std::vector<runtime::AllowedKey> allowed = runtime::read_allow_list(dir / "stages.allow");
    allowed.push_back({key.keys.public_key, key.name, role});
    runtime::write_allow_list(dir / "stages.allow", allowed);
  }
  std::cout << "new " << role << " key in " << (dir / (role + ".key")).string() << '\n';
  return 0;
}

int prune(int argc, char** argv) {
  const auto flags = parse_flags(argc, argv, {"dir", "role"}, {});
  const fs::path dir = required(flags, "dir");
  const std::string role = required(flags, "role");
  const runtime::KeyFile current = runtime::read_key_file(dir / (role + ".key"));
  std::vector<runtime::AllowedKey> allowed = runtime::read_allow_list(dir / "stages.allow");
  const size_t before = allowed.size();
  std::erase_if(allowed, [&](const runtime::AllowedKey& a) {
    return a.role == role && a.public_key != current.keys.public_key;
  });
  runtime::write_allow_list(dir / "stages.allow", allowed);
  std::cout << "removed " << before - allowed.size() << " old " << role << " key(s)\n";
  return 0;
}

int add(int argc, char** argv) {
  const auto flags = parse_flags(
      argc, argv, {"file", "tenant", "role", "max-in-flight", "prompt-tokens-per-s"}, {});
  const fs::path file = required(flags, "file");
  const std::string tenant = required(flags, "tenant");
  if (!runtime::valid_tenant_name(tenant))
    throw ConfigError("--tenant: 1-64 characters of [A-Za-z0-9._-]");
  const auto role = runtime::parse_api_role(flags.count("role") ? flags.at("role") : "user");
  if (!role) throw ConfigError("--role must be user or operator");
  std::vector<runtime::ApiKeyEntry> keys = runtime::read_api_keys(file);
  auto [key, entry] = runtime::make_api_key(tenant, *role);
  try {
    if (flags.count("max-in-flight"))
      entry.max_in_flight = static_cast<uint32_t>(std::stoul(flags.at("max-in-flight")));
    if (flags.count("prompt-tokens-per-s"))
      entry.prompt_tokens_per_s = std::stod(flags.at("prompt-tokens-per-s"));
  } catch (const std::exception&) {
    throw ConfigError("--max-in-flight and --prompt-tokens-per-s take numbers");
  }
  if (entry.prompt_tokens_per_s < 0) throw ConfigError("--prompt-tokens-per-s must be >= 0");
  keys.push_back(entry);
  runtime::write_api_keys(file, keys);
  std::cerr << "moeline: key " << entry.id << " for tenant " << tenant << " ("
            << runtime::api_role_name(*role) << ") added to " << file.string()
            << "; it is shown once:\n";
  std::cout << key << '\n';
  return 0;
}

int list(int argc, char** argv) {
  const auto flags = parse_flags(argc, argv, {"file"}, {});
  std::printf("%-10s %-20s %-9s %14s %20s\n", "id", "tenant", "role", "max_in_flight",
              "prompt_tokens_per_s");
  for (const runtime::ApiKeyEntry& key : runtime::read_api_keys(required(flags, "file")))
    std::printf("%-10s %-20s %-9s %14u %20.0f\n", key.id.c_str(), key.tenant.c_str(),
                runtime::api_role_name(key.role), key.max_in_flight, key.prompt_tokens_per_s);
  return 0;
}

int remove(int argc, char** argv) {
  const auto flags = parse_flags(argc, argv, {"file", "id"}, {});
  const fs::path file = required(flags, "file");
  const std::string id = required(flags, "id");
  std::vector<runtime::ApiKeyEntry> keys = runtime::read_api_keys(file);
  const size_t before = keys.size();
  std::erase_if(keys, [&](const runtime::ApiKeyEntry& k) { return k.id == id; });
  if (keys.size() == before) throw ConfigError("no key with id " + id + " in " + file.string());
  runtime::write_api_keys(file, keys);
  std::cout << "removed key " << id << '\n';
  return 0;
}

}  // namespace

int keys_command(int argc, char** argv) {
  // `moeline stack up --help` as well as `moeline stack --help`: the usage, and nothing run.
  const bool help = std::any_of(argv, argv + argc, [](const char* arg) {
    return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0;
  });
  if (argc < 1 || help) {
    std::cout << kUsage;
    return argc < 1 ? 2 : 0;
  }
  const std::string sub = argv[0];
  try {
    if (sub == "init") return init(argc - 1, argv + 1);
    if (sub == "rotate") return rotate(argc - 1, argv + 1);
    if (sub == "prune") return prune(argc - 1, argv + 1);
    if (sub == "add") return add(argc - 1, argv + 1);
    if (sub == "list") return list(argc - 1, argv + 1);
    if (sub == "remove") return remove(argc - 1, argv + 1);
    throw ConfigError("unknown keys command '" + sub + "'");
  } catch (const ConfigError& e) {
    std::cerr << kUsage << "moeline: error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moeline: error: " << e.what() << '\n';
    return 1;
  }
}

}  // namespace moeline::cli
