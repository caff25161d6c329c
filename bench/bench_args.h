#pragma once
// What the approximate-reuse bench drivers share: "--name value" flags over defaults, comma lists,
// and the checkpoint (with its tokenizer) they run on. Errors end the process with a message: these
// are command-line tools, not library code.
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace moeline::bench {

using Flags = std::map<std::string, std::string>;

// Every flag must be one of `defaults`' keys; exits 2 naming an unknown one.
inline Flags parse_flags(int argc, char** argv, Flags defaults) {
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!defaults.count(argv[i])) {
      std::cerr << "unknown flag " << argv[i] << " (known:";
      for (const auto& [name, value] : defaults) std::cerr << ' ' << name;
      std::cerr << ")\n";
      std::exit(2);
    }
    defaults[argv[i]] = argv[i + 1];
  }
  if (argc % 2 == 0) {
    std::cerr << argv[argc - 1] << " needs a value\n";
    std::exit(2);
  }
  return defaults;
}

// "a,b,c" as numbers, or as the words themselves when T is std::string.
template <typename T>
std::vector<T> parse_list(const std::string& text) {
  std::vector<T> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if constexpr (std::is_same_v<T, std::string>)
      out.push_back(item);
    else
      out.push_back(static_cast<T>(std::stod(item)));
  }
  return out;
}

inline std::unique_ptr<model::Model> load_model(const std::string& dir) {
  auto loaded = model::Model::load(dir);
  if (!loaded) {
    std::cerr << loaded.error().message << '\n';
    std::exit(1);
  }
  return std::move(*loaded);
}

// A checkpoint and its tokenizer.
struct Checkpoint {
  std::unique_ptr<model::Model> model;
  tokenizer::Tokenizer tokenizer;
};

inline tokenizer::Tokenizer load_tokenizer(const std::string& dir);

inline Checkpoint load_checkpoint(const std::string& dir) {
  return {load_model(dir), load_tokenizer(dir)};
}

inline tokenizer::Tokenizer load_tokenizer(const std::string& dir) {
  auto tokenizer =
      tokenizer::Tokenizer::load((std::filesystem::path(dir) / "tokenizer.json").string());
  if (!tokenizer) {
    std::cerr << tokenizer.error().message << '\n';
    std::exit(1);
  }
  return std::move(*tokenizer);
}

}  // namespace moeline::bench
