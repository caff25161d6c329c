// AVX2 path of the fast quantized matmul (quant_matmul.h): each 32-weight group is unpacked to
// 32 signed bytes in one register, multiplied with a token's 32 activation bytes by maddubs
// (|w| times x with w's sign) into 16-bit pairs, widened to eight 32-bit sums (lanes 0-3 the
// first 16 weights, 4-7 the last 16), converted and scaled into a float accumulator per token.
// Also the path on AVX-512 hosts.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels::detail {
namespace {

constexpr int kTokenTile = 8;

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

int k_scale(int j, const uint8_t* q) {
  return j < 4 ? (q[j] & 63) : ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
}
int k_min(int j, const uint8_t* q) {
  return j < 4 ? (q[j + 4] & 63) : ((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
}

struct Group {
  __m256i q;
  float lo, hi, min;
};

inline __m256i nibbles(__m256i bytes, int shift) {
  return _mm256_and_si256(_mm256_srli_epi16(bytes, shift), _mm256_set1_epi8(0x0F));
}

inline Group unpack(DType dtype, const uint8_t* row, int64_t g) {
  Group out;
  switch (dtype) {
    case DType::kQ8_0: {
      const uint8_t* block = row + g * 34;
      out.lo = out.hi = half_at(block);
      out.min = 0.0f;
      out.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
      return out;
    }
    case DType::kQ4_0: {
      const uint8_t* block = row + g * 18;
      out.lo = out.hi = half_at(block);
      out.min = 0.0f;
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
      const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
      out.q = _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
      return out;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      const bool fifth = dtype == DType::kQ5_K;
      const uint8_t* block = row + (g / 8) * (fifth ? 176 : 144);
      const int j = static_cast<int>(g % 8);
      const float d = half_at(block), dmin = half_at(block + 2);
      out.lo = out.hi = d * static_cast<float>(k_scale(j, block + 4));
      out.min = dmin * static_cast<float>(k_min(j, block + 4));
      const uint8_t* qs = block + (fifth ? 48 : 16) + 32 * (j / 2);
      out.q = nibbles(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)), (j % 2) * 4);
      if (fifth) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        out.q = _mm256_add_epi8(out.q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
      return out;
    }
    case DType::kQ6_K: {
      const uint8_t* block = row + (g / 8) * 210;
      const int j = static_cast<int>(g % 8);
      const int half = j / 4, quarter = j % 4;
      const auto* scales = reinterpret_cast<const int8_t*>(block + 192) + 8 * half + 2 * quarter;
      const float d = half_at(block + 208);
      out.lo = d * static_cast<float>(scales[0]);
      out.hi = d * static_cast<float>(scales[1]);
      out.min = 0.0f;
      const __m256i low = nibbles(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                      block + 64 * half + (quarter % 2) * 32)),
                                  (quarter / 2) * 4);
      const __m256i high_bytes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half));
      // (high >> 2q) & 3, moved to bits 4-5: shift by 2q then mask 3, then << 4 (no byte shifts
      // in AVX2: 16-bit shifts and a byte mask keep neighbours out).
      const __m256i two =
          _mm256_and_si256(_mm256_srli_epi16(high_bytes, 2 * quarter), _mm256_set1_epi8(3));
      const __m256i top = _mm256_slli_epi16(two, 4);  // values <= 0x30: no carry across bytes
      out.q = _mm256_sub_epi8(_mm256_or_si256(low, top), _mm256_set1_epi8(32));
      return out;
    }
    default:
      out.q = _mm256_setzero_si256();
      out.lo = out.hi = out.min = 0.0f;
      return out;
  }
}

inline float reduce(__m256 v) {
  const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

}  // namespace

void quant_matmul_rows_avx2(const MatrixView& w, const QuantizedActivations& x, float* y,
                            int64_t y_stride, int64_t row_begin, int64_t row_end) {
  const int64_t groups = w.cols / kActivationGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t group_bytes = static_cast<int64_t>(w.row_bytes()) / groups;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* row = reinterpret_cast<const uint8_t*>(w.row(r));
    for (int64_t t0 = 0; t0 < x.rows; t0 += kTokenTile) {
      const int tokens = static_cast<int>(std::min<int64_t>(kTokenTile, x.rows - t0));
      __m256 acc[kTokenTile];
      float min_acc[kTokenTile];
      for (int t = 0; t < tokens; ++t) {
        acc[t] = _mm256_setzero_ps();
        min_acc[t] = 0.0f;
      }
      for (int64_t g = 0; g < groups; ++g) {
        // Decode streams every weight once: keep the next lines on their way.
        if ((g & 1) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(row) + g * group_bytes + 1024, _MM_HINT_T0);
        const Group group = unpack(w.dtype, row, g);
        const __m256i magnitude = _mm256_sign_epi8(group.q, group.q);
        const __m256 scales = _mm256_setr_ps(group.lo, group.lo, group.lo, group.lo, group.hi,
                                             group.hi, group.hi, group.hi);
        for (int t = 0; t < tokens; ++t) {
          const int64_t token = t0 + t;
          const __m256i xq = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(x.row(token) + g * kActivationGroup));
          const __m256i products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, group.q));
          const __m256i sums = _mm256_madd_epi16(products, ones);
          const size_t at = static_cast<size_t>(token * groups + g);
          const float d = x.scale[at];
          acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(scales, _mm256_set1_ps(d)),
                                   _mm256_cvtepi32_ps(sums), acc[t]);
          min_acc[t] += d * group.min * static_cast<float>(x.sum[at]);
        }
      }
      for (int t = 0; t < tokens; ++t) y[(t0 + t) * y_stride + r] = reduce(acc[t]) - min_acc[t];
    }
  }
}

}  // namespace moeline::kernels::detail
