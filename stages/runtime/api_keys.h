#pragma once
// Client API keys: each binds a client to one tenant and a role (user: generate; operator: also
// the control commands). The operator keeps them in a keys file (JSON, mode 0600) with
// `moeline keys add|list|remove`; the file holds only each key's SHA-256, never the key, so a
// copy of the file lets nobody in. The gateway reads it with --api-keys and reloads it when it
// changes (adding or revoking a key needs no restart).
//
// A key reads "ml_<id>_<secret>": the id (8 hex digits) names the key in logs and in `keys list`;
// the secret is 32 random bytes, hex.
//
// Not thread-safe: the gateway's loop owns its ApiKeys.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moeline::runtime {

enum class ApiRole { kUser, kOperator };
const char* api_role_name(ApiRole role);
std::optional<ApiRole> parse_api_role(std::string_view name);

struct ApiKeyEntry {
  std::string id;
  std::string sha256;  // hex digest of the whole key
  std::string tenant;
  ApiRole role = ApiRole::kUser;
  // Per-key limits for its tenant (0: the gateway's defaults).
  uint32_t max_in_flight = 0;
  double prompt_tokens_per_s = 0;
  double created_unix_s = 0;
};

std::string sha256_hex(std::string_view text);
// A new random key and its entry (the key itself is shown once and stored nowhere).
std::pair<std::string, ApiKeyEntry> make_api_key(const std::string& tenant, ApiRole role);
// Reads a keys file; a missing file is an empty list, a malformed one a ConfigError.
std::vector<ApiKeyEntry> read_api_keys(const std::filesystem::path& path);
void write_api_keys(const std::filesystem::path& path, const std::vector<ApiKeyEntry>& keys);
bool valid_tenant_name(std::string_view tenant);

class ApiKeys {
 public:
  // An empty path: no keys file, every client is let in as the tenant it names (the open mode).
  explicit ApiKeys(std::filesystem::path path);
  bool required() const { return !path_.empty(); }
  size_t size() const { return by_hash_.size(); }
  // Rereads the file when its modification time or size changed, at most once a second. On a
  // bad file the previous keys stay in force and the error is returned.
  std::optional<std::string> reload_if_changed();
  const ApiKeyEntry* authenticate(std::string_view key) const;

 private:
  std::optional<std::string> load();
  std::filesystem::path path_;
  std::map<std::string, ApiKeyEntry> by_hash_;
  std::filesystem::file_time_type mtime_{};
  uintmax_t size_ = 0;
  std::chrono::steady_clock::time_point checked_{};
};

}  // namespace moeline::runtime
