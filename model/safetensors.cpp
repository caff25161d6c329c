#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace moeline::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A safetensors header beyond this is certainly corrupt; real ones are a few MB at most.
constexpr uint64_t kMaxHeaderBytes = 256ull << 20;

size_t header_dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    return 1;
  return 0;
}

[[noreturn]] void fail(const fs::path& file, const std::string& what) {
  throw StatusError(file.filename().string() + ": " + what);
}

// Maps the file at a 2 MiB-aligned address and asks for huge pages, so that the kernel can read the
// file into 2 MiB page-cache folios and map them with huge page-table entries: decode streams every
// weight once per token, and with 4 KiB mappings it pays a page walk every 4 KiB (about 8% of
// decode speed on the benchmark shape, docs/PERFORMANCE.md). Pages already cached in small folios
// stay small; it is advice, and the mapping works the same without it.
void* map_aligned(int fd, size_t size) {
  constexpr size_t kHuge = size_t{2} << 20;
  void* reserved = ::mmap(nullptr, size + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (reserved == MAP_FAILED) return ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const auto start = reinterpret_cast<uintptr_t>(reserved);
  const uintptr_t aligned = (start + kHuge - 1) & ~(kHuge - 1);
  if (aligned > start) ::munmap(reserved, aligned - start);
  // The reservation past the file's last page goes back (munmap needs a page-aligned start: an
  // unaligned one failed and leaked up to 2 MiB of address space per file opened, found by
  // fuzzing the loader).
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t tail = (aligned + size + page - 1) & ~(page - 1);
  const uintptr_t reserved_end = start + size + kHuge;
  if (reserved_end > tail) ::munmap(reinterpret_cast<void*>(tail), reserved_end - tail);
  void* mapped =
      ::mmap(reinterpret_cast<void*>(aligned), size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
  if (mapped != MAP_FAILED) ::madvise(mapped, size, MADV_HUGEPAGE);
  return mapped;
}

}  // namespace

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw StatusError(path.string() + ": cannot open: " + std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int saved = errno;
    ::close(fd);
    throw StatusError(path.string() + ": cannot stat: " + std::strerror(saved));
  }
  size_ = static_cast<size_t>(info.st_size);
  if (size_ > 0) {
    void* mapped = map_aligned(fd, size_);
    if (mapped == MAP_FAILED) {
      const int saved = errno;
      ::close(fd);
      throw StatusError(path.string() + ": cannot map: " + std::strerror(saved));
    }
    data_ = static_cast<std::byte*>(mapped);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

std::string TensorInfo::shape_string() const {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

int64_t TensorInfo::elements() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

Checkpoint Checkpoint::open(const fs::path& dir) {
  Checkpoint checkpoint;
  const fs::path index_path = dir / "model.safetensors.index.json";
  const fs::path single_path = dir / "model.safetensors";
  if (fs::exists(index_path)) {
    json index;
    try {
      std::ifstream in(index_path);
      index = json::parse(in);
    } catch (const json::exception& e) {
      fail(index_path, std::string("not valid JSON: ") + e.what());
    }
    if (!index.contains("weight_map") || !index["weight_map"].is_object())
      fail(index_path, "has no \"weight_map\" object");
    std::map<std::string, std::vector<std::string>> names_by_shard;
    for (const auto& [tensor, shard] : index["weight_map"].items()) {
      if (!shard.is_string())
        fail(index_path, "weight_map entry for '" + tensor + "' is not a file name");
      names_by_shard[shard.get<std::string>()].push_back(tensor);
    }
    for (const auto& [shard, names] : names_by_shard) {
      const fs::path shard_path = dir / shard;
      if (shard.find('/') != std::string::npos || !fs::exists(shard_path))
        fail(index_path, "names shard '" + shard + "' (for tensor '" + names.front() +
                             "'), which does not exist in " + dir.string());
      checkpoint.add_file(shard_path, &names);
    }
  } else if (fs::exists(single_path)) {
    checkpoint.add_file(single_path, nullptr);
  } else {
    throw StatusError(dir.string() + ": no model.safetensors or model.safetensors.index.json");
  }
  return checkpoint;
}

void Checkpoint::add_file(const fs::path& path, const std::vector<std::string>* expected_names) {
  auto file = std::make_shared<const MappedFile>(path);
  if (file->size() < 8) fail(path, "truncated: shorter than the 8-byte header length");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, file->data(), 8);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file->size() - 8)
    fail(path, "header length " + std::to_string(header_bytes) + " runs past the end of the " +
                   std::to_string(file->size()) + "-byte file (truncated or corrupt)");
  json header;
  try {
    header = json::parse(std::string_view(reinterpret_cast<const char*>(file->data()) + 8,
                                          static_cast<size_t>(header_bytes)));
  } catch (const json::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");
  const std::byte* payload = file->data() + 8 + header_bytes;
  const size_t payload_bytes = file->size() - 8 - static_cast<size_t>(header_bytes);

  struct Extent {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = "tensor '" + name + "'";
    try {
      TensorInfo info;
      info.name = name;
      info.file = file.get();
      info.dtype_name = entry.at("dtype").get<std::string>();
      info.shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1])
        fail(path, where + " has invalid data_offsets");
      int64_t elements = 1;
      for (int64_t dim : info.shape) {
        if (dim < 0) fail(path, where + " has a negative dimension");
        if (__builtin_mul_overflow(elements, dim, &elements))
          fail(path, where + " has a shape whose size overflows");
      }
      if (offsets[1] > payload_bytes)
        fail(path, where + " ends at byte " + std::to_string(offsets[1]) +
                       " of the data, but the "
                       "file holds only " +
                       std::to_string(payload_bytes) + " data bytes (truncated file)");
      const size_t element_bytes = header_dtype_size(info.dtype_name);
      info.bytes = static_cast<size_t>(offsets[1] - offsets[0]);
      if (element_bytes != 0 && info.bytes != static_cast<size_t>(info.elements()) * element_bytes)
        fail(path, where + " has " + std::to_string(info.bytes) + " bytes but shape " +
                       info.shape_string() + " of " + info.dtype_name + " needs " +
                       std::to_string(static_cast<size_t>(info.elements()) * element_bytes));
      info.data = payload + offsets[0];
      if (info.bytes > 0) extents.push_back({offsets[0], offsets[1], name});
      if (!tensors_.emplace(name, std::move(info)).second)
        fail(path, where + " appears in more than one file");
    } catch (const json::exception& e) {
      fail(path, where + " has a malformed header entry: " + e.what());
    }
  }
  // Two tensors sharing bytes would let one write (or a crafted file) alias another's weights.
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i)
    if (extents[i].begin < extents[i - 1].end)
      fail(path, "tensors '" + extents[i - 1].name + "' and '" + extents[i].name +
                     "' overlap (data_offsets [" + std::to_string(extents[i - 1].begin) + ", " +
                     std::to_string(extents[i - 1].end) + ") and [" +
                     std::to_string(extents[i].begin) + ", " + std::to_string(extents[i].end) +
                     "))");
  if (expected_names) {
    for (const std::string& name : *expected_names)
      if (!tensors_.count(name))
        fail(path,
             "index lists tensor '" + name + "' in this shard, but the shard has no such tensor");
  }
  files_.push_back(std::move(file));
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

size_t Checkpoint::mapped_bytes() const {
  size_t total = 0;
  for (const auto& file : files_) total += file->size();
  return total;
}

std::vector<std::filesystem::path> Checkpoint::file_paths() const {
  std::vector<std::filesystem::path> paths;
  for (const auto& file : files_) paths.push_back(file->path());
  return paths;
}

std::optional<Checkpoint::Location> Checkpoint::locate(const void* address) const {
  const auto* byte = static_cast<const std::byte*>(address);
  for (size_t i = 0; i < files_.size(); ++i) {
    const std::byte* begin = files_[i]->data();
    if (byte >= begin && byte < begin + files_[i]->size())
      return Location{i, static_cast<uint64_t>(byte - begin)};
  }
  return std::nullopt;
}

std::string Checkpoint::describe() const {
  std::string names;
  for (const auto& file : files_)
    names += (names.empty() ? "" : ", ") + file->path().filename().string();
  return names;
}

kernels::DType supported_dtype(const TensorInfo& tensor) {
  if (tensor.dtype_name == "F32") return kernels::DType::kF32;
  if (tensor.dtype_name == "BF16") return kernels::DType::kBF16;
  if (tensor.dtype_name == "F16") return kernels::DType::kF16;
  if (tensor.dtype_name == "F8_E4M3") return kernels::DType::kF8E4M3;
  for (kernels::DType quantized : kernels::kQuantizedTypes)
    if (tensor.dtype_name == kernels::dtype_name(quantized)) return quantized;
  throw StatusError(tensor.file_name() + ": tensor '" + tensor.name + "' has dtype " +
                    tensor.dtype_name +
                    ", which moeline does not support (F32, BF16, F16, F8_E4M3 with block scales, "
                    "and in GGUF files Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)");
}

}  // namespace moeline::model
