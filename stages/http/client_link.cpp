#include "stages/http/client_link.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace moeline::stages::http {
namespace {

// The peer's port and address bytes, in network order (IPv4 or IPv6).
struct Peer {
  int family = AF_UNSPEC;
  uint16_t port = 0;
  std::array<unsigned char, 16> address{};
};

std::optional<Peer> parse_peer(const std::string& host, int port) {
  Peer peer;
  peer.port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), peer.address.data()) == 1)
    peer.family = AF_INET;
  else if (inet_pton(AF_INET6, host.c_str(), peer.address.data()) == 1)
    peer.family = AF_INET6;
  else
    return std::nullopt;
  return peer;
}

// Whether socket `fd` is connected to `peer`: one getpeername, the port compared first (it
// tells the connections of one client host apart without looking at the address).
bool connected_to(int fd, const Peer& peer) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return false;
  if (address.ss_family != peer.family) return false;
  if (peer.family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    return in.sin_port == peer.port && std::memcmp(&in.sin_addr, peer.address.data(), 4) == 0;
  }
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
  return in6.sin6_port == peer.port && std::memcmp(&in6.sin6_addr, peer.address.data(), 16) == 0;
}

uint16_t local_port(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  if (address.ss_family == AF_INET) return reinterpret_cast<const sockaddr_in&>(address).sin_port;
  if (address.ss_family == AF_INET6)
    return reinterpret_cast<const sockaddr_in6&>(address).sin6_port;
  return 0;
}

}  // namespace

ClientLink::ClientLink(const httplib::Request& request)
    : ClientLink(request.remote_addr, request.remote_port, request.local_addr, request.local_port) {
}

ClientLink::ClientLink(std::string remote_address, int remote_port, std::string local_address,
                       int local_port)
    : remote_address_(std::move(remote_address)),
      remote_port_(remote_port),
      local_address_(std::move(local_address)),
      local_port_(local_port) {}

std::optional<int> ClientLink::kernel_state() const {
  const auto remote = parse_peer(remote_address_, remote_port_);
  const auto local = parse_peer(local_address_, local_port_);
  if (!remote || !local || remote->family != local->family) return std::nullopt;
  const int netlink = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (netlink < 0) return std::nullopt;
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } query{};
  query.header.nlmsg_len = sizeof(query);
  query.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  query.header.nlmsg_flags = NLM_F_REQUEST;
  query.request.sdiag_family = static_cast<uint8_t>(local->family);
  query.request.sdiag_protocol = IPPROTO_TCP;
  query.request.idiag_states = ~0u;
  query.request.id.idiag_sport = local->port;
  query.request.id.idiag_dport = remote->port;
  std::memcpy(query.request.id.idiag_src, local->address.data(), 16);
  std::memcpy(query.request.id.idiag_dst, remote->address.data(), 16);
  query.request.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  query.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  std::optional<int> state;
  alignas(nlmsghdr) char reply[1024];
  if (::sendto(netlink, &query, sizeof(query), 0, reinterpret_cast<sockaddr*>(&kernel),
               sizeof(kernel)) == static_cast<ssize_t>(sizeof(query))) {
    const ssize_t got = ::recv(netlink, reply, sizeof(reply), 0);
    const auto* header = reinterpret_cast<const nlmsghdr*>(reply);
    if (got >= static_cast<ssize_t>(sizeof(nlmsghdr)) && NLMSG_OK(header, got)) {
      if (header->nlmsg_type == SOCK_DIAG_BY_FAMILY &&
          header->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg)))
        state = static_cast<const inet_diag_msg*>(NLMSG_DATA(header))->idiag_state;
      else if (header->nlmsg_type == NLMSG_ERROR &&
               header->nlmsg_len >= NLMSG_LENGTH(sizeof(nlmsgerr)) &&
               static_cast<const nlmsgerr*>(NLMSG_DATA(header))->error == -ENOENT)
        state = 0;
    }
  }
  ::close(netlink);
  return state;
}

int ClientLink::socket() {
  if (searched_) return socket_;
  searched_ = true;
  if (remote_port_ <= 0 || remote_port_ > 65535 || local_port_ <= 0 || local_port_ > 65535)
    return socket_;
  const auto peer = parse_peer(remote_address_, remote_port_);
  if (!peer) return socket_;
  DIR* open_files = opendir("/proc/self/fd");
  if (open_files == nullptr) return socket_;
  while (const dirent* entry = readdir(open_files)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(open_files)) continue;
    if (connected_to(static_cast<int>(fd), *peer) &&
        local_port(static_cast<int>(fd)) == htons(static_cast<uint16_t>(local_port_))) {
      socket_ = static_cast<int>(fd);
      break;
    }
  }
  closedir(open_files);
  return socket_;
}

bool ClientLink::gone() {
  if (gone_) return true;
  const std::optional<int> state = kernel_state();
  if (state == TCP_ESTABLISHED) {
    seen_established_ = true;
    return false;
  }
  if (state == TCP_CLOSE_WAIT) return gone_ = true;
  // No longer there (reset): trusted once the same lookup has found the connection, so that
  // addresses the kernel would spell differently never cancel a live request.
  if (state == 0 && seen_established_) return gone_ = true;
  return gone_ = socket_says_gone();  // another state, or no answer: the socket settles it
}

bool ClientLink::socket_says_gone() {
  const int fd = socket();
  if (fd < 0) return false;
  char byte = 0;
  const ssize_t peeked = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  // 0: the peer closed its side. Data (a pipelined request) or nothing yet: still there.
  return peeked == 0 || (peeked < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace moeline::stages::http
