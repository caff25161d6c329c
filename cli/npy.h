#pragma once
// Writes a float32 NumPy .npy file (format version 1.0), the interface other tools read logits
// from.

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace moeline::cli {

// Returns false when the file cannot be written.
bool write_npy(const std::filesystem::path& path, std::span<const float> values,
               const std::vector<int64_t>& shape);

}  // namespace moeline::cli
