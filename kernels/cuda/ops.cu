#include "kernels/cuda/ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <string>

namespace moeline::kernels::cuda {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("cuda: ") + what + ": " + cudaGetErrorString(status));
}

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why) *why = std::string("no usable CUDA device (") + cudaGetErrorString(status) + ")";
    cudaGetLastError();  // clear the sticky error for later calls
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  return true;
}

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t count, int threads = kThreads) {
  return static_cast<int>((count + threads - 1) / threads);
}

__host__ __device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}

// Weight i of a block-quantized array, as GGUF defines each type (kernels/cpu/quant.h). Rows are
// whole blocks, so blocks are contiguous across rows and i may run over the whole matrix.
__host__ __device__ float quant_element(const uint8_t* data, DType dtype, int64_t i) {
  const DTypeBlock shape = dtype_block(dtype);
  const uint8_t* b = data + (i / shape.elements) * shape.bytes;
  const int j = static_cast<int>(i % shape.elements);
  switch (dtype) {
    case DType::kQ8_0:
      return half_at(b) * static_cast<float>(static_cast<int8_t>(b[2 + j]));
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ5_1: {
      // d [, m] [, 32 fifth bits], 16 bytes of nibbles: byte j % 16, low nibble for j < 16.
      const bool has_min = dtype == DType::kQ4_1 || dtype == DType::kQ5_1;
      const bool fifth = dtype == DType::kQ5_0 || dtype == DType::kQ5_1;
      const uint8_t* qs = b + 2 + (has_min ? 2 : 0) + (fifth ? 4 : 0);
      int q = j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
      if (fifth) {
        const uint8_t* qh = b + 2 + (has_min ? 2 : 0);
        q |= ((qh[j / 8] >> (j % 8)) & 1) << 4;
      }
      if (has_min) return half_at(b) * static_cast<float>(q) + half_at(b + 2);
      return half_at(b) * static_cast<float>(q - (fifth ? 16 : 8));
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      // d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, [32 bytes of fifth
      // bits,] 128 bytes of nibbles: byte l of 64-weight group g holds weights 64g + l (low
      // nibble) and 64g + 32 + l (high).
      const bool fifth = dtype == DType::kQ5_K;
      const uint8_t* packed = b + 4;
      const int sub = j / 32, l = j % 32, g = j / 64;
      int scale, min;
      if (sub < 4) {
        scale = packed[sub] & 63;
        min = packed[sub + 4] & 63;
      } else {
        scale = (packed[sub + 4] & 0xF) | ((packed[sub - 4] >> 6) << 4);
        min = (packed[sub + 4] >> 4) | ((packed[sub] >> 6) << 4);
      }
      const uint8_t* qs = b + (fifth ? 48 : 16);
      const uint8_t byte = qs[32 * g + l];
      int q = (j % 64) < 32 ? (byte & 0xF) : (byte >> 4);
      if (fifth) q += ((b[16 + l] >> sub) & 1) << 4;
      return half_at(b) * static_cast<float>(scale) * static_cast<float>(q) -
             half_at(b + 2) * static_cast<float>(min);
    }
    case DType::kQ6_K: {
      // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d; each half of 128
      // weights takes 64 low bytes, 32 high bytes and 8 scales, in four quarters of 32.
      const int half = j / 128, quarter = (j % 128) / 32, l = j % 32;
      const uint8_t* ql = b + 64 * half;
      const uint8_t* qh = b + 128 + 32 * half;
      const auto* scales = reinterpret_cast<const int8_t*>(b + 192) + 8 * half;
      const uint8_t low = ql[l + (quarter % 2) * 32];
      const int q =
          ((quarter < 2 ? low & 0xF : low >> 4) | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32;
      return half_at(b + 208) * static_cast<float>(scales[l / 16 + 2 * quarter]) *
             static_cast<float>(q);
    }
    default:
      return 0.0f;
  }
}

__device__ __forceinline__ float load(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kBF16:
      return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16);
    case DType::kF16:
      return __half2float(static_cast<const __half*>(data)[i]);
    default:
      return quant_element(static_cast<const uint8_t*>(data), dtype, i);
  }
}

// Row `row` of a [rows, cols] matrix in `dtype` (quantized rows are whole blocks).
__device__ __forceinline__ const std::byte* row_address(const void* w, DType dtype, int64_t cols,
                                                        int64_t row) {
  return static_cast<const std::byte*>(w) + static_cast<size_t>(row) * stored_bytes(dtype, cols);
}

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__global__ void embed_kernel(const void* table, DType dtype, int64_t width, const int32_t* tokens,
                             int64_t n, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * width) return;
  const int64_t t = i / width, d = i % width;
  out[i] = load(table, dtype, static_cast<int64_t>(tokens[t]) * width + d);
}

__global__ void rms_norm_kernel(const float* x, int64_t dim, int64_t x_stride, const void* weight,
                                DType weight_dtype, float eps, float* out, int64_t out_stride) {
  const float* row = x + blockIdx.x * x_stride;
  float* dst = out + blockIdx.x * out_stride;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += double(row[i]) * row[i];
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv_rms = static_cast<float>(1.0 / sqrt(partial[0] / double(dim) + eps));
  __syncthreads();  // every thread has read partial[0] before any writes to an aliased out
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    dst[i] = row[i] * inv_rms * load(weight, weight_dtype, i);
}

__global__ void rope_kernel(float* x, int64_t n, int64_t heads, int64_t token_stride,
                            int64_t head_stride, int64_t dim, const float* cos_sin,
                            bool interleaved) {
  const int64_t half = dim / 2;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * heads * half) return;
  const int64_t t = i / (heads * half), h = (i / half) % heads, pair = i % half;
  float* v = x + t * token_stride + h * head_stride;
  const float c = cos_sin[t * dim + pair], s = cos_sin[t * dim + half + pair];
  float* first = v + (interleaved ? 2 * pair : pair);
  float* second = v + (interleaved ? 2 * pair + 1 : pair + half);
  const float a = *first, b = *second;
  *first = a * c - b * s;
  *second = b * c + a * s;
}

__global__ void write_kv_kernel(const float* k, const float* v, int64_t n, int64_t kv_heads,
                                int64_t key_dim, int64_t value_dim, int64_t k_stride,
                                int64_t v_stride, const int32_t* slot_index, float* keys,
                                float* values, int64_t block_size) {
  const int64_t per_token = kv_heads * (key_dim + value_dim);
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * per_token) return;
  const int64_t t = i / per_token, e = i % per_token;
  const int64_t block = slot_index[t] / block_size, slot = slot_index[t] % block_size;
  if (e < kv_heads * key_dim) {
    const int64_t h = e / key_dim, d = e % key_dim;
    keys[((block * kv_heads + h) * block_size + slot) * key_dim + d] = k[t * k_stride + e];
  } else {
    const int64_t f = e - kv_heads * key_dim;
    const int64_t h = f / value_dim, d = f % value_dim;
    values[((block * kv_heads + h) * block_size + slot) * value_dim + d] = v[t * v_stride + f];
  }
}

// One thread block per (block, layer) of the copy.
template <bool kPack>
__global__ void kv_blocks_kernel(KvBlocks kv, const int32_t* blocks, float* packed) {
  const int64_t i = blockIdx.x / kv.layers, layer = blockIdx.x % kv.layers;
  const int64_t block = blocks[i];
  const int64_t per_layer = kv.key_floats + kv.value_floats;
  float* chunk = packed + (i * kv.layers + layer) * per_layer;
  float* keys = kv.base + layer * kv.layer_stride + block * kv.key_floats;
  float* values = kv.base + layer * kv.layer_stride + kv.key_part + block * kv.value_floats;
  for (int64_t e = threadIdx.x; e < per_layer; e += blockDim.x) {
    float* cached = e < kv.key_floats ? keys + e : values + (e - kv.key_floats);
    if (kPack)
      chunk[e] = *cached;
    else
      *cached = chunk[e];
  }
}

constexpr int kAttentionWarps = 4;
constexpr int kMaxValuePerLane = 16;  // value_dim <= 512

// One block per (token, head): each warp takes every 4th key with an online softmax; the warps'
// partial sums are merged at the end.
__global__ void attention_kernel(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                                 int64_t heads, DeviceKv kv, const int32_t* block_tables,
                                 const int32_t* table_offset, const int32_t* positions, float scale,
                                 int64_t window) {
  extern __shared__ float shared[];
  float* q_s = shared;                                   // key_dim
  float* acc_s = shared + kv.key_dim;                    // warps * value_dim
  float* ml_s = acc_s + kAttentionWarps * kv.value_dim;  // warps * 2
  const int64_t t = blockIdx.x / heads, head = blockIdx.x % heads;
  const int64_t kv_head = head / (heads / kv.kv_heads);
  const float* query = q + t * q_stride + head * kv.key_dim;
  for (int64_t d = threadIdx.x; d < kv.key_dim; d += blockDim.x) q_s[d] = query[d];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t position = positions[t];
  const int64_t first = window > 0 ? max(int64_t{0}, position - window + 1) : 0;
  const int32_t* table = block_tables + table_offset[t];
  float m = -FLT_MAX, l = 0.0f;
  float acc[kMaxValuePerLane];
  for (int i = 0; i < kMaxValuePerLane; ++i) acc[i] = 0.0f;
  for (int64_t j = first + warp; j <= position; j += kAttentionWarps) {
    const int64_t row =
        (static_cast<int64_t>(table[j / kv.block_size]) * kv.kv_heads + kv_head) * kv.block_size +
        j % kv.block_size;
    const float* key = kv.keys + row * kv.key_dim;
    float partial = 0.0f;
    for (int64_t d = lane; d < kv.key_dim; d += 32) partial += q_s[d] * key[d];
    const float s = warp_sum(partial) * scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new), p = expf(s - m_new);
    l = l * correction + p;
    const float* value = kv.values + row * kv.value_stride;
    for (int i = 0; i < kMaxValuePerLane; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < kv.value_dim) acc[i] = acc[i] * correction + p * value[d];
    }
    m = m_new;
  }
  for (int i = 0; i < kMaxValuePerLane; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < kv.value_dim) acc_s[warp * kv.value_dim + d] = acc[i];
  }
  if (lane == 0) {
    ml_s[2 * warp] = m;
    ml_s[2 * warp + 1] = l;
  }
  __syncthreads();
  float m_all = -FLT_MAX;
  for (int w = 0; w < kAttentionWarps; ++w) m_all = fmaxf(m_all, ml_s[2 * w]);
  float l_all = 0.0f, factor[kAttentionWarps];
  for (int w = 0; w < kAttentionWarps; ++w) {
    factor[w] = ml_s[2 * w + 1] > 0.0f ? expf(ml_s[2 * w] - m_all) : 0.0f;
    l_all += ml_s[2 * w + 1] * factor[w];
  }
  float* dst = out + t * out_stride + head * kv.value_dim;
  for (int64_t d = threadIdx.x; d < kv.value_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < kAttentionWarps; ++w) sum += acc_s[w * kv.value_dim + d] * factor[w];
    dst[d] = sum / l_all;
  }
}

constexpr int kMaxExperts = 512;
constexpr int kMaxTopK = 32;
constexpr int kMaxGroups = 64;

// Indices of the k largest of values[0, count), highest first, ties to the lower index.
__device__ void top_k(const float* values, int64_t count, int64_t k, int32_t* chosen) {
  for (int64_t j = 0; j < k; ++j) {
    int32_t best = -1;
    for (int32_t e = 0; e < count; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || chosen[i] == e;
      if (taken) continue;
      if (best < 0 || values[e] > values[best]) best = e;
    }
    chosen[j] = best;
  }
}

__global__ void route_kernel(float* scores, int64_t n, RouterSpec spec, int32_t* chosen,
                             float* weights) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  const int64_t E = spec.experts, K = spec.top_k;
  float* row = scores + t * E;
  if (spec.sigmoid) {
    for (int64_t e = 0; e < E; ++e) row[e] = 1.0f / (1.0f + expf(-row[e]));
  } else {
    float max_logit = row[0];
    for (int64_t e = 1; e < E; ++e) max_logit = fmaxf(max_logit, row[e]);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      row[e] = expf(row[e] - max_logit);
      sum += row[e];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t e = 0; e < E; ++e) row[e] *= inv;
  }
  float choice[kMaxExperts];
  const float* ranked = row;
  if (spec.bias != nullptr || spec.group_limit != 0) {
    for (int64_t e = 0; e < E; ++e)
      choice[e] = row[e] + (spec.bias ? load(spec.bias, spec.bias_dtype, e) : 0.0f);
    if (spec.group_limit != 0) {
      const int64_t size = E / spec.n_group;
      float group_scores[kMaxGroups];
      for (int64_t g = 0; g < spec.n_group; ++g) {
        const float* member = choice + g * size;
        if (spec.group_limit == 1) {
          float best = member[0];
          for (int64_t i = 1; i < size; ++i) best = fmaxf(best, member[i]);
          group_scores[g] = best;
        } else {
          int32_t best[2];
          top_k(member, size, 2, best);
          group_scores[g] = member[best[0]] + member[best[1]];
        }
      }
      int32_t kept[kMaxGroups];
      top_k(group_scores, spec.n_group, spec.topk_group, kept);
      for (int64_t g = 0; g < spec.n_group; ++g) {
        bool keep = false;
        for (int64_t i = 0; i < spec.topk_group; ++i) keep = keep || kept[i] == g;
        if (!keep)
          for (int64_t i = 0; i < size; ++i) choice[g * size + i] = -INFINITY;
      }
    }
    ranked = choice;
  }
  int32_t* picked = chosen + t * K;
  top_k(ranked, E, K, picked);
  double sum = 0.0;
  for (int64_t j = 0; j < K; ++j) sum += row[picked[j]];
  for (int64_t j = 0; j < K; ++j) {
    const double p = row[picked[j]];
    double weight = p * spec.scaling;
    if (spec.normalise) {
      weight = p / (sum + 1e-20);
      if (spec.scale_normalised) weight *= spec.scaling;
    }
    weights[t * K + j] = static_cast<float>(weight);
  }
}

__global__ void silu_mul_kernel(float* gate, const float* up, int64_t count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

__global__ void add_kernel(float* y, const float* x, int64_t count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) y[i] += x[i];
}

__global__ void add_bias_kernel(float* y, int64_t n, int64_t width, const void* bias, DType dtype) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n * width) y[i] += load(bias, dtype, i % width);
}

__global__ void copy_rows_kernel(const float* src, int64_t src_stride, float* dst,
                                 int64_t dst_stride, int64_t rows, int64_t width) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * width) return;
  dst[(i / width) * dst_stride + i % width] = src[(i / width) * src_stride + i % width];
}

__global__ void gather_rows_kernel(const float* x, int64_t width, const int32_t* rows,
                                   int64_t count, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count * width) return;
  out[i] = x[static_cast<int64_t>(rows[i / width]) * width + i % width];
}

__global__ void combine_kernel(const float* expert_out, int64_t width, const int32_t* slots,
                               const float* weights, int64_t n, int64_t k, float* y) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * width) return;
  const int64_t t = i / width, d = i % width;
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j)
    sum += weights[t * k + j] * expert_out[static_cast<int64_t>(slots[t * k + j]) * width + d];
  y[i] += sum;
}

__global__ void dequantize_kernel(const void* w, DType dtype, int64_t count, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) out[i] = load(w, dtype, i);
}

__global__ void convert_kernel(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                               void* out, DType dtype) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  const float value = x[(i / cols) * x_stride + i % cols];
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(out)[i] = value;
      break;
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(value);
      break;
    case DType::kF16:
      static_cast<__half*>(out)[i] = __float2half_rn(value);
      break;
    default:
      break;
  }
}

// Eight BF16 weights loaded as one 16-byte vector, widened in order.
__device__ __forceinline__ void unpack_bf16x8(const uint4& packed, float* weights) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
  for (int q = 0; q < 4; ++q) {
    weights[2 * q] = __uint_as_float(words[q] << 16);
    weights[2 * q + 1] = __uint_as_float(words[q] & 0xffff0000u);
  }
}

// dot(row of `count` weights, x in shared memory), by one warp; lane 0 has the result.
__device__ float warp_dot(const void* row, DType dtype, const float* x, int64_t count, int lane) {
  float sum = 0.0f;
  if (dtype == DType::kBF16 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const auto* vectors = static_cast<const uint4*>(row);
    const int64_t full = count / 8;
    for (int64_t v = lane; v < full; v += 32) {
      float weights[8];
      unpack_bf16x8(vectors[v], weights);
      const float* xs = x + v * 8;
      for (int e = 0; e < 8; ++e) sum += weights[e] * xs[e];
    }
    for (int64_t i = full * 8 + lane; i < count; i += 32) sum += load(row, dtype, i) * x[i];
  } else {
    for (int64_t i = lane; i < count; i += 32) sum += load(row, dtype, i) * x[i];
  }
  return warp_sum(sum);
}

constexpr int kGemvWarps = 8;

// One warp per output row of W, the row read once for all n (<= kGemvMaxRows) inputs; x is read
// through the cache (every warp of the grid reads the same few rows).
__global__ void gemv_kernel(const float* __restrict__ x, int64_t n, int64_t x_stride,
                            const void* __restrict__ w, DType dtype, int64_t rows, int64_t cols,
                            float* __restrict__ y, int64_t y_stride, bool accumulate) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kGemvWarps) + warp;
  if (row >= rows) return;
  float sums[kGemvMaxRows] = {};
  const auto* base = row_address(w, dtype, cols, row);
  int64_t done = 0;
  if (dtype == DType::kBF16 && (reinterpret_cast<uintptr_t>(base) & 15) == 0) {
    const auto* vectors = reinterpret_cast<const uint4*>(base);
    const int64_t full = cols / 8;
    for (int64_t v = lane; v < full; v += 32) {
      float weights[8];
      unpack_bf16x8(vectors[v], weights);
      for (int64_t t = 0; t < n; ++t) {
        const float* xs = x + t * x_stride + v * 8;
        float sum = sums[t];
        for (int e = 0; e < 8; ++e) sum += weights[e] * __ldg(xs + e);
        sums[t] = sum;
      }
    }
    done = full * 8;
  }
  for (int64_t i = done + lane; i < cols; i += 32) {
    const float weight = load(base, dtype, i);
    for (int64_t t = 0; t < n; ++t) sums[t] += weight * __ldg(x + t * x_stride + i);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float total = warp_sum(sums[t]);
    if (lane == 0) {
      float* out = y + t * y_stride + row;
      *out = accumulate ? *out + total : total;
    }
  }
}

__global__ void expert_gate_up_kernel(const float* x, int64_t width, const int32_t* chosen,
                                      int64_t k, const void* const* experts, DType dtype,
                                      int64_t inter, float* act) {
  extern __shared__ float x_s[];
  const int64_t pair = blockIdx.y, t = pair / k;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) x_s[i] = x[t * width + i];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kGemvWarps) + warp;
  if (row >= inter) return;
  const void* base = experts[chosen[pair]];
  const float gate = warp_dot(row_address(base, dtype, width, row), dtype, x_s, width, lane);
  const float up = warp_dot(row_address(base, dtype, width, inter + row), dtype, x_s, width, lane);
  if (lane == 0) act[pair * inter + row] = gate / (1.0f + expf(-gate)) * up;
}

__global__ void expert_down_kernel(const float* act, int64_t inter, const int32_t* chosen,
                                   const void* const* experts, DType dtype, int64_t width,
                                   float* out) {
  extern __shared__ float act_s[];
  const int64_t pair = blockIdx.y;
  for (int64_t i = threadIdx.x; i < inter; i += blockDim.x) act_s[i] = act[pair * inter + i];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kGemvWarps) + warp;
  if (row >= width) return;
  const auto* down = row_address(experts[chosen[pair]], dtype, width, 2 * inter);
  const float y = warp_dot(row_address(down, dtype, inter, row), dtype, act_s, inter, lane);
  if (lane == 0) out[pair * width + row] = y;
}

__global__ void combine_pairs_kernel(const float* pair_out, int64_t width, const int32_t* chosen,
                                     const float* weights, int64_t n, int64_t k, float* y) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * width) return;
  const int64_t t = i / width, d = i % width;
  float sum = 0.0f;
  int32_t previous = -1;
  for (int64_t step = 0; step < k; ++step) {
    // The next choice in ascending expert order.
    int64_t next = -1;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = chosen[t * k + j];
      if (e > previous && (next < 0 || e < chosen[t * k + next])) next = j;
    }
    previous = chosen[t * k + next];
    sum += weights[t * k + next] * pair_out[(t * k + next) * width + d];
  }
  y[i] += sum;
}

// The block's largest (value, id) pair over every thread's candidate, the lowest id on ties; every
// thread gets the winning id. Ends with the block synchronised (shared memory reusable).
__device__ int32_t block_argmax(float value, int32_t id) {
  __shared__ float values[kThreads];
  __shared__ int32_t indices[kThreads];
  values[threadIdx.x] = value;
  indices[threadIdx.x] = id;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float other = values[threadIdx.x + stride];
      const int32_t other_id = indices[threadIdx.x + stride];
      if (other > values[threadIdx.x] ||
          (other == values[threadIdx.x] && other_id < indices[threadIdx.x])) {
        values[threadIdx.x] = other;
        indices[threadIdx.x] = other_id;
      }
    }
    __syncthreads();
  }
  const int32_t winner = indices[0];
  __syncthreads();
  return winner;
}

__global__ void argmax_kernel(const float* logits, int64_t vocab, int32_t* ids) {
  const float* row = logits + blockIdx.x * vocab;
  float best = -INFINITY;
  int32_t best_id = 0x7fffffff;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    if (row[v] > best || (row[v] == best && v < best_id)) {
      best = row[v];
      best_id = static_cast<int32_t>(v);
    }
  }
  const int32_t winner = block_argmax(best, best_id);
  // An all -inf / NaN row has no winner: id 0, as std::max_element gives on the host.
  if (threadIdx.x == 0) ids[blockIdx.x] = winner < vocab ? winner : 0;
}

// One block per row: the top_k candidates by repeated block-wide argmax (best first, ties to the
// lower id, the previous picks excluded), then the host sampler's arithmetic on thread 0.
__global__ void sample_top_k_kernel(const float* logits, int64_t vocab, const double* temperature,
                                    const int32_t* top_k, const double* min_p, const double* top_p,
                                    const double* uniform, int32_t* ids) {
  __shared__ int32_t picked[kMaxDeviceTopK];
  const int64_t row_index = blockIdx.x;
  const float* row = logits + row_index * vocab;
  int64_t k = top_k[row_index];
  if (k > vocab) k = vocab;
  if (k > kMaxDeviceTopK) k = kMaxDeviceTopK;
  if (k < 1) k = 1;
  // The previous pick, in every thread's registers (block_argmax hands each thread the winner;
  // reading it back from `picked` would race with thread 0's write).
  float last = INFINITY;
  int32_t last_id = -1;
  int64_t found = 0;
  for (int64_t j = 0; j < k; ++j) {
    // Candidates below the previous pick in (logit desc, id asc) order: strictly after it.
    float best = -INFINITY;
    int32_t best_id = 0x7fffffff;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float value = row[v];
      const bool after = value < last || (value == last && v > last_id);
      if (!after) continue;
      if (value > best || (value == best && v < best_id)) {
        best = value;
        best_id = static_cast<int32_t>(v);
      }
    }
    const int32_t winner = block_argmax(best, best_id);
    if (winner >= vocab) break;  // no candidate left above -inf (the same in every thread)
    if (threadIdx.x == 0) picked[j] = winner;
    last = row[winner];
    last_id = winner;
    found = j + 1;
  }
  if (threadIdx.x != 0) return;
  if (found == 0) {  // every logit -inf or NaN: no distribution to sample, as argmax takes id 0
    ids[row_index] = 0;
    return;
  }
  k = found;
  const double t = temperature[row_index] > 0 ? temperature[row_index] : 1.0;
  const double max_logit = row[picked[0]];
  // Weights relative to the best candidate's (1), as the host sampler keeps them.
  auto weight = [&](int64_t i) { return exp((row[picked[i]] - max_logit) / t); };
  int64_t kept = k;
  if (min_p[row_index] > 0.0) {
    int64_t above = 1;
    while (above < kept && weight(above) >= min_p[row_index]) ++above;
    kept = above;
  }
  double total = 0.0;
  for (int64_t i = 0; i < kept; ++i) total += weight(i);
  if (top_p[row_index] < 1.0) {
    double mass = 0.0;
    int64_t nucleus = 0;
    while (nucleus < kept) {
      mass += weight(nucleus++) / total;
      if (mass >= top_p[row_index]) break;
    }
    kept = nucleus;
    total = 0.0;
    for (int64_t i = 0; i < kept; ++i) total += weight(i);
  }
  const double target = uniform[row_index] * total;
  double cumulative = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    cumulative += weight(i);
    if (target < cumulative) {
      ids[row_index] = picked[i];
      return;
    }
  }
  ids[row_index] = picked[kept - 1];
}

// One block per row, a thread per penalised token. The _rn intrinsics keep nvcc from fusing the
// multiply into the subtraction, which would round differently from the host.
__global__ void apply_penalties_kernel(float* logits, int64_t vocab, const int32_t* offsets,
                                       const int32_t* tokens, const int32_t* generated,
                                       const double* repetition, const double* frequency,
                                       const double* presence) {
  const int64_t row_index = blockIdx.x;
  float* row = logits + row_index * vocab;
  for (int32_t e = offsets[row_index] + static_cast<int32_t>(threadIdx.x);
       e < offsets[row_index + 1]; e += static_cast<int32_t>(blockDim.x)) {
    const int32_t token = tokens[e];
    if (token < 0 || token >= vocab) continue;
    double value = row[token];
    value = value > 0.0 ? __ddiv_rn(value, repetition[row_index])
                        : __dmul_rn(value, repetition[row_index]);
    const double count = static_cast<double>(generated[e]);
    value = __dsub_rn(value, __dmul_rn(frequency[row_index], count));
    value = __dsub_rn(value, __dmul_rn(presence[row_index], generated[e] > 0 ? 1.0 : 0.0));
    row[token] = static_cast<float>(value);
  }
}

void allow_shared(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "shared memory size");
}

}  // namespace

void gemv(const float* x, int64_t n, int64_t x_stride, const void* w, DType dtype, int64_t rows,
          int64_t cols, float* y, int64_t y_stride, bool accumulate, cudaStream_t stream) {
  if (n == 0 || rows == 0) return;
  if (n > kGemvMaxRows) throw std::invalid_argument("gemv: more than kGemvMaxRows inputs");
  const auto grid = static_cast<unsigned>((rows + kGemvWarps - 1) / kGemvWarps);
  gemv_kernel<<<grid, 32 * kGemvWarps, 0, stream>>>(x, n, x_stride, w, dtype, rows, cols, y,
                                                    y_stride, accumulate);
  check(cudaGetLastError(), "gemv");
}

void expert_gate_up(const float* x, int64_t width, const int32_t* chosen, int64_t pairs, int64_t k,
                    const void* const* experts, DType dtype, int64_t inter, float* act,
                    cudaStream_t stream) {
  if (pairs == 0) return;
  const size_t shared = static_cast<size_t>(width) * sizeof(float);
  allow_shared(reinterpret_cast<const void*>(expert_gate_up_kernel), shared);
  const dim3 grid(static_cast<unsigned>((inter + kGemvWarps - 1) / kGemvWarps),
                  static_cast<unsigned>(pairs));
  expert_gate_up_kernel<<<grid, 32 * kGemvWarps, shared, stream>>>(x, width, chosen, k, experts,
                                                                   dtype, inter, act);
  check(cudaGetLastError(), "expert_gate_up");
}

void expert_down(const float* act, int64_t inter, const int32_t* chosen, int64_t pairs,
                 const void* const* experts, DType dtype, int64_t width, float* out,
                 cudaStream_t stream) {
  if (pairs == 0) return;
  const size_t shared = static_cast<size_t>(inter) * sizeof(float);
  allow_shared(reinterpret_cast<const void*>(expert_down_kernel), shared);
  const dim3 grid(static_cast<unsigned>((width + kGemvWarps - 1) / kGemvWarps),
                  static_cast<unsigned>(pairs));
  expert_down_kernel<<<grid, 32 * kGemvWarps, shared, stream>>>(act, inter, chosen, experts, dtype,
                                                                width, out);
  check(cudaGetLastError(), "expert_down");
}

void combine_pairs(const float* pair_out, int64_t width, const int32_t* chosen,
                   const float* weights, int64_t n, int64_t k, float* y, cudaStream_t stream) {
  if (n == 0) return;
  combine_pairs_kernel<<<blocks_for(n * width), kThreads, 0, stream>>>(pair_out, width, chosen,
                                                                       weights, n, k, y);
  check(cudaGetLastError(), "combine_pairs");
}

void sample_top_k(const float* logits, int64_t n, int64_t vocab, const double* temperature,
                  const int32_t* top_k, const double* min_p, const double* top_p,
                  const double* uniform, int32_t* ids, cudaStream_t stream) {
  if (n == 0) return;
  sample_top_k_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      logits, vocab, temperature, top_k, min_p, top_p, uniform, ids);
  check(cudaGetLastError(), "sample_top_k");
}

void apply_penalties(float* logits, int64_t n, int64_t vocab, const int32_t* offsets,
                     const int32_t* tokens, const int32_t* generated, const double* repetition,
                     const double* frequency, const double* presence, cudaStream_t stream) {
  if (n == 0) return;
  apply_penalties_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      logits, vocab, offsets, tokens, generated, repetition, frequency, presence);
  check(cudaGetLastError(), "apply_penalties");
}

void argmax(const float* logits, int64_t n, int64_t vocab, int32_t* ids, cudaStream_t stream) {
  if (n == 0) return;
  argmax_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(logits, vocab, ids);
  check(cudaGetLastError(), "argmax");
}

void embed(const void* table, DType dtype, int64_t width, const int32_t* tokens, int64_t n,
           float* out, cudaStream_t stream) {
  if (n == 0) return;
  embed_kernel<<<blocks_for(n * width), kThreads, 0, stream>>>(table, dtype, width, tokens, n, out);
  check(cudaGetLastError(), "embed");
}

void rms_norm(const float* x, int64_t n, int64_t dim, int64_t x_stride, const void* weight,
              DType weight_dtype, float eps, float* out, int64_t out_stride, cudaStream_t stream) {
  if (n == 0) return;
  rms_norm_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      x, dim, x_stride, weight, weight_dtype, eps, out, out_stride);
  check(cudaGetLastError(), "rms_norm");
}

void rope(float* x, int64_t n, int64_t heads, int64_t token_stride, int64_t head_stride,
          int64_t dim, const float* cos_sin, bool interleaved, cudaStream_t stream) {
  const int64_t count = n * heads * (dim / 2);
  if (count == 0) return;
  rope_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, n, heads, token_stride, head_stride,
                                                          dim, cos_sin, interleaved);
  check(cudaGetLastError(), "rope");
}

void write_kv(const float* k, const float* v, int64_t n, int64_t kv_heads, int64_t key_dim,
              int64_t value_dim, const int32_t* slot_index, float* keys, float* values,
              int64_t block_size, cudaStream_t stream, int64_t k_stride, int64_t v_stride) {
  const int64_t count = n * kv_heads * (key_dim + value_dim);
  if (count == 0) return;
  if (k_stride == 0) k_stride = kv_heads * key_dim;
  if (v_stride == 0) v_stride = kv_heads * value_dim;
  write_kv_kernel<<<blocks_for(count), kThreads, 0, stream>>>(k, v, n, kv_heads, key_dim, value_dim,
                                                              k_stride, v_stride, slot_index, keys,
                                                              values, block_size);
  check(cudaGetLastError(), "write_kv");
}

void pack_kv_blocks(const KvBlocks& kv, const int32_t* blocks, int64_t count, float* packed,
                    cudaStream_t stream) {
  if (count == 0 || kv.layers == 0) return;
  kv_blocks_kernel<true>
      <<<static_cast<unsigned>(count * kv.layers), kThreads, 0, stream>>>(kv, blocks, packed);
  check(cudaGetLastError(), "pack_kv_blocks");
}

void unpack_kv_blocks(const KvBlocks& kv, const int32_t* blocks, int64_t count, const float* packed,
                      cudaStream_t stream) {
  if (count == 0 || kv.layers == 0) return;
  kv_blocks_kernel<false><<<static_cast<unsigned>(count * kv.layers), kThreads, 0, stream>>>(
      kv, blocks, const_cast<float*>(packed));
  check(cudaGetLastError(), "unpack_kv_blocks");
}

void attention(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t n,
               int64_t heads, const DeviceKv& kv, const int32_t* block_tables,
               const int32_t* table_offset, const int32_t* positions, float scale,
               int64_t sliding_window, cudaStream_t stream) {
  if (n == 0) return;
  if (kv.value_dim > 32 * kMaxValuePerLane)
    throw std::invalid_argument("cuda attention: value width over 512");
  const size_t shared_bytes =
      sizeof(float) * static_cast<size_t>(kv.key_dim + kAttentionWarps * (kv.value_dim + 2));
  if (shared_bytes > 48 * 1024) {
    check(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared_bytes)),
          "attention shared memory");
  }
  attention_kernel<<<static_cast<unsigned>(n * heads), 32 * kAttentionWarps, shared_bytes,
                     stream>>>(q, q_stride, out, out_stride, heads, kv, block_tables, table_offset,
                               positions, scale, sliding_window);
  check(cudaGetLastError(), "attention");
}

void route(float* scores, int64_t n, const RouterSpec& spec, int32_t* chosen, float* weights,
           cudaStream_t stream) {
  if (n == 0) return;
  if (spec.experts > kMaxExperts || spec.top_k > kMaxTopK || spec.n_group > kMaxGroups)
    throw std::invalid_argument("cuda route: more than 512 experts, top-32 or 64 groups");
  route_kernel<<<blocks_for(n, 64), 64, 0, stream>>>(scores, n, spec, chosen, weights);
  check(cudaGetLastError(), "route");
}

void silu_mul(float* gate, const float* up, int64_t count, cudaStream_t stream) {
  if (count == 0) return;
  silu_mul_kernel<<<blocks_for(count), kThreads, 0, stream>>>(gate, up, count);
  check(cudaGetLastError(), "silu_mul");
}

void add(float* y, const float* x, int64_t count, cudaStream_t stream) {
  if (count == 0) return;
  add_kernel<<<blocks_for(count), kThreads, 0, stream>>>(y, x, count);
  check(cudaGetLastError(), "add");
}

void add_bias(float* y, int64_t n, int64_t width, const void* bias, DType dtype,
              cudaStream_t stream) {
  if (n * width == 0) return;
  add_bias_kernel<<<blocks_for(n * width), kThreads, 0, stream>>>(y, n, width, bias, dtype);
  check(cudaGetLastError(), "add_bias");
}

void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
               int64_t width, cudaStream_t stream) {
  if (rows * width == 0) return;
  copy_rows_kernel<<<blocks_for(rows * width), kThreads, 0, stream>>>(src, src_stride, dst,
                                                                      dst_stride, rows, width);
  check(cudaGetLastError(), "copy_rows");
}

void gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t count, float* out,
                 cudaStream_t stream) {
  if (count == 0) return;
  gather_rows_kernel<<<blocks_for(count * width), kThreads, 0, stream>>>(x, width, rows, count,
                                                                         out);
  check(cudaGetLastError(), "gather_rows");
}

void combine(const float* expert_out, int64_t width, const int32_t* slots, const float* weights,
             int64_t n, int64_t k, float* y, cudaStream_t stream) {
  if (n == 0) return;
  combine_kernel<<<blocks_for(n * width), kThreads, 0, stream>>>(expert_out, width, slots, weights,
                                                                 n, k, y);
  check(cudaGetLastError(), "combine");
}

float dequantize_element_on_host(const void* data, DType dtype, int64_t i) {
  return quant_element(static_cast<const uint8_t*>(data), dtype, i);
}

void dequantize(const void* w, DType dtype, int64_t rows, int64_t cols, float* out,
                cudaStream_t stream) {
  const int64_t count = rows * cols;
  if (count == 0) return;
  dequantize_kernel<<<blocks_for(count), kThreads, 0, stream>>>(w, dtype, count, out);
  check(cudaGetLastError(), "dequantize");
}

void convert(const float* x, int64_t rows, int64_t cols, int64_t x_stride, void* out, DType dtype,
             cudaStream_t stream) {
  if (rows * cols == 0) return;
  convert_kernel<<<blocks_for(rows * cols), kThreads, 0, stream>>>(x, rows, cols, x_stride, out,
                                                                   dtype);
  check(cudaGetLastError(), "convert");
}

}  // namespace moeline::kernels::cuda
