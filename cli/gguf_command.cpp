#include "cli/gguf_command.h"

#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "base/suggest.h"
#include "cli/npy.h"
#include "model/gguf.h"

namespace moeline::cli {
namespace {

constexpr const char* kUsage = R"(usage: moeline gguf FILE.gguf [--tensor NAME --out FILE.npy]

Prints one JSON object: the GGUF version, the alignment, the metadata (arrays longer than 16
elements as their length and first 16), and every tensor's type, dimensions (a row's length
first, as GGUF lists them), offset and bytes. With --tensor and --out, writes that tensor
dequantized to float32 .npy, shaped [rows, row] (numpy order: the GGUF dimensions reversed).
A file this build cannot read is an error naming what is wrong (exit 1).
)";

nlohmann::json summarize(const nlohmann::json& value) {
  if (!value.is_array() || value.size() <= 16) return value;
  nlohmann::json head = nlohmann::json::array();
  for (size_t i = 0; i < 16; ++i) head.push_back(value[i]);
  return {{"length", value.size()}, {"first", head}};
}

}  // namespace

int gguf_command(int argc, char** argv) {
  std::string path, tensor_name, out;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::cout << kUsage;
      return 0;
    }
    if ((arg == "--tensor" || arg == "--out") && i + 1 < argc) {
      (arg == "--tensor" ? tensor_name : out) = argv[++i];
    } else if (!arg.empty() && arg[0] != '-' && path.empty()) {
      path = arg;
    } else {
      std::cerr << kUsage << "moeline: error: unexpected argument '" << arg << "'"
                << did_you_mean(arg, flags_in(kUsage)) << '\n';
      return 2;
    }
  }
  if (path.empty() || tensor_name.empty() != out.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  try {
    const model::GgufFile file = model::GgufFile::open(path);
    if (!tensor_name.empty()) {
      const model::GgufTensor* tensor = file.find(tensor_name);
      if (tensor == nullptr) {
        std::cerr << "moeline gguf: no tensor '" << tensor_name << "' in " << path << '\n';
        return 1;
      }
      const std::vector<float> values = file.dequantize(*tensor);
      std::vector<int64_t> shape(tensor->dims.rbegin(), tensor->dims.rend());
      if (!write_npy(out, values, shape)) {
        std::cerr << "moeline gguf: cannot write " << out << '\n';
        return 1;
      }
      return 0;
    }
    nlohmann::json metadata = nlohmann::json::object();
    for (const auto& [key, value] : file.metadata().items()) metadata[key] = summarize(value);
    nlohmann::json tensors = nlohmann::json::array();
    for (const auto& [name, tensor] : file.tensors())
      tensors.push_back({{"name", name},
                         {"type", tensor.type.name},
                         {"dims", tensor.dims},
                         {"offset", tensor.offset},
                         {"bytes", tensor.bytes}});
    nlohmann::json summary = {{"version", file.version()},
                              {"alignment", file.alignment()},
                              {"metadata", metadata},
                              {"tensors", tensors}};
    std::cout << summary.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "moeline gguf: " << e.what() << '\n';
    return 1;
  }
}

}  // namespace moeline::cli
