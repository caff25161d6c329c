#include "cli/npy.h"

#include <fstream>
#include <string>

namespace moeline::cli {

bool write_npy(const std::filesystem::path& path, std::span<const float> values,
               const std::vector<int64_t>& shape) {
  std::string dims;
  for (int64_t dim : shape) dims += std::to_string(dim) + ",";
  if (shape.size() > 1) dims.pop_back();
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + length (2) + header + '\n' is padded to a multiple of 64 bytes.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) return false;
  const uint16_t header_length = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.put(static_cast<char>(header_length & 0xff));
  out.put(static_cast<char>(header_length >> 8));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(values.size_bytes()));
  return static_cast<bool>(out);
}

}  // namespace moeline::cli
