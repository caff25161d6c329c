#pragma once
// y = x · Wᵀ on the GPU: W a weight matrix [out, in] in device memory in its stored dtype, x and y
// F32. Through cuBLAS, 16-bit weights multiply BF16/F16-rounded activations with F32 accumulation
// (cublasGemmEx, the tensor cores) and F32 weights stay F32 throughout; block-quantized weights
// are dequantized to F32 first (the CPU's exact mode). A few rows (a decode step) go through a
// GEMV kernel that reads F32 activations against the stored weights, quantized ones included.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/dtype.h"

namespace moeline::kernels::cuda {

struct DeviceMatrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0;

  size_t row_bytes() const { return stored_bytes(dtype, cols); }
  size_t bytes() const { return static_cast<size_t>(rows) * row_bytes(); }
  DeviceMatrix row_range(int64_t first, int64_t count) const {
    return {static_cast<const std::byte*>(data) + static_cast<size_t>(first) * row_bytes(), dtype,
            count, cols};
  }
};

class Blas {
 public:
  explicit Blas(cudaStream_t stream);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // y (n rows, y_stride apart; 0: w.rows) = x (n rows, x_stride apart; 0: w.cols) · Wᵀ, or
  // y += x · Wᵀ with `accumulate`. Up to kGemvMaxRows rows (a decode step) run as one GEMV kernel
  // on the F32 activations (ops.h: gemv); more as a cuBLAS GEMM.
  void matmul(const float* x, int64_t n, const DeviceMatrix& w, float* y, int64_t x_stride = 0,
              int64_t y_stride = 0, bool accumulate = false);
  // The converted-activations buffer: a CUDA graph that captured GEMMs is valid while it stays.
  const void* scratch() const { return scratch_; }

 private:
  void* workspace_ = nullptr;  // cuBLAS's, set once, so its calls can be captured in a graph
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_;
  void* scratch_ = nullptr;  // the activations in the weights' dtype
  size_t scratch_bytes_ = 0;
  float* dequantized_ = nullptr;  // a quantized weight matrix widened to F32
  size_t dequantized_bytes_ = 0;
};

}  // namespace moeline::kernels::cuda
