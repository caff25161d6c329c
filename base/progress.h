#pragma once
// Progress of a long piece of work (loading a model, quantizing a checkpoint, a load test): the
// work reports how far it is through a `Progress` callback, and whoever runs it decides where that
// goes — a line on the terminal (`TerminalProgress`), a stage's /readyz, or nowhere.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace moeline {

// `done` of `total` units of the work (layers, tensors, seconds); called from the working thread.
using Progress = std::function<void(int64_t done, int64_t total)>;

// One line on standard error, redrawn in place ("loading model  42% (10/24 layers)"), at most ten
// times a second, and only where standard error is a terminal: redirected to a file or a pipe
// (CI, logs, scripts reading the output) it writes nothing. The line is erased when the work ends.
class TerminalProgress {
 public:
  // `what` starts the line; `unit` names what is counted ("layers", "tensors", "s").
  TerminalProgress(std::string what, std::string unit);
  ~TerminalProgress();
  TerminalProgress(const TerminalProgress&) = delete;
  TerminalProgress& operator=(const TerminalProgress&) = delete;

  // `detail` is appended after the count ("812 requests, 0 errors").
  void update(int64_t done, int64_t total, const std::string& detail = "");
  // The callback form, for work that takes a `Progress`.
  Progress callback() {
    return [this](int64_t done, int64_t total) { update(done, total); };
  }
  // Erases the line (also done by the destructor).
  void finish();
  bool enabled() const { return enabled_; }

  // Standard error is a terminal that can redraw a line (not TERM=dumb).
  static bool stderr_is_terminal();

 private:
  std::string what_, unit_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace moeline
