#pragma once
// Read-only GGUF files (llama.cpp's format, versions 2 and 3), memory-mapped: the header, the
// metadata (as JSON values: integers keep their signedness, arrays their elements) and the tensor
// table, whose data are views into the mapping. Every structural problem (bad magic or version,
// a count or length past the file, a tensor outside the data section or misaligned, a shape
// that overflows, a type this build cannot read) raises StatusError naming the file and the key or
// tensor. Dimensions are listed as GGUF lists them, fastest-varying first (ne[0] is a row's
// length).

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cpu/quant.h"
#include "model/safetensors.h"

namespace moeline::model {

struct GgufTensor {
  std::string name;
  std::vector<int64_t> dims;  // ne[0] (a row) first
  kernels::QuantTraits type;
  uint64_t offset = 0;  // from the start of the data section
  const std::byte* data = nullptr;
  size_t bytes = 0;

  int64_t elements() const;
  int64_t rows() const { return dims.empty() ? 0 : elements() / dims[0]; }
};

class GgufFile {
 public:
  static GgufFile open(const std::filesystem::path& path);

  uint32_t version() const { return version_; }
  const nlohmann::json& metadata() const { return metadata_; }
  // A metadata value, or null when the key is absent.
  const nlohmann::json& value(const std::string& key) const;
  const std::map<std::string, GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find(const std::string& name) const;
  uint64_t alignment() const { return alignment_; }
  const std::filesystem::path& path() const { return file_->path(); }
  const std::shared_ptr<const MappedFile>& file() const { return file_; }

  // The tensor's weights as F32 (dequantized as the format defines it).
  std::vector<float> dequantize(const GgufTensor& tensor) const;

 private:
  std::shared_ptr<const MappedFile> file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  nlohmann::json metadata_ = nlohmann::json::object();
  std::map<std::string, GgufTensor> tensors_;
};

}  // namespace moeline::model
