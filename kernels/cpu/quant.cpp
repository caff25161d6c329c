#include "kernels/cpu/quant.h"

#include <array>
#include <cstring>

#include "kernels/cpu/dtype.h"

namespace moeline::kernels {
namespace {

constexpr int64_t kSuperBlock = 256;  // QK_K

constexpr std::array<QuantTraits, 11> kTraits = {{
    {QuantType::kQ4_1, "Q4_1", 32, 2 + 2 + 16},
    {QuantType::kQ5_0, "Q5_0", 32, 2 + 4 + 16},
    {QuantType::kQ5_1, "Q5_1", 32, 2 + 2 + 4 + 16},
    {QuantType::kF32, "F32", 1, 4},
    {QuantType::kF16, "F16", 1, 2},
    {QuantType::kQ4_0, "Q4_0", 32, 2 + 16},
    {QuantType::kQ8_0, "Q8_0", 32, 2 + 32},
    {QuantType::kQ4_K, "Q4_K", kSuperBlock, 2 + 2 + 12 + 128},
    {QuantType::kQ5_K, "Q5_K", kSuperBlock, 2 + 2 + 12 + 32 + 128},
    {QuantType::kQ6_K, "Q6_K", kSuperBlock, 128 + 64 + 16 + 2},
    {QuantType::kBF16, "BF16", 1, 2},
}};

// The 6-bit scale and min of sub-block j (0..7) in a K-quant's 12 scale bytes: sub-blocks 0-3
// in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles, with
// their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins).
void scale_min(int j, const uint8_t* q, uint8_t& scale, uint8_t& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    min = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q4_1 (no fifth bits, a min), Q5_0 (fifth bits, centred on 16), Q5_1 (fifth bits, a min).
void q4_5_legacy(const uint8_t* block, float* y, bool fifth, bool with_min) {
  const float d = f16_at(block);
  const float m = with_min ? f16_at(block + 2) : 0.0f;
  const uint8_t* after = block + (with_min ? 4 : 2);
  uint32_t high = 0;
  if (fifth) std::memcpy(&high, after, 4);
  const uint8_t* q = after + (fifth ? 4 : 0);
  const int offset = fifth && !with_min ? 16 : 0;
  for (int j = 0; j < 16; ++j) {
    const int low = (q[j] & 0xF) | (fifth ? static_cast<int>((high >> j) & 1) << 4 : 0);
    const int top = (q[j] >> 4) | (fifth ? static_cast<int>((high >> (j + 16)) & 1) << 4 : 0);
    y[j] = d * static_cast<float>(low - offset) + m;
    y[j + 16] = d * static_cast<float>(top - offset) + m;
  }
}

void q8_0(const uint8_t* block, float* y) {
  const float d = f16_at(block);
  const auto* q = reinterpret_cast<const int8_t*>(block + 2);
  for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(q[i]);
}

void q4_0(const uint8_t* block, float* y) {
  const float d = f16_at(block);
  const uint8_t* q = block + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((q[j] & 0xF) - 8);
    y[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
  }
}

// Q4_K and Q5_K: 4 groups of 64 weights, each two sub-blocks with a scale and a min.
void q45_k(const uint8_t* block, float* y, bool fifth_bit) {
  const float d = f16_at(block);
  const float dmin = f16_at(block + 2);
  const uint8_t* scales = block + 4;
  const uint8_t* high = block + 16;  // Q5_K only
  const uint8_t* q = block + (fifth_bit ? 48 : 16);
  for (int group = 0; group < 4; ++group) {
    uint8_t scale = 0, min = 0;
    scale_min(2 * group, scales, scale, min);
    const float d1 = d * scale, m1 = dmin * min;
    scale_min(2 * group + 1, scales, scale, min);
    const float d2 = d * scale, m2 = dmin * min;
    const uint8_t low_bit = static_cast<uint8_t>(1u << (2 * group));
    const uint8_t high_bit = static_cast<uint8_t>(2u << (2 * group));
    for (int l = 0; l < 32; ++l) {
      const int add_low = fifth_bit && (high[l] & low_bit) ? 16 : 0;
      const int add_high = fifth_bit && (high[l] & high_bit) ? 16 : 0;
      y[l] = d1 * static_cast<float>((q[l] & 0xF) + add_low) - m1;
      y[l + 32] = d2 * static_cast<float>((q[l] >> 4) + add_high) - m2;
    }
    q += 32;
    y += 64;
  }
}

void q6_k(const uint8_t* block, float* y) {
  const uint8_t* low = block;
  const uint8_t* high = block + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = f16_at(block + 208);
  for (int half = 0; half < 2; ++half) {
    for (int l = 0; l < 32; ++l) {
      const int s = l / 16;
      const int q1 = ((low[l] & 0xF) | (((high[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((low[l + 32] & 0xF) | (((high[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((low[l] >> 4) | (((high[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((low[l + 32] >> 4) | (((high[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(scales[s]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(scales[s + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(scales[s + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(scales[s + 6]) * static_cast<float>(q4);
    }
    low += 64;
    high += 32;
    scales += 8;
    y += 128;
  }
}

}  // namespace

std::optional<QuantTraits> quant_traits(uint32_t ggml_type) {
  for (const QuantTraits& traits : kTraits)
    if (static_cast<uint32_t>(traits.type) == ggml_type) return traits;
  return std::nullopt;
}

std::string_view ggml_type_name(uint32_t ggml_type) {
  static constexpr std::array<std::string_view, 40> kNames = {
      "F32",   "F16",        "Q4_0",       "Q4_1",       "Q4_2",     "Q4_3",     "Q5_0",
      "Q5_1",  "Q8_0",       "Q8_1",       "Q2_K",       "Q3_K",     "Q4_K",     "Q5_K",
      "Q6_K",  "Q8_K",       "IQ2_XXS",    "IQ2_XS",     "IQ3_XXS",  "IQ1_S",    "IQ4_NL",
      "IQ3_S", "IQ2_S",      "IQ4_XS",     "I8",         "I16",      "I32",      "I64",
      "F64",   "IQ1_M",      "BF16",       "Q4_0_4_4",   "Q4_0_4_8", "Q4_0_8_8", "TQ1_0",
      "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4"};
  return ggml_type < kNames.size() ? kNames[ggml_type] : std::string_view("unknown");
}

QuantType quant_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return QuantType::kF32;
    case DType::kBF16:
      return QuantType::kBF16;
    case DType::kF16:
      return QuantType::kF16;
    case DType::kQ8_0:
      return QuantType::kQ8_0;
    case DType::kQ4_0:
      return QuantType::kQ4_0;
    case DType::kQ4_K:
      return QuantType::kQ4_K;
    case DType::kQ5_K:
      return QuantType::kQ5_K;
    case DType::kQ6_K:
      return QuantType::kQ6_K;
    case DType::kQ4_1:
      return QuantType::kQ4_1;
    case DType::kQ5_0:
      return QuantType::kQ5_0;
    case DType::kQ5_1:
      return QuantType::kQ5_1;
    case DType::kF8E4M3:  // no GGUF type; never asked for (GGUF files hold no FP8)
      break;
  }
  return QuantType::kF32;
}

std::optional<DType> dtype_of(QuantType type) {
  for (int d = 0; d <= static_cast<int>(DType::kQ5_1); ++d)
    if (quant_type(static_cast<DType>(d)) == type) return static_cast<DType>(d);
  return std::nullopt;
}

void dequantize_row(QuantType type, const void* src, int64_t n, float* dst) {
  const auto* bytes = static_cast<const uint8_t*>(src);
  switch (type) {
    case QuantType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case QuantType::kF16:
      widen(src, DType::kF16, n, dst);
      return;
    case QuantType::kBF16:
      widen(src, DType::kBF16, n, dst);
      return;
    case QuantType::kQ8_0:
      for (int64_t b = 0; b < n / 32; ++b) q8_0(bytes + b * 34, dst + b * 32);
      return;
    case QuantType::kQ4_0:
      for (int64_t b = 0; b < n / 32; ++b) q4_0(bytes + b * 18, dst + b * 32);
      return;
    case QuantType::kQ4_K:
      for (int64_t b = 0; b < n / kSuperBlock; ++b)
        q45_k(bytes + b * 144, dst + b * kSuperBlock, false);
      return;
    case QuantType::kQ5_K:
      for (int64_t b = 0; b < n / kSuperBlock; ++b)
        q45_k(bytes + b * 176, dst + b * kSuperBlock, true);
      return;
    case QuantType::kQ4_1:
      for (int64_t b = 0; b < n / 32; ++b) q4_5_legacy(bytes + b * 20, dst + b * 32, false, true);
      return;
    case QuantType::kQ5_0:
      for (int64_t b = 0; b < n / 32; ++b) q4_5_legacy(bytes + b * 22, dst + b * 32, true, false);
      return;
    case QuantType::kQ5_1:
      for (int64_t b = 0; b < n / 32; ++b) q4_5_legacy(bytes + b * 24, dst + b * 32, true, true);
      return;
    case QuantType::kQ6_K:
      for (int64_t b = 0; b < n / kSuperBlock; ++b) q6_k(bytes + b * 210, dst + b * kSuperBlock);
      return;
  }
}

}  // namespace moeline::kernels
