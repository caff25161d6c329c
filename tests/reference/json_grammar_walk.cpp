// Drives model/json_grammar.h for tests/reference/test_json_grammar.py, which checks it against
// Python's json and jsonschema libraries.
//   json_grammar_walk walk SCHEMA_FILE COUNT SEED   COUNT random documents the grammar accepts,
//                                                   one per line as a JSON string ("" for a walk
//                                                   that did not end within its length, null for
//                                                   one that reached a point where no byte could
//                                                   come and the document could not end)
//   json_grammar_walk check SCHEMA_FILE             for each line of stdin (a JSON string), 1 if
//                                                   the grammar accepts it whole, else 0
// SCHEMA_FILE "-object" stands for json_object mode.
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/json_grammar.h"

using moeline::model::JsonGrammar;
using moeline::model::JsonMatcher;

namespace {

std::shared_ptr<const JsonGrammar> load(const std::string& path) {
  if (path == "-object") return JsonGrammar::any_object();
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto grammar = JsonGrammar::compile(text.str());
  if (!grammar) {
    std::cerr << grammar.error().message << "\n";
    std::exit(2);
  }
  return *grammar;
}

// A walk picks each next byte at random among those the grammar allows; past a soft length it
// prefers the bytes that close things, so that most walks end.
std::optional<std::string> walk(const std::shared_ptr<const JsonGrammar>& grammar,
                                std::mt19937_64& rng) {
  JsonMatcher matcher(grammar);
  std::string document;
  constexpr size_t kSoft = 60, kHard = 4000;
  while (document.size() < kHard) {
    if (matcher.can_end() && (document.size() > kSoft || rng() % 4 == 0)) return document;
    std::vector<std::pair<uint8_t, double>> allowed;
    double total = 0;
    for (int byte = 0; byte < 256; ++byte) {
      JsonMatcher probe = matcher;
      const char c = static_cast<char>(byte);
      if (!probe.advance(std::string_view(&c, 1))) continue;
      double weight = 1.0;
      if (byte >= 0x80) weight = 0.05;  // keep multi-byte characters, but not most of the text
      if (document.size() > kSoft) {
        if (byte == '"' || byte == '}' || byte == ']')
          weight = 500.0;
        else if (byte == ' ' || byte == '\n' || byte == '\t' || byte == '\r' || byte == '\\')
          weight = 0.01;
        else if (byte == '[' || byte == '{')
          weight = 0.01;
      }
      allowed.emplace_back(static_cast<uint8_t>(byte), weight);
      total += weight;
    }
    if (allowed.empty()) {
      if (matcher.can_end()) return document;  // the whitespace allowed at the end ran out
      std::cerr << "dead end after " << nlohmann::json(document).dump() << "\n";
      return std::nullopt;
    }
    double target = std::uniform_real_distribution<double>(0.0, total)(rng);
    uint8_t chosen = allowed.back().first;
    for (const auto& [byte, weight] : allowed) {
      if (target < weight) {
        chosen = byte;
        break;
      }
      target -= weight;
    }
    const char c = static_cast<char>(chosen);
    matcher.advance(std::string_view(&c, 1));
    document.push_back(c);
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: json_grammar_walk walk|check SCHEMA_FILE [COUNT SEED]\n";
    return 2;
  }
  const std::string mode = argv[1];
  auto grammar = load(argv[2]);
  if (mode == "walk" && argc == 5) {
    std::mt19937_64 rng(std::stoull(argv[4]));
    const int count = std::stoi(argv[3]);
    for (int i = 0; i < count; ++i) {
      const std::optional<std::string> document = walk(grammar, rng);
      const nlohmann::json line = document ? nlohmann::json(*document) : nlohmann::json();
      std::cout << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
    return 0;
  }
  if (mode == "check") {
    std::string line;
    while (std::getline(std::cin, line)) {
      const std::string document = nlohmann::json::parse(line).get<std::string>();
      JsonMatcher matcher(grammar);
      std::cout << (matcher.advance(document) && matcher.can_end() ? 1 : 0) << "\n";
    }
    return 0;
  }
  std::cerr << "unknown mode " << mode << "\n";
  return 2;
}
