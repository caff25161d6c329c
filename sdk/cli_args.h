#pragma once
// Parsing of numeric and id-list flags, shared by the commands that take them (`moeline client`,
// `moeline run`), and how a command reports errors. Parse errors are std::invalid_argument naming
// the flag and the text.

#include <charconv>
#include <cstdint>
#include <iostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace moeline::sdk {

template <class T>
T parse_number(const std::string& flag, const std::string& text) {
  T value{};
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || text.empty())
    throw std::invalid_argument(flag + " expects " +
                                (std::is_integral_v<T> ? "an integer" : "a number") + ", got '" +
                                text + "'");
  return value;
}

// "1, 2,3" -> {1, 2, 3}
inline std::vector<int32_t> parse_id_list(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(start, comma - start);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    ids.push_back(parse_number<int32_t>(flag, item));
    start = comma + 1;
  }
  return ids;
}

// Runs a command: a usage error (an exception of type UsageErrorType) prints the usage and the
// error and returns 2; any other exception prints the error and returns 1.
template <class UsageErrorType, class Body>
int run_reporting_errors(const char* usage, Body&& body) {
  try {
    return body();
  } catch (const UsageErrorType& e) {
    std::cerr << usage << "moeline: error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moeline: error: " << e.what() << '\n';
    return 1;
  }
}

}  // namespace moeline::sdk
