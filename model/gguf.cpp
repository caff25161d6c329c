#include "model/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string_view>

namespace moeline::model {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF", little-endian
constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
// Bounds that no real file comes near, checked before anything is allocated for them.
constexpr uint64_t kMaxCount = uint64_t{1} << 24;
constexpr int kMaxArrayDepth = 4;

enum ValueType : uint32_t {
  kU8 = 0,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kF32,
  kBool,
  kString,
  kArray,
  kU64,
  kI64,
  kF64,
};

// A cursor over the header that refuses to read past the end of the file.
class Reader {
 public:
  explicit Reader(const MappedFile& file) : file_(file), at_(0) {}

  template <typename T>
  T scalar(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, file_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }

  std::string string(const char* what) {
    const auto length = scalar<uint64_t>(what);
    need(length, what);
    std::string text(reinterpret_cast<const char*>(file_.data() + at_), length);
    at_ += length;
    return text;
  }

  nlohmann::json value(uint32_t type, const std::string& key, int depth = 0) {
    const std::string what = "metadata '" + key + "'";
    const char* w = what.c_str();
    switch (type) {
      case kU8:
        return scalar<uint8_t>(w);
      case kI8:
        return scalar<int8_t>(w);
      case kU16:
        return scalar<uint16_t>(w);
      case kI16:
        return scalar<int16_t>(w);
      case kU32:
        return scalar<uint32_t>(w);
      case kI32:
        return scalar<int32_t>(w);
      case kF32:
        return scalar<float>(w);
      case kBool:
        return scalar<uint8_t>(w) != 0;
      case kString:
        return string(w);
      case kU64:
        return scalar<uint64_t>(w);
      case kI64:
        return scalar<int64_t>(w);
      case kF64:
        return scalar<double>(w);
      case kArray: {
        if (depth >= kMaxArrayDepth) fail(what + " nests arrays too deeply");
        const auto element = scalar<uint32_t>(w);
        const auto count = scalar<uint64_t>(w);
        // Every element takes at least one byte: a count past the file is a lie, refused before
        // anything is reserved for it.
        need(count, w);
        nlohmann::json array = nlohmann::json::array();
        for (uint64_t i = 0; i < count; ++i) array.push_back(value(element, key, depth + 1));
        return array;
      }
      default:
        fail(what + " has an unknown value type " + std::to_string(type));
    }
  }

  uint64_t position() const { return at_; }

  [[noreturn]] void fail(const std::string& why) const {
    throw StatusError(file_.path().filename().string() + ": " + why);
  }

 private:
  void need(uint64_t bytes, const char* what) const {
    if (bytes > file_.size() - at_)
      fail(std::string("truncated: ") + what + " runs past the end of the file");
  }

  const MappedFile& file_;
  uint64_t at_;
};

}  // namespace

int64_t GgufTensor::elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

GgufFile GgufFile::open(const std::filesystem::path& path) {
  GgufFile gguf;
  gguf.file_ = std::make_shared<const MappedFile>(path);
  const MappedFile& file = *gguf.file_;
  Reader reader(file);
  if (reader.scalar<uint32_t>("the magic") != kMagic) reader.fail("not a GGUF file (bad magic)");
  gguf.version_ = reader.scalar<uint32_t>("the version");
  if (gguf.version_ != 2 && gguf.version_ != 3)
    reader.fail("GGUF version " + std::to_string(gguf.version_) +
                " is not supported (2 and 3 are)");
  const auto tensor_count = reader.scalar<uint64_t>("the tensor count");
  const auto metadata_count = reader.scalar<uint64_t>("the metadata count");
  if (tensor_count > kMaxCount || metadata_count > kMaxCount)
    reader.fail("implausible counts: " + std::to_string(tensor_count) + " tensors, " +
                std::to_string(metadata_count) + " metadata keys");

  for (uint64_t i = 0; i < metadata_count; ++i) {
    const std::string key = reader.string("a metadata key");
    const auto type = reader.scalar<uint32_t>(("metadata '" + key + "'").c_str());
    gguf.metadata_[key] = reader.value(type, key);
  }
  if (const nlohmann::json& alignment = gguf.value("general.alignment"); !alignment.is_null()) {
    if (!alignment.is_number_unsigned() || alignment.get<uint64_t>() == 0 ||
        (alignment.get<uint64_t>() & (alignment.get<uint64_t>() - 1)) != 0 ||
        alignment.get<uint64_t>() > 4096)
      reader.fail("general.alignment must be a power of two up to 4096");
    gguf.alignment_ = alignment.get<uint64_t>();
  }

  std::vector<GgufTensor> pending;
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensor tensor;
    tensor.name = reader.string("a tensor name");
    const std::string what = "tensor '" + tensor.name + "'";
    const auto dims = reader.scalar<uint32_t>(what.c_str());
    if (dims == 0 || dims > kMaxDims)
      reader.fail("tensor '" + tensor.name + "' has " + std::to_string(dims) + " dimensions");
    for (uint32_t d = 0; d < dims; ++d) {
      const auto size = reader.scalar<uint64_t>(what.c_str());
      if (size == 0 || size > (uint64_t{1} << 40))
        reader.fail("tensor '" + tensor.name + "' has a dimension of " + std::to_string(size));
      tensor.dims.push_back(static_cast<int64_t>(size));
    }
    const auto type = reader.scalar<uint32_t>(what.c_str());
    auto traits = kernels::quant_traits(type);
    if (!traits)
      reader.fail("tensor '" + tensor.name + "' is " + std::string(kernels::ggml_type_name(type)) +
                  " (ggml type " + std::to_string(type) +
                  "), which this build does not read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, "
                  "Q5_1, Q4_K, Q5_K, Q6_K)");
    tensor.type = *traits;
    tensor.offset = reader.scalar<uint64_t>(what.c_str());
    if (tensor.dims[0] % traits->block_elements != 0)
      reader.fail("tensor '" + tensor.name + "': a row of " + std::to_string(tensor.dims[0]) +
                  " is not a whole number of " + std::string(traits->name) + " blocks");
    // Bytes = blocks per row * block bytes * rows; a dimension is at most 2^40 and a block at
    // most 210 bytes, and each further product is checked against the file's size first.
    uint64_t bytes = static_cast<uint64_t>(tensor.dims[0] / traits->block_elements) *
                     static_cast<uint64_t>(traits->block_bytes);
    for (size_t d = 1; d < tensor.dims.size(); ++d) {
      if (bytes > file.size() / static_cast<uint64_t>(tensor.dims[d]))
        reader.fail("tensor '" + tensor.name + "' is larger than the file");
      bytes *= static_cast<uint64_t>(tensor.dims[d]);
    }
    if (bytes > file.size()) reader.fail("tensor '" + tensor.name + "' is larger than the file");
    tensor.bytes = static_cast<size_t>(bytes);
    if (tensor.offset % gguf.alignment_ != 0)
      reader.fail("tensor '" + tensor.name + "' is not aligned to " +
                  std::to_string(gguf.alignment_) + " bytes");
    pending.push_back(std::move(tensor));
  }

  // The data section starts at the next multiple of the alignment after the tensor table.
  const uint64_t data_start =
      (reader.position() + gguf.alignment_ - 1) / gguf.alignment_ * gguf.alignment_;
  for (GgufTensor& tensor : pending) {
    if (data_start > file.size() || tensor.offset > file.size() - data_start ||
        tensor.bytes > file.size() - data_start - tensor.offset)
      reader.fail("tensor '" + tensor.name + "' lies past the end of the file (truncated?)");
    tensor.data = file.data() + data_start + tensor.offset;
    const std::string name = tensor.name;
    if (!gguf.tensors_.emplace(name, std::move(tensor)).second)
      reader.fail("tensor '" + name + "' appears twice");
  }
  return gguf;
}

const nlohmann::json& GgufFile::value(const std::string& key) const {
  static const nlohmann::json kNull;
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? kNull : *it;
}

const GgufTensor* GgufFile::find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<float> GgufFile::dequantize(const GgufTensor& tensor) const {
  std::vector<float> out(static_cast<size_t>(tensor.elements()));
  const int64_t row_bytes = tensor.dims[0] / tensor.type.block_elements * tensor.type.block_bytes;
  for (int64_t r = 0; r < tensor.rows(); ++r)
    kernels::dequantize_row(tensor.type.type, tensor.data + r * row_bytes, tensor.dims[0],
                            out.data() + r * tensor.dims[0]);
  return out;
}

Checkpoint Checkpoint::from_gguf(const GgufFile& gguf) {
  Checkpoint checkpoint;
  checkpoint.files_.push_back(gguf.file());
  std::vector<const GgufTensor*> by_offset;
  for (const auto& [name, tensor] : gguf.tensors()) {
    TensorInfo info;
    info.name = name;
    info.dtype_name = std::string(tensor.type.name);
    info.shape.assign(tensor.dims.rbegin(), tensor.dims.rend());
    info.data = tensor.data;
    info.bytes = tensor.bytes;
    info.file = gguf.file().get();
    checkpoint.tensors_.emplace(name, std::move(info));
    by_offset.push_back(&tensor);
  }
  // Two tensors sharing bytes would let a crafted file alias one weight with another.
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->offset < by_offset[i - 1]->offset + by_offset[i - 1]->bytes)
      throw StatusError(gguf.path().filename().string() + ": tensors '" + by_offset[i - 1]->name +
                        "' and '" + by_offset[i]->name + "' overlap");
  return checkpoint;
}

}  // namespace moeline::model
