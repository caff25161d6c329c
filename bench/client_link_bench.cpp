// What the HTTP front pays to see whether a waiting request's client is still connected
// (stages/http/client_link.h), with N loopback connections open in this process: the first look
// and a later one at one connection, median of 20 tries. One JSON line per N.
//
//   moeline_client_link_bench [--connections 10,100,1000,4000]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "stages/http/client_link.h"

namespace {

using moeline::stages::http::ClientLink;
using Clock = std::chrono::steady_clock;

double micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> counts = {10, 100, 1000, 4000};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--connections") != 0) {
      std::fprintf(stderr, "usage: moeline_client_link_bench [--connections N,N,...]\n");
      return 2;
    }
    counts.clear();
    for (const char* at = argv[i + 1]; *at != '\0';) {
      char* end = nullptr;
      counts.push_back(static_cast<int>(std::strtol(at, &end, 10)));
      at = *end == ',' ? end + 1 : end;
      if (end == at && *at != '\0') return 2;
    }
  }
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  limit.rlim_cur = limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(listener, 4096) != 0)
    return 1;
  getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  const int server_port = ntohs(address.sin_port);
  std::vector<int> client_ports;
  for (int count : counts) {
    while (static_cast<int>(client_ports.size()) < count) {
      const int client = socket(AF_INET, SOCK_STREAM, 0);
      if (client < 0 ||
          connect(client, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
          accept(listener, nullptr, nullptr) < 0) {
        std::fprintf(stderr, "cannot open %d connections (open files limit)\n", count);
        return 1;
      }
      sockaddr_in mine{};
      socklen_t mine_length = sizeof(mine);
      getsockname(client, reinterpret_cast<sockaddr*>(&mine), &mine_length);
      client_ports.push_back(ntohs(mine.sin_port));
    }
    std::vector<double> first, later;
    for (int i = 0; i < 20; ++i) {
      ClientLink link("127.0.0.1", client_ports[(i * 7919) % count], "127.0.0.1", server_port);
      const auto start = Clock::now();
      bool gone = link.gone();
      const auto looked = Clock::now();
      gone = link.gone() || gone;
      const auto again = Clock::now();
      if (gone) return 1;  // every connection here is open
      first.push_back(micros(looked - start));
      later.push_back(micros(again - looked));
    }
    std::printf("{\"connections\": %d, \"first_look_us\": %.1f, \"later_look_us\": %.1f}\n", count,
                median(first), median(later));
  }
  return 0;
}
