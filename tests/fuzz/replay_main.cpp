// The harnesses in the test suite, without libFuzzer (g++ builds): every input of the kept corpus,
// then random mutations of them (byte flips, insertions, truncations, splices) until the time is
// up. Not coverage-guided: scripts/fuzz runs libFuzzer for that. A crash, a sanitizer report or an
// uncaught exception fails the test; the input that did it is written to the working folder.
//
//   fuzz_<name> CORPUS_DIR SECONDS [SEED]

#include <chrono>
#include <cstdio>
#include <exception>
#include <random>

#include "fuzz.h"

namespace {

std::vector<uint8_t> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void mutate(std::vector<uint8_t>& input, const std::vector<std::vector<uint8_t>>& corpus,
            std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 8);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 6) {
      case 0:  // flip a bit
        if (!input.empty()) input[rng() % input.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:  // an interesting byte
        if (!input.empty()) {
          static const uint8_t values[] = {0, 1, 0x7f, 0x80, 0xff, '"', '{', '[', ':', ','};
          input[rng() % input.size()] = values[rng() % sizeof values];
        }
        break;
      case 2:  // insert random bytes
        input.insert(input.begin() + static_cast<std::ptrdiff_t>(rng() % (input.size() + 1)),
                     1 + rng() % 16, static_cast<uint8_t>(rng()));
        break;
      case 3:  // truncate
        if (!input.empty()) input.resize(rng() % input.size());
        break;
      case 4:  // splice in part of another corpus input
        if (!corpus.empty()) {
          const auto& other = corpus[rng() % corpus.size()];
          if (!other.empty()) {
            const size_t from = rng() % other.size();
            const size_t length = 1 + rng() % (other.size() - from);
            input.insert(input.begin() + static_cast<std::ptrdiff_t>(rng() % (input.size() + 1)),
                         other.begin() + static_cast<std::ptrdiff_t>(from),
                         other.begin() + static_cast<std::ptrdiff_t>(from + length));
          }
        }
        break;
      default:  // overwrite a little-endian u32 with an extreme
        if (input.size() >= 4) {
          static const uint32_t values[] = {0, 1, 0x7fffffff, 0x80000000, 0xffffffff, 0xffff};
          const uint32_t v = values[rng() % 6];
          std::memcpy(&input[rng() % (input.size() - 3)], &v, 4);
        }
        break;
    }
  }
  if (input.size() > (1u << 20)) input.resize(1u << 20);
}

void run(const std::vector<uint8_t>& input) {
  try {
    LLVMFuzzerTestOneInput(input.data(), input.size());
  } catch (const std::exception& e) {
    std::ofstream("fuzz-failure.bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(input.data()),
               static_cast<std::streamsize>(input.size()));
    std::fprintf(stderr, "fuzz: uncaught exception: %s (input in fuzz-failure.bin)\n", e.what());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR SECONDS [SEED]\n", argv[0]);
    return 2;
  }
  std::vector<std::vector<uint8_t>> corpus;
  if (std::filesystem::is_directory(argv[1]))
    for (const auto& entry : std::filesystem::directory_iterator(argv[1]))
      if (entry.is_regular_file()) corpus.push_back(read_file(entry.path()));
  for (const auto& input : corpus) run(input);
  std::mt19937_64 rng(argc > 3 ? std::stoull(argv[3]) : std::random_device{}());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(std::stoi(argv[2]));
  uint64_t executions = corpus.size();
  std::vector<uint8_t> input;
  while (std::chrono::steady_clock::now() < until) {
    input = corpus.empty() ? std::vector<uint8_t>() : corpus[rng() % corpus.size()];
    mutate(input, corpus, rng);
    run(input);
    ++executions;
  }
  std::filesystem::remove_all(moeline::fuzz::scratch());
  std::printf("fuzz: %zu corpus inputs, %llu executions, no failure\n", corpus.size(),
              static_cast<unsigned long long>(executions));
  return 0;
}
