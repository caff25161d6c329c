#pragma once
// What the fuzz harnesses share. Each harness defines LLVMFuzzerTestOneInput: built with clang's
// libFuzzer by scripts/fuzz (coverage-guided, ASan + UBSan), and with g++ against replay_main.cpp
// for the test suite (the kept corpus, then random mutations for a few seconds).

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace moeline::fuzz {

// Splits the input into frames: each a little-endian u16 length and that many bytes (a short
// last frame takes what is left). The wire harness turns them into a multipart message.
inline std::vector<std::string_view> frames(const uint8_t* data, size_t size) {
  std::vector<std::string_view> out;
  size_t at = 0;
  while (at + 2 <= size && out.size() < 64) {
    const size_t length = static_cast<size_t>(data[at]) | (static_cast<size_t>(data[at + 1]) << 8);
    at += 2;
    const size_t take = std::min(length, size - at);
    out.emplace_back(reinterpret_cast<const char*>(data + at), take);
    at += take;
  }
  return out;
}

// A folder of this process's own (made once), where a harness writes the file under test.
inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    auto path =
        std::filesystem::temp_directory_path() / ("moeline-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    return path;
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace moeline::fuzz
