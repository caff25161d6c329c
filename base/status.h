#pragma once
// Errors at every library's boundary are values: Expected<T> holds a result or an Error, Status
// says success or the Error that stopped an operation. An Error carries a code (what kind of
// failure, which decides what a caller does: retry, report bad input, give up) and a message that
// names what was wrong and where (file, tensor, key), ready to show to a user.
//
// Inside a library, code that is deep in a parser may throw StatusError; the library's boundary
// catches it and returns the Error, so no exception crosses into a caller that returns Status.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace moeline {

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,    // the caller's input (a request, a file, a flag) is not acceptable
  kNotFound,           // what was named does not exist (a file, a tensor, a key)
  kCorruption,         // stored data fails its own checks (a truncated spill, a bad checksum)
  kIoError,            // the operating system refused (read, write, map, disk full)
  kResourceExhausted,  // a budget or a limit was reached (memory, slots, sizes)
  kUnavailable,        // a peer or a resource is not there now; trying again later may work
  kInternal,           // a broken invariant of moeline itself: a bug, never the input's fault
};

// "invalid_argument", "not_found", ...: stable names for logs and metric labels.
std::string_view status_code_name(StatusCode code);

struct Error {
  std::string message;
  // Most errors a library reports are about what it was given; the others say so.
  StatusCode code = StatusCode::kInvalidArgument;
};

template <class T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : state_(std::move(value)) {}
  Expected(Error error) : state_(std::move(error)) {}

  bool ok() const { return std::holds_alternative<T>(state_); }
  explicit operator bool() const { return ok(); }
  T& value() { return std::get<T>(state_); }
  const T& value() const { return std::get<T>(state_); }
  T& operator*() { return value(); }
  T* operator->() { return &value(); }
  const Error& error() const { return std::get<Error>(state_); }

 private:
  std::variant<T, Error> state_;
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)) {}
  static Status ok_status() { return Status(); }
  bool ok() const { return !error_.has_value(); }
  const Error& error() const { return *error_; }
  StatusCode code() const { return error_ ? error_->code : StatusCode::kOk; }

 private:
  std::optional<Error> error_;
};

// Thrown inside a library and turned into an Error at its boundary; never escapes the library.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const std::string& message, StatusCode code = StatusCode::kInvalidArgument)
      : std::runtime_error(message), code_(code) {}
  StatusCode code() const { return code_; }
  Error error() const { return Error{what(), code_}; }

 private:
  StatusCode code_;
};

}  // namespace moeline
