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

// kStreams parts of the buffer read side by side, 8 / kStreams chains each: every turn reads the
// next kChains vectors of each part.
template <int kStreams>
__attribute__((target("avx512f"))) inline uint64_t read_sum_avx512(const uint8_t* bytes,
                                                                   size_t size) {
  constexpr int kChains = 8 / kStreams;
  constexpr size_t kTurn = 64 * kChains;
  const size_t part = size / kStreams / kTurn * kTurn;
  __m512i sums[8];
  for (auto& sum : sums) sum = _mm512_setzero_si512();
  for (size_t i = 0; i < part; i += kTurn)
    for (int s = 0; s < kStreams; ++s)
      for (int c = 0; c < kChains; ++c)
        sums[s * kChains + c] = _mm512_add_epi64(sums[s * kChains + c],
                                                 _mm512_loadu_si512(bytes + s * part + i + 64 * c));
  for (int lane = 1; lane < 8; ++lane) sums[0] = _mm512_add_epi64(sums[0], sums[lane]);
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, sums[0]);
  uint64_t total = 0;
  for (const uint64_t lane : lanes) total += lane;
  return total;
}

template <int kStreams>
__attribute__((target("avx2"))) inline uint64_t read_sum_avx2(const uint8_t* bytes, size_t size) {
  constexpr int kChains = 8 / kStreams;
  constexpr size_t kTurn = 32 * kChains;
  const size_t part = size / kStreams / kTurn * kTurn;
  __m256i sums[8];
  for (auto& sum : sums) sum = _mm256_setzero_si256();
  for (size_t i = 0; i < part; i += kTurn)
    for (int s = 0; s < kStreams; ++s)
      for (int c = 0; c < kChains; ++c)
        sums[s * kChains + c] = _mm256_add_epi64(
            sums[s * kChains + c],
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + s * part + i + 32 * c)));
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
  if (avx512)
    return two_streams ? read_sum_avx512<2>(bytes, size) : read_sum_avx512<1>(bytes, size);
  if (avx2) return two_streams ? read_sum_avx2<2>(bytes, size) : read_sum_avx2<1>(bytes, size);
  return read_sum_portable(bytes, size);
}

}  // namespace moeline::bench
