#include "stages/runtime/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace moeline::runtime {

ProcessMetrics::ProcessMetrics(Registry& registry)
    : cpu_seconds_(
          registry.counter("process_cpu_seconds_total", "Total user and system CPU time spent")),
      resident_bytes_(registry.gauge("process_resident_memory_bytes", "Resident memory size")),
      virtual_bytes_(registry.gauge("process_virtual_memory_bytes", "Virtual memory size")),
      open_fds_(registry.gauge("process_open_fds", "Open file descriptors")),
      max_fds_(registry.gauge("process_max_fds", "Maximum number of open file descriptors")),
      threads_(registry.gauge("process_threads", "OS threads")),
      start_time_(registry.gauge("process_start_time_seconds",
                                 "Start time of the process since the Unix epoch")) {
  update();
}

void ProcessMetrics::update() {
  std::lock_guard lock(mutex_);
  // /proc/self/stat: fields after the command's closing parenthesis, counted from 3 (state).
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close != std::string::npos) {
    std::istringstream in(text.substr(close + 2));
    std::vector<std::string> fields;
    for (std::string field; in >> field;) fields.push_back(field);
    if (fields.size() > 21) {
      const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
      const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
      const double cpu = (std::stod(fields[11]) + std::stod(fields[12])) / ticks;  // utime, stime
      if (cpu > last_cpu_seconds_) cpu_seconds_.inc(cpu - last_cpu_seconds_);
      last_cpu_seconds_ = std::max(last_cpu_seconds_, cpu);
      threads_.set(std::stod(fields[17]));
      virtual_bytes_.set(std::stod(fields[20]));
      resident_bytes_.set(std::stod(fields[21]) * page);
      // starttime (field 22) is in ticks after boot; boot time from /proc/stat's btime. It does
      // not change: read once, not on every scrape.
      if (!start_time_known_) {
        std::ifstream boot("/proc/stat");
        for (std::string key; boot >> key;) {
          if (key == "btime") {
            double btime = 0;
            boot >> btime;
            start_time_.set(btime + std::stod(fields[19]) / ticks);
            start_time_known_ = true;
            break;
          }
        }
      }
    }
  }
  std::error_code ec;
  double fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++fds;
  open_fds_.set(fds);
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) max_fds_.set(static_cast<double>(limit.rlim_cur));
}

}  // namespace moeline::runtime
