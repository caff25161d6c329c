// The fast quantized matmul alone (kernels/cpu/quant_matmul.h), or the exact F32/BF16/F16 one
// (matmul.h) for those types, on one thread: for each weight type, a set of matrices shaped like
// `mini`'s experts (large enough together to be read from memory, as decode reads them) multiplied
// by 1 token (decode) and by tiles of tokens (prefill). Prints one JSON object per (type, shape,
// tokens): weights per second, weight bytes per second and ns per weight, best of --repeat, and
// beside them a plain read of the same bytes timed in the same rounds, as one stream and as two
// in turn (read_gb_per_second, the faster, and the kernel's fraction_of_read: how close a decode
// kernel comes to what one core can read at all). This isolates the kernels from the rest of a
// decode step for A/B runs of kernel changes (engine_bench measures the whole step). --claim-rows N
// calls the kernel on N rows at a time, as matmul's threads claim them in decode (16, or 64 for
// Q4_K); 0, the whole matrix. --streams 2 reads each matrix as decode's matmul does on a host with
// two decode streams per thread (StreamTuning): a claim from each half side by side, for the types
// that have a two-stream kernel (quant_two_streams).
//
// --tunings "A;B;..." compares kernel tunings in one process (MOELINE_KERNEL_TUNING's syntax
// each, over the host's default; "" is the default itself): the passes alternate between them,
// so that a VM's slow and fast spells fall on every tuning alike, and each tuning's line adds its
// median pass and the median of its passes' ratios to the first tuning's pass of the same round.
// A tuning's decode_streams sets its streams (--streams is then ignored).
//
//   moeline_quant_kernel_bench [--types q8_0,q4_0,q4_k,q5_k,q6_k,bf16,f16,f32] [--tokens 1,8,64]
//                              [--rows 2816] [--cols 1024] [--matrices 0] [--repeat 5]
//                              [--claim-rows 0] [--streams 1] [--tunings "A;B"]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "bench_args.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dtype.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quantize.h"
#include "read_probe.h"

namespace {

using namespace moeline;

struct NamedType {
  std::string name;
  kernels::DType dtype;
};

kernels::DType parse_type(const std::string& name) {
  static const std::vector<NamedType> kTypes = {
      {"q8_0", kernels::DType::kQ8_0}, {"q4_0", kernels::DType::kQ4_0},
      {"q4_k", kernels::DType::kQ4_K}, {"q5_k", kernels::DType::kQ5_K},
      {"q6_k", kernels::DType::kQ6_K}, {"bf16", kernels::DType::kBF16},
      {"f16", kernels::DType::kF16},   {"f32", kernels::DType::kF32}};
  for (const auto& type : kTypes)
    if (type.name == name) return type.dtype;
  std::cerr << "unknown type " << name << " (q8_0, q4_0, q4_k, q5_k, q6_k, bf16, f16, f32)\n";
  std::exit(2);
}

struct Tuning {
  std::string text;  // as given ("" for the host's default)
  kernels::StreamTuning tuning;
};

std::vector<Tuning> parse_tunings(const std::string& list, int streams) {
  const kernels::StreamTuning host = kernels::stream_tuning();
  if (list.empty()) {
    kernels::StreamTuning only = host;
    only.decode_streams = streams;
    return {{"", only}};
  }
  std::vector<Tuning> tunings;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(';', start), list.size());
    Tuning tuning{list.substr(start, end - start), host};
    if (!tuning.text.empty() && !kernels::parse_stream_tuning(tuning.text.c_str(), tuning.tuning)) {
      std::cerr << "--tunings: cannot read \"" << tuning.text << "\"\n";
      std::exit(2);
    }
    tunings.push_back(tuning);
    start = end + 1;
  }
  return tunings;
}

// Every byte of the matrices read once, in order (bench/read_probe.h), as one stream or two.
uint64_t read_all(const std::vector<std::vector<uint8_t>>& copies, bool two_streams) {
  uint64_t total = 0;
  for (const auto& copy : copies)
    total += moeline::bench::read_sum(copy.data(), copy.size(), two_streams);
  return total;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  const auto flags = bench::parse_flags(argc, argv,
                                        {{"--types", "q8_0,q4_0,q4_k,q5_k,q6_k"},
                                         {"--tokens", "1,8,64"},
                                         {"--rows", "2816"},
                                         {"--cols", "1024"},
                                         {"--matrices", "0"},
                                         {"--repeat", "5"},
                                         {"--claim-rows", "0"},
                                         {"--streams", "1"},
                                         {"--tunings", ""}});
  const int64_t rows = std::stoll(flags.at("--rows")), cols = std::stoll(flags.at("--cols"));
  const int matrices = std::stoi(flags.at("--matrices")), repeat = std::stoi(flags.at("--repeat"));
  const int64_t claim = std::stoll(flags.at("--claim-rows"));
  const int64_t claim_rows = claim > 0 ? claim : rows;
  const int streams = std::stoi(flags.at("--streams"));
  if (cols % 256 != 0 || rows <= 0 || matrices < 0 || repeat <= 0 || claim < 0 ||
      (streams != 1 && streams != 2)) {
    std::cerr << "--cols must be a multiple of 256; --rows, --repeat positive; --matrices not "
                 "negative; "
                 "--claim-rows not negative; --streams 1 or 2\n";
    return 2;
  }
  const std::vector<Tuning> tunings = parse_tunings(flags.at("--tunings"), streams);
  std::mt19937 random(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> weights(static_cast<size_t>(rows * cols));
  for (float& value : weights) value = normal(random);

  for (const auto& type_name : bench::parse_list<std::string>(flags.at("--types"))) {
    const kernels::DType dtype = parse_type(type_name);
    const bool quantized = kernels::is_quantized(dtype);
    // Which types matmul reads in two streams per thread when the tuning asks for two.
    const bool has_two_streams = !quantized || kernels::quant_two_streams(dtype);
    const auto row_bytes = static_cast<int64_t>(kernels::stored_bytes(dtype, cols));
    // One matrix (quantized, or converted to the wide type) copied again and again: the copies are
    // distinct memory, so a pass over all of them reads every byte from beyond the caches, as
    // decode reads its experts.
    std::vector<uint8_t> matrix(static_cast<size_t>(rows * row_bytes));
    for (int64_t r = 0; r < rows; ++r)
      kernels::quantize_row(dtype, weights.data() + r * cols, cols, matrix.data() + r * row_bytes);
    // --matrices 0: enough copies for 256 MiB (at least 24), far past any last-level cache (24
    // Q4_K matrices of the default shape are 39 MB, of which a 32 MiB L3 kept a share between
    // passes).
    const int copy_count =
        matrices > 0 ? matrices
                     : static_cast<int>(std::max<int64_t>(
                           24, ((int64_t{256} << 20) + rows * row_bytes - 1) / (rows * row_bytes)));
    std::vector<std::vector<uint8_t>> copies(static_cast<size_t>(copy_count), matrix);
    std::vector<kernels::MatrixView> views;
    for (auto& copy : copies) {
      kernels::MatrixView view;
      view.data = copy.data();
      view.dtype = dtype;
      view.rows = rows;
      view.cols = cols;
      views.push_back(view);
    }
    for (const int64_t tokens : bench::parse_list<int64_t>(flags.at("--tokens"))) {
      std::vector<float> x(static_cast<size_t>(tokens * cols));
      for (float& value : x) value = normal(random) * 50.0f;
      kernels::QuantizedActivations activations;
      if (quantized)
        kernels::quantize_activations(x.data(), tokens, cols, cols,
                                      kernels::activation_block(dtype), activations);
      std::vector<float> y(static_cast<size_t>(tokens * rows));
      // Rows [begin, end) of one matrix, and two ranges side by side, by the kernel for the type.
      auto rows_of = [&](const kernels::MatrixView& view, int64_t begin, int64_t end) {
        if (quantized)
          return kernels::quant_matmul_rows(view, activations, y.data(), rows, begin, end);
        kernels::matmul_rows({.x = x.data(), .n = tokens, .w = view, .y = y.data()}, begin, end);
      };
      auto two_rows_of = [&](const kernels::MatrixView& view, int64_t a, int64_t a_end, int64_t b,
                             int64_t b_end) {
        if (quantized)
          return kernels::quant_matmul_rows_two_streams(view, activations, y.data(), rows, a, a_end,
                                                        b, b_end);
        kernels::matmul_rows_two_streams({.x = x.data(), .n = tokens, .w = view, .y = y.data()}, a,
                                         a_end, b, b_end);
      };
      // One pass over every matrix, as decode's matmul reads them with `two_streams` or not.
      auto pass = [&](bool two_streams) {
        const auto start = std::chrono::steady_clock::now();
        for (const auto& view : views) {
          if (two_streams) {
            const int64_t half = (rows / 2 + 7) / 8 * 8;  // matmul's split, rows of 8
            for (int64_t a = 0, b = half; a < half || b < rows; a += claim_rows, b += claim_rows) {
              const int64_t a_end = std::min(half, a + claim_rows),
                            b_end = std::min(rows, b + claim_rows);
              if (a < half && b < rows)
                two_rows_of(view, a, a_end, b, b_end);
              else if (a < half)
                rows_of(view, a, a_end);
              else
                rows_of(view, b, b_end);
            }
            continue;
          }
          for (int64_t first = 0; first < rows; first += claim_rows)
            rows_of(view, first, std::min(rows, first + claim_rows));
        }
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      };
      std::vector<std::vector<double>> seconds(tunings.size());
      double read_seconds = 1e30;
      uint64_t read_sum = 0;
      for (int round = 0; round < repeat; ++round) {
        for (size_t t = 0; t < tunings.size(); ++t) {
          kernels::set_stream_tuning(tunings[t].tuning);
          seconds[t].push_back(pass(tunings[t].tuning.decode_streams == 2 && has_two_streams));
        }
        const auto start = std::chrono::steady_clock::now();
        read_sum += read_all(copies, round % 2 == 1);
        read_seconds = std::min(
            read_seconds,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      kernels::set_stream_tuning(parse_tunings("", streams).front().tuning);
      const double weight_count = static_cast<double>(rows * cols) * copy_count;
      const double bytes = static_cast<double>(rows * row_bytes) * copy_count;
      for (size_t t = 0; t < tunings.size(); ++t) {
        const double best = *std::min_element(seconds[t].begin(), seconds[t].end());
        const bool two_streams = tunings[t].tuning.decode_streams == 2 && has_two_streams;
        std::cout << "{\"type\":\"" << type_name << "\",\"isa\":\""
                  << kernels::isa_name(kernels::active_isa()) << "\",\"rows\":" << rows
                  << ",\"cols\":" << cols << ",\"claim_rows\":" << claim
                  << ",\"streams\":" << (two_streams ? 2 : 1) << ",\"matrices\":" << copy_count
                  << ",\"tokens\":" << tokens << ",\"seconds\":" << best
                  << ",\"weight_gb_per_second\":" << bytes / best / 1e9
                  << ",\"ns_per_weight_per_token\":" << best * 1e9 / weight_count / tokens
                  << ",\"read_gb_per_second\":" << bytes / read_seconds / 1e9
                  << ",\"fraction_of_read\":" << read_seconds / best;
        if (tunings.size() > 1) {
          std::vector<double> ratios;
          for (int round = 0; round < repeat; ++round)
            ratios.push_back(seconds[0][static_cast<size_t>(round)] /
                             seconds[t][static_cast<size_t>(round)]);
          std::cout << ",\"tuning\":\"" << tunings[t].text
                    << "\",\"median_gb_per_second\":" << bytes / median(seconds[t]) / 1e9
                    << ",\"median_speed_vs_first\":" << median(ratios);
        }
        std::cout << ",\"checksum\":" << y[0] << ",\"read_checksum\":" << read_sum % 1000 << "}"
                  << std::endl;
      }
    }
  }
  return 0;
}
