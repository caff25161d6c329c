#include "stages/runtime/security.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "stages/runtime/config.h"

namespace moeline::runtime {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

bool is_z85_key(const std::string& text) {
  if (text.size() != 40) return false;
  uint8_t decoded[32];
  return zmq_z85_decode(decoded, text.c_str()) != nullptr;
}

json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot read " + path.string());
  json value = json::parse(in, nullptr, false);
  if (value.is_discarded()) throw ConfigError(path.string() + " is not valid JSON");
  return value;
}

void write_private_file(const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    if (!out) throw ConfigError("cannot write " + temporary.string());
    fs::permissions(temporary, fs::perms::owner_read | fs::perms::owner_write,
                    fs::perm_options::replace);
    out << text;
    if (!out.flush()) throw ConfigError("cannot write " + temporary.string());
  }
  fs::rename(temporary, path);
}

std::string text_field(const json& value, const char* key, const fs::path& path) {
  if (!value.contains(key) || !value[key].is_string())
    throw ConfigError(path.string() + ": \"" + key + "\" is missing or not a string");
  return value[key].get<std::string>();
}

}  // namespace

CurveKeyPair generate_curve_keypair() {
  char public_key[41] = {}, secret_key[41] = {};
  if (zmq_curve_keypair(public_key, secret_key) != 0)
    throw std::runtime_error("this libzmq has no CURVE support (built without libsodium)");
  return {public_key, secret_key};
}

KeyFile read_key_file(const fs::path& path) {
  const json value = read_json_file(path);
  if (!value.is_object()) throw ConfigError(path.string() + " is not a key file");
  KeyFile key;
  key.name = text_field(value, "name", path);
  key.role = text_field(value, "role", path);
  key.keys.public_key = text_field(value, "public", path);
  if (!is_z85_key(key.keys.public_key))
    throw ConfigError(path.string() + ": \"public\" is not a 40-character Z85 key");
  if (value.contains("secret")) {
    key.keys.secret_key = text_field(value, "secret", path);
    if (!is_z85_key(key.keys.secret_key))
      throw ConfigError(path.string() + ": \"secret\" is not a 40-character Z85 key");
    struct stat info {};
    if (::stat(path.c_str(), &info) == 0 && (info.st_mode & 077) != 0) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%03o", static_cast<unsigned>(info.st_mode & 0777));
      throw ConfigError(path.string() + " holds a secret key but others may read it (mode " + mode +
                        "); chmod 600 it");
    }
  }
  key.created_unix_s = value.value("created_unix_s", 0.0);
  return key;
}

void write_key_file(const fs::path& path, const KeyFile& key, bool with_secret) {
  json value = {{"name", key.name},
                {"role", key.role},
                {"public", key.keys.public_key},
                {"created_unix_s", key.created_unix_s}};
  if (with_secret) value["secret"] = key.keys.secret_key;
  write_private_file(path, value.dump(2) + "\n");
  if (!with_secret)
    fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                              fs::perms::others_read);
}

std::vector<AllowedKey> read_allow_list(const fs::path& path) {
  const json value = read_json_file(path);
  if (!value.is_object() || !value.contains("keys") || !value["keys"].is_array())
    throw ConfigError(path.string() + ": expected {\"keys\": [{\"public\", \"name\", \"role\"}]}");
  std::vector<AllowedKey> keys;
  for (const json& entry : value["keys"]) {
    if (!entry.is_object()) throw ConfigError(path.string() + ": a key entry is not an object");
    AllowedKey key{text_field(entry, "public", path), text_field(entry, "name", path),
                   text_field(entry, "role", path)};
    if (!is_z85_key(key.public_key))
      throw ConfigError(path.string() + ": key of " + key.name + " is not a Z85 key");
    keys.push_back(std::move(key));
  }
  return keys;
}

void write_allow_list(const fs::path& path, const std::vector<AllowedKey>& keys) {
  json list = json::array();
  for (const AllowedKey& key : keys)
    list.push_back({{"public", key.public_key}, {"name", key.name}, {"role", key.role}});
  write_private_file(path, json{{"keys", list}}.dump(2) + "\n");
}

KeyFile issue_key(const fs::path& dir, const std::string& role) {
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  KeyFile key{role, role, generate_curve_keypair(), now};
  write_key_file(dir / (role + ".key"), key, true);
  if (role == "gateway") write_key_file(dir / "gateway.pub", key, false);
  return key;
}

std::vector<std::string> init_key_directory(const fs::path& dir, bool force) {
  std::vector<std::string> report;
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace);
  std::vector<AllowedKey> allowed;
  const fs::path allow = dir / "stages.allow";
  if (!force && fs::exists(allow)) allowed = read_allow_list(allow);
  std::vector<std::string> roles = {"gateway"};
  for (const char* stage : kStageRoles) roles.push_back(stage);
  for (const std::string& role : roles) {
    const fs::path file = dir / (role + ".key");
    const bool keep = !force && fs::exists(file);
    const KeyFile key = keep ? read_key_file(file) : issue_key(dir, role);
    report.push_back((keep ? "kept   " : "wrote  ") + file.string());
    if (role == "gateway") continue;
    const bool listed = std::any_of(allowed.begin(), allowed.end(), [&](const AllowedKey& a) {
      return a.public_key == key.keys.public_key;
    });
    if (!listed) allowed.push_back({key.keys.public_key, key.name, role});
  }
  write_allow_list(allow, allowed);
  report.push_back("wrote  " + allow.string() + " (" + std::to_string(allowed.size()) +
                   " stage keys)");
  return report;
}

std::string resolve_public_key(const std::string& text_or_path) {
  // A file first: a path can be 40 characters of Z85's alphabet ("/", ".", "-" are in it).
  if (fs::is_regular_file(text_or_path)) return read_key_file(text_or_path).keys.public_key;
  if (is_z85_key(text_or_path)) return text_or_path;
  throw ConfigError(text_or_path + " is neither a key file nor a 40-character Z85 key");
}

void make_curve_server(zmq::socket_t& socket, const CurveKeyPair& keys, const std::string& domain) {
  socket.set(zmq::sockopt::zap_domain, domain);
  socket.set(zmq::sockopt::curve_server, true);
  socket.set(zmq::sockopt::curve_secretkey, keys.secret_key);
}

void make_curve_client(zmq::socket_t& socket, const CurveKeyPair& keys,
                       const std::string& server_public_key) {
  socket.set(zmq::sockopt::curve_serverkey, server_public_key);
  socket.set(zmq::sockopt::curve_publickey, keys.public_key);
  socket.set(zmq::sockopt::curve_secretkey, keys.secret_key);
}

std::string peer_user_id(const zmq::message_t& message) {
  const char* value =
      zmq_msg_gets(const_cast<zmq_msg_t*>(message.handle()), "User-Id");  // NOLINT: C API
  return value == nullptr ? std::string() : std::string(value);
}

bool is_tcp(const std::string& endpoint) {
  return endpoint.rfind("tcp://", 0) == 0;
}

void restrict_ipc_endpoint(const std::string& endpoint) {
  if (endpoint.rfind("ipc://", 0) != 0) return;
  const std::string path = endpoint.substr(6);
  if (path.empty() || path[0] == '@') return;  // abstract namespace: no file
  if (::chmod(path.c_str(), 0600) != 0)
    throw ConfigError("cannot restrict " + path + " to its owner: " + std::strerror(errno));
}

ZapHandler::ZapHandler(zmq::context_t& context, Logger& log, Registry& metrics)
    : context_(context), log_(log), metrics_(metrics) {
  thread_ = std::thread([this] { serve(); });
  // The handler must be bound before any Curve socket of this context accepts a connection.
  while (!bound_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

ZapHandler::~ZapHandler() {
  stopping_.store(true);
  if (thread_.joinable()) thread_.join();
}

void ZapHandler::allow_keys(const std::string& domain, const std::vector<AllowedKey>& keys) {
  std::map<std::string, std::string> names;
  for (const AllowedKey& key : keys) names[key.public_key] = key.role + ":" + key.name;
  std::lock_guard lock(mutex_);
  domains_[domain] = std::move(names);
}

void ZapHandler::allow_any(const std::string& domain) {
  std::lock_guard lock(mutex_);
  domains_[domain] = std::nullopt;
}

std::optional<std::string> ZapHandler::decide(const std::string& domain, const std::string& key) {
  std::lock_guard lock(mutex_);
  auto it = domains_.find(domain);
  if (it == domains_.end()) return std::nullopt;
  if (!it->second) return std::string("client");
  auto found = it->second->find(key);
  if (found == it->second->end()) return std::nullopt;
  return found->second;
}

void ZapHandler::serve() {
  zmq::socket_t socket(context_, zmq::socket_type::rep);
  socket.set(zmq::sockopt::linger, 0);
  socket.bind("inproc://zeromq.zap.01");
  bound_.store(true);
  while (!stopping_.load()) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
    } catch (const zmq::error_t&) {
      continue;
    }
    if (!(item.revents & ZMQ_POLLIN)) continue;
    std::vector<zmq::message_t> request;
    while (true) {
      zmq::message_t frame;
      if (!socket.recv(frame, zmq::recv_flags::dontwait)) break;
      const bool more = frame.more();
      request.push_back(std::move(frame));
      if (!more) break;
    }
    // version, request id, domain, address, routing id, mechanism, credentials...
    if (request.size() < 6) continue;
    const std::string domain = request[2].to_string();
    const std::string address = request[3].to_string();
    const std::string mechanism = request[5].to_string();
    std::optional<std::string> user;
    if (mechanism == "CURVE" && request.size() >= 7 && request[6].size() == 32) {
      char text[41] = {};
      zmq_z85_encode(text, static_cast<const uint8_t*>(request[6].data()), 32);
      user = decide(domain, text);
    }
    metrics_
        .counter("moeline_zap_requests_total", "Connections checked against the allowed keys",
                 {{"domain", domain}, {"result", user ? "accepted" : "refused"}})
        .inc();
    if (!user) {
      if (uint64_t suppressed = 0; log_limit_.allow(suppressed))
        log_.warn("connection_refused", {{"domain", domain},
                                         {"address", address},
                                         {"mechanism", mechanism},
                                         {"suppressed", suppressed}});
    }
    const std::string status = user ? "200" : "400";
    const std::string status_text = user ? "OK" : "key not allowed";
    const std::string user_id = user ? *user : "";
    socket.send(zmq::buffer(std::string("1.0")), zmq::send_flags::sndmore);
    socket.send(request[1], zmq::send_flags::sndmore);
    socket.send(zmq::buffer(status), zmq::send_flags::sndmore);
    socket.send(zmq::buffer(status_text), zmq::send_flags::sndmore);
    socket.send(zmq::buffer(user_id), zmq::send_flags::sndmore);
    socket.send(zmq::message_t(), zmq::send_flags::none);
  }
}

CurveSettings load_curve_settings(const std::string& dir, const std::string& role) {
  CurveSettings settings;
  if (dir.empty()) return settings;
  settings.dir = dir;
  if (!fs::is_directory(settings.dir))
    throw ConfigError("--curve-dir " + dir + " is not a directory (make one: moeline keys init)");
  settings.own = read_key_file(settings.dir / (role + ".key"));
  if (settings.own.keys.secret_key.empty())
    throw ConfigError((settings.dir / (role + ".key")).string() + " has no secret key");
  if (role == "gateway") {
    settings.server_public_key = settings.own.keys.public_key;
    settings.allowed = read_allow_list(settings.dir / "stages.allow");
  } else {
    settings.server_public_key = read_key_file(settings.dir / "gateway.pub").keys.public_key;
  }
  return settings;
}

}  // namespace moeline::runtime
