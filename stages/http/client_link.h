#pragma once
// Whether the client of a request being answered is still connected. A request whose client has
// gone is cancelled in the pipeline instead of generating to its end for nobody (an SDK that times
// out retries, so the abandoned generations would pile up against the tenant's limits).
//
// cpp-httplib 0.11 gives a handler no way to ask: its Request carries the connection's
// addresses, not its socket. While a handler runs the server reads nothing from that socket, so it
// is found once among the process's open files by its two addresses and peeked at: a peer that
// closed (or reset) the connection reads as end of file, one that is waiting reads as nothing.

#include <chrono>
#include <string>

#include <httplib.h>

namespace moeline::stages::http {

class ClientLink {
 public:
  using Clock = std::chrono::steady_clock;
  // How often a wait looks: the longest an abandoned request runs on before its cancel.
  static constexpr std::chrono::milliseconds kCheckInterval{500};

  explicit ClientLink(const httplib::Request& request);
  ClientLink(std::string remote_address, int remote_port, int local_port);

  // True once the client has closed or reset the connection (it stays true). A connection whose
  // socket cannot be found (not TCP, or already gone) is taken as open.
  bool gone();

 private:
  int socket();  // -1 when not found

  std::string remote_address_;
  int remote_port_ = -1;
  int local_port_ = -1;
  int socket_ = -1;
  bool searched_ = false;
  bool gone_ = false;
};

}  // namespace moeline::stages::http
