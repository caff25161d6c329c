#include "base/progress.h"

#include <unistd.h>

#include <cstdio>

#include "base/environment.h"

namespace moeline {

TerminalProgress::TerminalProgress(std::string what, std::string unit)
    : what_(std::move(what)), unit_(std::move(unit)), enabled_(stderr_is_terminal()) {}

TerminalProgress::~TerminalProgress() {
  finish();
}

bool TerminalProgress::stderr_is_terminal() {
  if (::isatty(STDERR_FILENO) != 1) return false;
  const char* term = env::get(env::kTerm);
  return term == nullptr || std::string(term) != "dumb";
}

void TerminalProgress::update(int64_t done, int64_t total, const std::string& detail) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  // The last update is always drawn, so the line never stops short of 100%.
  if (drawn_ && done < total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  drawn_ = true;
  const int percent = total > 0 ? static_cast<int>(100 * done / total) : 0;
  std::fprintf(stderr, "\r\033[K%s %3d%% (%lld/%lld %s)%s%s", what_.c_str(), percent,
               static_cast<long long>(done), static_cast<long long>(total), unit_.c_str(),
               detail.empty() ? "" : ", ", detail.c_str());
  std::fflush(stderr);
}

void TerminalProgress::finish() {
  if (!drawn_) return;
  drawn_ = false;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
}

}  // namespace moeline
