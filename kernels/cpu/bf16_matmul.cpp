#include "kernels/cpu/bf16_matmul.h"

#include <atomic>

#include "kernels/check.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels {
namespace {

std::atomic<Bf16Math> g_bf16_math{Bf16Math::kExact};

}  // namespace

void set_bf16_math(Bf16Math math) {
  g_bf16_math.store(math, std::memory_order_relaxed);
}
Bf16Math bf16_math() {
  return g_bf16_math.load(std::memory_order_relaxed);
}

bool parse_bf16_math(const char* text, Bf16Math& math) {
  QuantMath same;  // the same two words
  if (!parse_quant_math(text, same)) return false;
  math = same == QuantMath::kFast ? Bf16Math::kFast : Bf16Math::kExact;
  return true;
}

bool cpu_has_bf16_dot_product() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
}

bool bf16_fast_in_use() {
  const Isa isa = active_isa();
  return bf16_math() == Bf16Math::kFast && cpu_has_bf16_dot_product() &&
         (isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni);
}

void round_activations_to_bf16(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                               Bf16Activations& out) {
  MOELINE_CHECK(bf16_fast_in_use(), "the BF16 fast mode runs on AVX512_BF16 only");
  detail::round_activations_to_bf16_avx512(x, rows, cols, x_stride, out);
}

void bf16_matmul_rows(const MatrixView& w, const Bf16Activations& x, float* y, int64_t y_stride,
                      int64_t row_begin, int64_t row_end) {
  MOELINE_CHECK(bf16_fast_in_use() && w.dtype == DType::kBF16 && w.cols == x.cols,
                "BF16 weights and activations of their width, on AVX512_BF16");
  detail::bf16_matmul_rows_avx512(w, x, y, y_stride, row_begin, row_end);
}

void bf16_matmul_rows_two_streams(const MatrixView& w, const Bf16Activations& x, float* y,
                                  int64_t y_stride, int64_t a_begin, int64_t a_end, int64_t b_begin,
                                  int64_t b_end) {
  MOELINE_CHECK(bf16_fast_in_use() && w.dtype == DType::kBF16 && w.cols == x.cols,
                "BF16 weights and activations of their width, on AVX512_BF16");
  detail::bf16_matmul_rows_two_streams_avx512(w, x, y, y_stride, a_begin, a_end, b_begin, b_end);
}

}  // namespace moeline::kernels
