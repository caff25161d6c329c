#include "kernels/cuda/blas.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/ops.h"

namespace moeline::kernels::cuda {
namespace {

void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cublas: ") + what + ": " + cublasGetStatusString(status));
}

cudaDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      throw std::invalid_argument("cublas: no " + std::string(dtype_name(dtype)) + " matrices");
  }
}

}  // namespace

Blas::Blas(cudaStream_t stream) : stream_(stream) {
  check_blas(cublasCreate(&handle_), "create");
  check_blas(cublasSetStream(handle_, stream_), "set stream");
  constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  check(cudaMalloc(&workspace_, kWorkspaceBytes), "cublas workspace");
  check_blas(cublasSetWorkspace(handle_, workspace_, kWorkspaceBytes), "set workspace");
}

Blas::~Blas() {
  if (dequantized_) cudaFree(dequantized_);
  if (scratch_) cudaFree(scratch_);
  if (handle_) cublasDestroy(handle_);
  if (workspace_) cudaFree(workspace_);
}

void Blas::matmul(const float* x, int64_t n, const DeviceMatrix& w, float* y, int64_t x_stride,
                  int64_t y_stride, bool accumulate) {
  if (n == 0 || w.rows == 0) return;
  const int64_t K = w.cols;
  if (x_stride == 0) x_stride = K;
  if (y_stride == 0) y_stride = w.rows;
  if (n <= kGemvMaxRows) {
    gemv(x, n, x_stride, w.data, w.dtype, w.rows, K, y, y_stride, accumulate, stream_);
    return;
  }
  const void* a = w.data;
  DType a_type = w.dtype;
  if (is_quantized(w.dtype)) {
    const size_t bytes = static_cast<size_t>(w.rows * K) * sizeof(float);
    if (bytes > dequantized_bytes_) {
      if (dequantized_) check(cudaFree(dequantized_), "free dequantized weights");
      check(cudaMalloc(reinterpret_cast<void**>(&dequantized_), bytes),
            "alloc dequantized weights");
      dequantized_bytes_ = bytes;
    }
    dequantize(w.data, w.dtype, w.rows, K, dequantized_, stream_);
    a = dequantized_;
    a_type = DType::kF32;
  }
  const void* b = x;
  int64_t ldb = x_stride;
  if (a_type != DType::kF32) {
    const size_t bytes = static_cast<size_t>(n * K) * dtype_size(a_type);
    if (bytes > scratch_bytes_) {
      if (scratch_) check(cudaFree(scratch_), "free scratch");
      check(cudaMalloc(&scratch_, bytes * 2), "alloc scratch");
      scratch_bytes_ = bytes * 2;
    }
    convert(x, n, K, x_stride, scratch_, a_type, stream_);
    b = scratch_;
    ldb = K;
  }
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  // Row-major W [out, in] is column-major [in, out]; y row-major [n, out] is column-major
  // [out, n] = Wᵀ(col) · x(col).
  check_blas(
      cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(n),
                   static_cast<int>(K), &alpha, a, data_type(a_type), static_cast<int>(K), b,
                   data_type(a_type), static_cast<int>(ldb), &beta, y, CUDA_R_32F,
                   static_cast<int>(y_stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "gemm");
}

}  // namespace moeline::kernels::cuda
