#include "stages/runtime/api_keys.h"

#include <sodium.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "stages/runtime/config.h"

namespace moeline::runtime {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string hex(const unsigned char* bytes, size_t size) {
  std::string out(size * 2 + 1, '\0');
  sodium_bin2hex(out.data(), out.size(), bytes, size);
  out.pop_back();
  return out;
}

void ensure_sodium() {
  if (sodium_init() < 0) throw std::runtime_error("libsodium could not be initialised");
}

}  // namespace

const char* api_role_name(ApiRole role) {
  return role == ApiRole::kOperator ? "operator" : "user";
}

std::optional<ApiRole> parse_api_role(std::string_view name) {
  if (name == "user") return ApiRole::kUser;
  if (name == "operator") return ApiRole::kOperator;
  return std::nullopt;
}

bool valid_tenant_name(std::string_view tenant) {
  return !tenant.empty() && tenant.size() <= 64 &&
         std::all_of(tenant.begin(), tenant.end(), [](char c) {
           return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
         });
}

std::string sha256_hex(std::string_view text) {
  ensure_sodium();
  unsigned char digest[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(digest, reinterpret_cast<const unsigned char*>(text.data()), text.size());
  return hex(digest, sizeof digest);
}

std::pair<std::string, ApiKeyEntry> make_api_key(const std::string& tenant, ApiRole role) {
  ensure_sodium();
  unsigned char id[4], secret[32];
  randombytes_buf(id, sizeof id);
  randombytes_buf(secret, sizeof secret);
  ApiKeyEntry entry;
  entry.id = hex(id, sizeof id);
  const std::string key = "ml_" + entry.id + "_" + hex(secret, sizeof secret);
  entry.sha256 = sha256_hex(key);
  entry.tenant = tenant;
  entry.role = role;
  entry.created_unix_s =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  return {key, entry};
}

std::vector<ApiKeyEntry> read_api_keys(const fs::path& path) {
  std::vector<ApiKeyEntry> keys;
  if (!fs::exists(path)) return keys;
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot read the keys file " + path.string());
  const json file = json::parse(in, nullptr, false);
  if (file.is_discarded() || !file.is_object() || !file.contains("keys") ||
      !file["keys"].is_array())
    throw ConfigError(path.string() + ": expected {\"keys\": [...]} (moeline keys add writes it)");
  for (const json& item : file["keys"]) {
    auto text = [&](const char* key) {
      if (!item.is_object() || !item.contains(key) || !item[key].is_string())
        throw ConfigError(path.string() + ": a key entry has no string \"" + key + "\"");
      return item[key].get<std::string>();
    };
    auto number = [&](const char* key) {
      if (!item.contains(key)) return 0.0;
      if (!item[key].is_number() || item[key].get<double>() < 0)
        throw ConfigError(path.string() + ": \"" + key + "\" must be a number >= 0");
      return item[key].get<double>();
    };
    ApiKeyEntry entry;
    entry.id = text("id");
    entry.sha256 = text("sha256");
    entry.tenant = text("tenant");
    if (!valid_tenant_name(entry.tenant))
      throw ConfigError(path.string() + ": key " + entry.id + " has an invalid tenant name");
    const auto role = parse_api_role(text("role"));
    if (!role) throw ConfigError(path.string() + ": key " + entry.id + ": role is user|operator");
    entry.role = *role;
    entry.max_in_flight = static_cast<uint32_t>(std::min(number("max_in_flight"), 1e9));
    entry.prompt_tokens_per_s = number("prompt_tokens_per_s");
    entry.created_unix_s = number("created_unix_s");
    keys.push_back(std::move(entry));
  }
  return keys;
}

void write_api_keys(const fs::path& path, const std::vector<ApiKeyEntry>& keys) {
  json list = json::array();
  for (const ApiKeyEntry& key : keys)
    list.push_back({{"id", key.id},
                    {"sha256", key.sha256},
                    {"tenant", key.tenant},
                    {"role", api_role_name(key.role)},
                    {"max_in_flight", key.max_in_flight},
                    {"prompt_tokens_per_s", key.prompt_tokens_per_s},
                    {"created_unix_s", key.created_unix_s}});
  const fs::path temporary = path.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    if (!out) throw ConfigError("cannot write " + temporary.string());
    fs::permissions(temporary, fs::perms::owner_read | fs::perms::owner_write,
                    fs::perm_options::replace);
    out << json{{"keys", list}}.dump(2) << '\n';
    if (!out.flush()) throw ConfigError("cannot write " + temporary.string());
  }
  fs::rename(temporary, path);
}

ApiKeys::ApiKeys(fs::path path) : path_(std::move(path)) {
  if (path_.empty()) return;
  if (!fs::exists(path_))
    throw ConfigError("--api-keys " + path_.string() +
                      " does not exist (create it: moeline keys add --file " + path_.string() +
                      " --tenant NAME)");
  if (auto error = load()) throw ConfigError(*error);
}

std::optional<std::string> ApiKeys::load() {
  std::error_code ec;
  const auto mtime = fs::last_write_time(path_, ec);
  const auto size = fs::file_size(path_, ec);
  try {
    std::map<std::string, ApiKeyEntry> by_hash;
    for (ApiKeyEntry& entry : read_api_keys(path_)) by_hash[entry.sha256] = std::move(entry);
    by_hash_ = std::move(by_hash);
  } catch (const std::exception& e) {
    mtime_ = mtime;  // do not retry the same bad file every second
    size_ = size;
    return std::string(e.what());
  }
  mtime_ = mtime;
  size_ = size;
  return std::nullopt;
}

std::optional<std::string> ApiKeys::reload_if_changed() {
  if (path_.empty()) return std::nullopt;
  const auto now = std::chrono::steady_clock::now();
  if (now - checked_ < std::chrono::seconds(1)) return std::nullopt;
  checked_ = now;
  std::error_code ec;
  const auto mtime = fs::last_write_time(path_, ec);
  if (ec) return "cannot read " + path_.string() + ": " + ec.message() + " (keeping the old keys)";
  const auto size = fs::file_size(path_, ec);
  if (mtime == mtime_ && size == size_) return std::nullopt;
  return load();
}

const ApiKeyEntry* ApiKeys::authenticate(std::string_view key) const {
  if (key.empty() || key.size() > 256) return nullptr;
  auto it = by_hash_.find(sha256_hex(key));
  return it == by_hash_.end() ? nullptr : &it->second;
}

}  // namespace moeline::runtime
