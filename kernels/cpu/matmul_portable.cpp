// Portable path: plain C++ with one lane; correct everywhere, fast nowhere.
#include <cmath>

#include "kernels/cpu/matmul_impl.h"

namespace moeline::kernels::detail {
namespace {

struct Portable {
  using V = float;
  static constexpr int kLanes = 1;
  static constexpr int kMR = 4;
  static constexpr int kDirectRows = 1;
  static constexpr int64_t kKBlock = 0;
  static constexpr int kNR = 4;
  static constexpr int kStreamedTileTokens = kNR;
  static constexpr int kTwoStreamTileTokens = kNR;
  static constexpr int kDirectTokens = kNR;
  static constexpr bool kPrefetches = false;
  // The next packed tile's rows are prefetched on the AVX2 path only (measured only there).
  static constexpr bool kPrefetchesNextTile = false;
  static void prefetch(const char*) {}
  static V zero() { return 0.0f; }
  static V load_f32(const float* p) { return *p; }
  static V load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static V load_f16(const uint16_t* p) { return f16_to_float(*p); }
  static V load_e4m3(const uint8_t* p) {  // 2^-8 of the value, as the SIMD paths load it
    return e4m3_is_nan(*p) ? NAN : f16_to_float(e4m3_as_f16_bits(*p));
  }
  static V broadcast(float value) { return value; }
  static V mul(V a, V b) { return a * b; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static float reduce(V v) { return v; }
  static void store(float* p, V v) { *p = v; }
};

}  // namespace

void matmul_rows_portable(const MatmulTask& task, int64_t row_begin, int64_t row_end) {
  MatmulKernel<Portable>::run(task, row_begin, row_end);
}

}  // namespace moeline::kernels::detail
