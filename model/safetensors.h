#pragma once
// Read-only, memory-mapped safetensors checkpoints: one file, or shards listed by
// model.safetensors.index.json. Tensors are views into the mapping — nothing is copied. Every
// structural problem (bad header, offsets past the end, size that does not match the shape,
// unsupported dtype) raises StatusError naming the file and the tensor.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/dtype.h"

namespace moeline::model {

class GgufFile;

class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

struct TensorInfo {
  std::string name;
  std::string dtype_name;      // as written in the header ("BF16", "F32", ...), or ggml's type name
  std::vector<int64_t> shape;  // outermost first (a GGUF tensor's dims reversed)
  const std::byte* data = nullptr;
  size_t bytes = 0;
  const MappedFile* file = nullptr;

  std::string file_name() const { return file->path().filename().string(); }
  std::string shape_string() const;
  int64_t elements() const;
};

class Checkpoint {
 public:
  // Opens model.safetensors.index.json (sharded) or model.safetensors in `dir`.
  static Checkpoint open(const std::filesystem::path& dir);
  // The tensors of a GGUF file, under their GGUF names, shapes outermost first. Refuses tensors
  // whose bytes overlap.
  static Checkpoint from_gguf(const GgufFile& gguf);

  const TensorInfo* find(const std::string& name) const;
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  size_t mapped_bytes() const;
  // The opened files, in a fixed order, and which of them holds `address` at what offset.
  std::vector<std::filesystem::path> file_paths() const;
  struct Location {
    size_t file = 0;
    uint64_t offset = 0;
  };
  std::optional<Location> locate(const void* address) const;
  // Names of the files that were opened, for messages.
  std::string describe() const;

 private:
  void add_file(const std::filesystem::path& path, const std::vector<std::string>* expected_names);

  std::vector<std::shared_ptr<const MappedFile>> files_;
  std::map<std::string, TensorInfo> tensors_;
};

// Maps a header dtype string (or a GGUF type name) to a supported kernels::DType, or throws
// naming file and tensor.
kernels::DType supported_dtype(const TensorInfo& tensor);

}  // namespace moeline::model
