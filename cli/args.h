#pragma once
// Parsing of numeric and id-list flags, shared by the commands that take them (`moeline client`,
// `moeline run`), and how a command reports errors. Parse errors are std::invalid_argument naming
// the flag and the text.

#include <charconv>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moeline::cli {

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

// "a, b ,c" -> {"a", "b", "c"}: a comma-separated list, each item without its surrounding spaces.
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(start, comma - start);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    items.push_back(std::move(item));
    start = comma + 1;
  }
  return items;
}

// "1, 2,3" -> {1, 2, 3}
inline std::vector<int32_t> parse_id_list(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  for (const std::string& item : split_list(text)) ids.push_back(parse_number<int32_t>(flag, item));
  return ids;
}

// "42=-100, 7=2.5" -> {(42, -100), (7, 2.5)}: token ids and their logit bias.
inline std::vector<std::pair<int32_t, float>> parse_logit_bias(const std::string& flag,
                                                               const std::string& text) {
  std::vector<std::pair<int32_t, float>> entries;
  for (const std::string& item : split_list(text)) {
    const size_t equals = item.find('=');
    if (equals == std::string::npos)
      throw std::invalid_argument(flag + " expects TOKEN=BIAS pairs, got '" + item + "'");
    entries.emplace_back(parse_number<int32_t>(flag, item.substr(0, equals)),
                         parse_number<float>(flag, item.substr(equals + 1)));
  }
  return entries;
}

// The sampling flags `moeline run` and `moeline client generate` both take (true: it has a value).
inline const std::map<std::string, bool>& sampling_flags() {
  static const std::map<std::string, bool> flags = {{"--max-tokens", true},
                                                    {"--temperature", true},
                                                    {"--top-k", true},
                                                    {"--top-p", true},
                                                    {"--seed", true},
                                                    {"--stop-ids", true},
                                                    {"--ignore-eos", false},
                                                    {"--min-tokens", true},
                                                    {"--min-p", true},
                                                    {"--presence-penalty", true},
                                                    {"--frequency-penalty", true},
                                                    {"--repetition-penalty", true},
                                                    {"--logprobs", true},
                                                    {"--prompt-logprobs", true},
                                                    {"--logit-bias", true},
                                                    {"--json-object", false},
                                                    {"--json-schema", true},
                                                    {"--reasoning", true}};
  return flags;
}

// Sets what one of sampling_flags() says on `options` (model::SamplingParams or
// sdk::GenerateOptions: the same field names); false for any other flag.
template <class Options>
bool parse_sampling_flag(const std::string& flag, const std::string& value, Options& options) {
  if (flag == "--max-tokens")
    options.max_tokens = parse_number<decltype(options.max_tokens)>(flag, value);
  else if (flag == "--temperature")
    options.temperature = parse_number<double>(flag, value);
  else if (flag == "--top-k")
    options.top_k = parse_number<decltype(options.top_k)>(flag, value);
  else if (flag == "--top-p")
    options.top_p = parse_number<double>(flag, value);
  else if (flag == "--seed")
    options.seed = parse_number<uint64_t>(flag, value);
  else if (flag == "--stop-ids")
    options.stop_token_ids = parse_id_list(flag, value);
  else if (flag == "--ignore-eos")
    options.ignore_eos = true;
  else if (flag == "--min-tokens")
    options.min_tokens = parse_number<decltype(options.min_tokens)>(flag, value);
  else if (flag == "--min-p")
    options.min_p = parse_number<double>(flag, value);
  else if (flag == "--presence-penalty")
    options.presence_penalty = parse_number<double>(flag, value);
  else if (flag == "--frequency-penalty")
    options.frequency_penalty = parse_number<double>(flag, value);
  else if (flag == "--repetition-penalty")
    options.repetition_penalty = parse_number<double>(flag, value);
  else if (flag == "--logprobs") {
    options.logprobs = true;
    options.top_logprobs = parse_number<decltype(options.top_logprobs)>(flag, value);
  } else if (flag == "--prompt-logprobs") {
    options.prompt_logprobs = true;
    options.top_logprobs = parse_number<decltype(options.top_logprobs)>(flag, value);
  } else if (flag == "--json-object") {
    options.structured = decltype(options.structured)::kJsonObject;
  } else if (flag == "--json-schema") {
    std::ifstream file(value);
    if (!file) throw std::invalid_argument(flag + " cannot read '" + value + "'");
    options.structured = decltype(options.structured)::kJsonSchema;
    options.json_schema.assign(std::istreambuf_iterator<char>(file),
                               std::istreambuf_iterator<char>());
  } else if (flag == "--reasoning") {
    using Block = decltype(options.reasoning);
    if (value == "may-open")
      options.reasoning = Block::kMayOpen;
    else if (value == "open")
      options.reasoning = Block::kOpen;
    else if (value == "none")
      options.reasoning = Block::kNone;
    else
      throw std::invalid_argument(flag + " expects none, may-open or open, got '" + value + "'");
  } else if (flag == "--logit-bias") {
    options.logit_bias.clear();
    for (const auto& [token, bias] : parse_logit_bias(flag, value))
      options.logit_bias.push_back({token, bias});
  } else {
    return false;
  }
  return true;
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

}  // namespace moeline::cli
