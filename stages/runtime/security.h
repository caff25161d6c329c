#pragma once
// Who may connect to a stage's sockets. Every tcp:// socket of a stack with a key directory
// (`moeline keys init`, or `moeline stack up --transport tcp`) runs CurveZMQ: the gateway holds
// the server key pair, each stage role (probe, prefill, decode, offload) a key pair of its own,
// and the gateway's ZAP handler admits on the hub only the public keys listed in the allow-list,
// naming each connection by its key ("prefill:prefill-1"), so a hello is checked against the role
// its key was issued for. The client endpoint admits any client key (the channel is encrypted and
// the server authenticated; clients prove who they are with API keys, stages/gateway).
//
// Key directory (mode 0700, files 0600):
//   gateway.key   the server key pair          gateway.pub  its public half, for stages and clients
//   <role>.key    one per stage role            stages.allow the hub's allow-list (JSON)
//
// ZapHandler runs one thread per process with a REP socket on inproc://zeromq.zap.01 of the
// process's context; domains are set before the sockets that use them bind. Thread-safe.

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "stages/runtime/log.h"
#include "stages/runtime/metrics.h"

namespace moeline::runtime {

struct CurveKeyPair {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters; empty in a .pub file
};

struct KeyFile {
  std::string name;  // "gateway", "prefill", ...: who the key was issued to
  std::string role;  // gateway, probe, prefill, decode, offload
  CurveKeyPair keys;
  double created_unix_s = 0;
};

struct AllowedKey {
  std::string public_key, name, role;
};

inline constexpr const char* kStageRoles[] = {"probe", "prefill", "decode", "offload"};
inline constexpr const char* kHubDomain = "moeline-hub";
inline constexpr const char* kClientDomain = "moeline-client";

CurveKeyPair generate_curve_keypair();
// Reads a key file (JSON: name, role, public, secret); a missing or malformed file, or one that
// others may read while it holds a secret, is a ConfigError naming the file.
KeyFile read_key_file(const std::filesystem::path& path);
void write_key_file(const std::filesystem::path& path, const KeyFile& key, bool with_secret);
std::vector<AllowedKey> read_allow_list(const std::filesystem::path& path);
void write_allow_list(const std::filesystem::path& path, const std::vector<AllowedKey>& keys);
// Makes (or completes) a key directory: mode 0700, a key pair for the gateway and each stage
// role, gateway.pub, and stages.allow listing the stage keys. Existing keys are kept unless
// `force`. Returns one line per file written or kept.
std::vector<std::string> init_key_directory(const std::filesystem::path& dir, bool force);
// A new key pair for `role` in the directory (and gateway.pub for the gateway).
KeyFile issue_key(const std::filesystem::path& dir, const std::string& role);
// A server public key given as the path of a key file, or as its 40 Z85 characters.
std::string resolve_public_key(const std::string& text_or_path);

// A ROUTER that binds: Curve server with this key pair, checked by the ZAP handler in `domain`.
void make_curve_server(zmq::socket_t& socket, const CurveKeyPair& keys, const std::string& domain);
// A DEALER that connects: Curve client of the server whose public key is given.
void make_curve_client(zmq::socket_t& socket, const CurveKeyPair& keys,
                       const std::string& server_public_key);

// The User-Id the ZAP handler gave the connection a message came in on ("role:name"); empty for
// a socket without Curve.
std::string peer_user_id(const zmq::message_t& message);

// An ipc:// endpoint's socket file, made readable and writable by its owner alone after bind.
void restrict_ipc_endpoint(const std::string& endpoint);
bool is_tcp(const std::string& endpoint);

class ZapHandler {
 public:
  ZapHandler(zmq::context_t& context, Logger& log, Registry& metrics);
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

  // Only these keys, each connection named "role:name".
  void allow_keys(const std::string& domain, const std::vector<AllowedKey>& keys);
  // Any key (encryption and server authentication only); connections are named "client".
  void allow_any(const std::string& domain);

 private:
  void serve();
  std::optional<std::string> decide(const std::string& domain, const std::string& key);

  zmq::context_t& context_;
  Logger& log_;
  Registry& metrics_;
  std::mutex mutex_;
  std::map<std::string, std::optional<std::map<std::string, std::string>>> domains_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> bound_{false};
  std::thread thread_;
  RateLimited log_limit_;
};

// What a process reads from --curve-dir: its own key pair and the gateway's public key, and for
// the gateway the hub's allow-list.
struct CurveSettings {
  std::filesystem::path dir;
  KeyFile own;
  std::string server_public_key;
  std::vector<AllowedKey> allowed;  // the gateway only
  bool enabled() const { return !dir.empty(); }
};
// `role` is "gateway" or a stage role; an empty dir gives settings with Curve off.
CurveSettings load_curve_settings(const std::string& dir, const std::string& role);

}  // namespace moeline::runtime
