// Tokenizer speed: load time of a tokenizer.json and single-thread encode throughput on a text
// file. Prints one JSON object; bench/tokenizer_reference.js measures the Hugging Face library
// the same way so scripts/bench can show both in one table.
//   moeline_tokenizer_bench --tokenizer FILE --text FILE [--repeat N]
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer_path, text_path;
  int repeat = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--tokenizer")
      tokenizer_path = argv[i + 1];
    else if (flag == "--text")
      text_path = argv[i + 1];
    else if (flag == "--repeat")
      repeat = std::max(1, std::stoi(argv[i + 1]));
  }
  if (tokenizer_path.empty() || text_path.empty()) {
    std::cerr << "usage: moeline_tokenizer_bench --tokenizer FILE --text FILE [--repeat N]\n";
    return 2;
  }
  std::ifstream in(text_path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();

  std::vector<double> load_ms;
  for (int r = 0; r < repeat; ++r) {
    const double t0 = now_ms();
    auto tok = moeline::tokenizer::Tokenizer::load(tokenizer_path);
    load_ms.push_back(now_ms() - t0);
    if (!tok.ok()) {
      std::cerr << tok.error().message << "\n";
      return 1;
    }
  }
  auto tok = moeline::tokenizer::Tokenizer::load(tokenizer_path);
  // The first encode fills the word cache (cold); the repeats are the steady state.
  std::vector<double> encode_ms;
  std::size_t tokens = 0;
  for (int r = 0; r < repeat + 1; ++r) {
    const double t0 = now_ms();
    auto ids = tok->encode(text);
    encode_ms.push_back(now_ms() - t0);
    if (!ids.ok()) {
      std::cerr << ids.error().message << "\n";
      return 1;
    }
    tokens = ids->size();
  }
  // The same text as separate documents, one per line: many short encodes, as a server sees.
  std::vector<std::string> lines;
  for (std::size_t at = 0; at < text.size();) {
    std::size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    if (nl > at) lines.emplace_back(text.substr(at, nl - at));
    at = nl + 1;
  }
  std::vector<double> lines_ms;
  std::size_t line_bytes = 0;
  for (const auto& l : lines) line_bytes += l.size();
  for (int r = 0; r < repeat; ++r) {
    const double t0 = now_ms();
    for (const auto& l : lines) {
      if (!tok->encode(l).ok()) return 1;
    }
    lines_ms.push_back(now_ms() - t0);
  }
  const double mb = static_cast<double>(text.size()) / 1e6;
  const double cold = encode_ms.front();
  encode_ms.erase(encode_ms.begin());
  std::cout << "{\"engine\":\"moeline\",\"vocab\":" << tok->vocab_size()
            << ",\"load_ms\":" << median(load_ms) << ",\"bytes\":" << text.size()
            << ",\"tokens\":" << tokens << ",\"encode_cold_mb_s\":" << mb / (cold / 1e3)
            << ",\"encode_mb_s\":" << mb / (median(encode_ms) / 1e3)
            << ",\"lines\":" << lines.size() << ",\"encode_lines_mb_s\":"
            << static_cast<double>(line_bytes) / 1e6 / (median(lines_ms) / 1e3) << "}\n";
  return 0;
}
