#include "stages/http/client_link.h"

#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <optional>

namespace moeline::stages::http {
namespace {

struct Address {
  std::string host;
  int port = -1;
};

// As cpp-httplib writes an address (numeric host), so the two compare equal.
std::optional<Address> address_of(const sockaddr_storage& address, socklen_t length) {
  Address out;
  if (address.ss_family == AF_INET)
    out.port = ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  else if (address.ss_family == AF_INET6)
    out.port = ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
  else
    return std::nullopt;
  std::array<char, NI_MAXHOST> host{};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, host.data(), host.size(),
                  nullptr, 0, NI_NUMERICHOST) != 0)
    return std::nullopt;
  out.host = host.data();
  return out;
}

std::optional<Address> local_address(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return std::nullopt;
  return address_of(address, length);
}

std::optional<Address> peer_address(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return std::nullopt;
  return address_of(address, length);
}

}  // namespace

ClientLink::ClientLink(const httplib::Request& request)
    : ClientLink(request.remote_addr, request.remote_port, request.local_port) {}

ClientLink::ClientLink(std::string remote_address, int remote_port, int local_port)
    : remote_address_(std::move(remote_address)),
      remote_port_(remote_port),
      local_port_(local_port) {}

int ClientLink::socket() {
  if (searched_) return socket_;
  searched_ = true;
  if (remote_port_ <= 0 || local_port_ <= 0) return socket_;
  DIR* open_files = opendir("/proc/self/fd");
  if (open_files == nullptr) return socket_;
  while (const dirent* entry = readdir(open_files)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(open_files)) continue;
    // The cheap test first: most open files are not sockets on this port.
    const auto local = local_address(static_cast<int>(fd));
    if (!local || local->port != local_port_) continue;
    const auto peer = peer_address(static_cast<int>(fd));
    if (peer && peer->port == remote_port_ && peer->host == remote_address_) {
      socket_ = static_cast<int>(fd);
      break;
    }
  }
  closedir(open_files);
  return socket_;
}

bool ClientLink::gone() {
  if (gone_) return true;
  const int fd = socket();
  if (fd < 0) return false;
  char byte = 0;
  const ssize_t peeked = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  // 0: the peer closed its side. Data (a pipelined request) or nothing yet: still there.
  if (peeked == 0 || (peeked < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
    gone_ = true;
  return gone_;
}

}  // namespace moeline::stages::http
