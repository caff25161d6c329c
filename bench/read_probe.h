#pragma once
// The plain read the benches hold the decode kernels against: every byte of a buffer read once,
// in order, with nothing computed but a sum in 8 independent chains, so that the loop is bound by
// the memory system alone. Wide loads (two or four per cache line: narrower ones keep fewer lines
// in flight), as one stream or as two halves read side by side: on some hosts (AMD Zen 3 and
// Zen 5) two streams read faster than one, and the decode kernels read two there
// (kernels/cpu/matmul.h's StreamTuning), so a roofline from one stream alone would understate
// what the memory gives.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace moeline::bench {

__attribute__((target("avx512f"))) inline uint64_t read_sum_avx512(const uint8_t* bytes,
                                                                   size_t size, bool two_streams) {
  __m512i sums[8];
  for (auto& sum : sums) sum = _mm512_setzero_si512();
  if (two_streams) {
    const size_t half = size / 2 / 256 * 256;
    const uint8_t* second = bytes + half;
    for (size_t i = 0; i + 256 <= half; i += 256)
      for (int lane = 0; lane < 4; ++lane) {
        sums[lane] = _mm512_add_epi64(sums[lane], _mm512_loadu_si512(bytes + i + 64 * lane));
        sums[4 + lane] =
            _mm512_add_epi64(sums[4 + lane], _mm512_loadu_si512(second + i + 64 * lane));
      }
  } else {
    for (size_t i = 0; i + 512 <= size; i += 512)
      for (int lane = 0; lane < 8; ++lane)
        sums[lane] = _mm512_add_epi64(sums[lane], _mm512_loadu_si512(bytes + i + 64 * lane));
  }
  for (int lane = 1; lane < 8; ++lane) sums[0] = _mm512_add_epi64(sums[0], sums[lane]);
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, sums[0]);
  uint64_t total = 0;
  for (const uint64_t lane : lanes) total += lane;
  return total;
}

__attribute__((target("avx2"))) inline uint64_t read_sum_avx2(const uint8_t* bytes, size_t size,
                                                              bool two_streams) {
  __m256i sums[8];
  for (auto& sum : sums) sum = _mm256_setzero_si256();
  if (two_streams) {
    const size_t half = size / 2 / 128 * 128;
    const uint8_t* second = bytes + half;
    for (size_t i = 0; i + 128 <= half; i += 128)
      for (int lane = 0; lane < 4; ++lane) {
        sums[lane] = _mm256_add_epi64(
            sums[lane],
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i + 32 * lane)));
        sums[4 + lane] = _mm256_add_epi64(
            sums[4 + lane],
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + i + 32 * lane)));
      }
  } else {
    for (size_t i = 0; i + 256 <= size; i += 256)
      for (int lane = 0; lane < 8; ++lane)
        sums[lane] = _mm256_add_epi64(
            sums[lane],
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i + 32 * lane)));
  }
  for (int lane = 1; lane < 8; ++lane) sums[0] = _mm256_add_epi64(sums[0], sums[lane]);
  return static_cast<uint64_t>(_mm256_extract_epi64(sums[0], 0));
}

inline uint64_t read_sum_portable(const uint8_t* bytes, size_t size) {
  uint64_t sums[8] = {};
  for (size_t i = 0; i + 64 <= size; i += 64)
    for (int lane = 0; lane < 8; ++lane) {
      uint64_t word;
      std::memcpy(&word, bytes + i + 8 * lane, sizeof word);
      sums[lane] += word;
    }
  uint64_t total = 0;
  for (const uint64_t sum : sums) total += sum;
  return total;
}

// The widest read this CPU has; `two_streams` is ignored without AVX2.
inline uint64_t read_sum(const void* data, size_t size, bool two_streams) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2");
  const auto* bytes = static_cast<const uint8_t*>(data);
  if (avx512) return read_sum_avx512(bytes, size, two_streams);
  if (avx2) return read_sum_avx2(bytes, size, two_streams);
  return read_sum_portable(bytes, size);
}

}  // namespace moeline::bench
