#pragma once
// Small typed accessors over simdjson's DOM for reading tokenizer.json. Every failure throws
// StatusError with the dotted path of the offending key, so load errors say exactly what is wrong.

#include <simdjson.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"

namespace moeline::tokenizer::tok::json {

using simdjson::dom::array;
using simdjson::dom::element;
using simdjson::dom::object;

[[noreturn]] inline void fail(const std::string& where, const std::string& what) {
  throw StatusError(where + ": " + what);
}

inline object as_object(element e, const std::string& where) {
  object o;
  if (e.get(o)) fail(where, "expected an object");
  return o;
}

inline array as_array(element e, const std::string& where) {
  array a;
  if (e.get(a)) fail(where, "expected an array");
  return a;
}

inline std::string_view as_string(element e, const std::string& where) {
  std::string_view s;
  if (e.get(s)) fail(where, "expected a string");
  return s;
}

inline std::int64_t as_int(element e, const std::string& where) {
  std::int64_t v;
  if (e.get(v)) {
    std::uint64_t u;
    if (e.get(u) || u > INT64_MAX) fail(where, "expected an integer");
    return static_cast<std::int64_t>(u);
  }
  return v;
}

// The member, or nullopt when the key is absent or null.
inline std::optional<element> member(object o, std::string_view key) {
  element e;
  if (o.at_key(key).get(e) || e.is_null()) return std::nullopt;
  return e;
}

inline element required(object o, std::string_view key, const std::string& where) {
  auto e = member(o, key);
  if (!e) fail(where, "missing key \"" + std::string(key) + "\"");
  return *e;
}

inline std::string_view string_or(object o, std::string_view key, std::string_view fallback,
                                  const std::string& where) {
  auto e = member(o, key);
  return e ? as_string(*e, where + "." + std::string(key)) : fallback;
}

inline bool bool_or(object o, std::string_view key, bool fallback, const std::string& where) {
  auto e = member(o, key);
  if (!e) return fallback;
  bool b;
  if (e->get(b)) fail(where + "." + std::string(key), "expected true or false");
  return b;
}

inline std::int64_t int_or(object o, std::string_view key, std::int64_t fallback,
                           const std::string& where) {
  auto e = member(o, key);
  return e ? as_int(*e, where + "." + std::string(key)) : fallback;
}

}  // namespace moeline::tokenizer::tok::json
