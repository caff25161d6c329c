#pragma once
// Errors at the model library's boundary are values: Expected<T> holds a result or an Error whose
// message names what was wrong and where (file, tensor, key), ready to show to a user.

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace moeline::model {

struct Error {
  std::string message;
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

// Success, or the Error that stopped an operation.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)) {}
  static Status ok_status() { return Status(); }
  bool ok() const { return !error_.has_value(); }
  const Error& error() const { return *error_; }

 private:
  std::optional<Error> error_;
};

// Thrown inside the loader and turned into an Error at the boundary; never escapes the library.
class ModelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moeline::model
