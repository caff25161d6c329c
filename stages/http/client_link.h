#pragma once
// Whether the client of a request being answered is still connected. A request whose client has
// gone is cancelled in the pipeline instead of generating to its end for nobody (an SDK that times
// out retries, so the abandoned generations would pile up against the tenant's limits).
//
// cpp-httplib 0.11 gives a handler no way to ask: its Request carries the connection's
// addresses, not its socket. So the kernel is asked for the TCP state of the connection with those
// addresses (sock_diag, one netlink round trip, about 9 µs, no search): established is there;
// CLOSE_WAIT (the client closed its side) is gone, and so is a connection the kernel no longer has
// (reset) once it has been found before. A kernel that will not answer is settled on the socket
// itself: found once among the process's open files by its addresses (about 2 µs per open file)
// and peeked at, where end of file or an error is gone and data or nothing yet is there.

#include <chrono>
#include <optional>
#include <string>

#include <httplib.h>

namespace moeline::stages::http {

class ClientLink {
 public:
  using Clock = std::chrono::steady_clock;
  // How often a wait looks: the longest an abandoned request runs on before its cancel.
  static constexpr std::chrono::milliseconds kCheckInterval{500};

  explicit ClientLink(const httplib::Request& request);
  ClientLink(std::string remote_address, int remote_port, std::string local_address,
             int local_port);

  // True once the client has closed or reset the connection (it stays true). A connection that
  // cannot be looked up (not TCP, no such socket here) is taken as open.
  bool gone();

 private:
  // The kernel's TCP state of the connection (netinet/tcp.h's TCP_*), 0 where the kernel has no
  // such connection, nullopt where it cannot say.
  std::optional<int> kernel_state() const;
  bool socket_says_gone();
  int socket();  // -1 when not found

  std::string remote_address_;
  int remote_port_ = -1;
  std::string local_address_;
  int local_port_ = -1;
  int socket_ = -1;
  bool searched_ = false;
  bool seen_established_ = false;  // the kernel's lookup has found this connection
  bool gone_ = false;
};

}  // namespace moeline::stages::http
