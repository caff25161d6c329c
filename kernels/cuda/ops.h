#pragma once
// The CUDA backend's kernels, as host functions that launch on a stream. Activations are F32 in
// device memory; weights are device copies in their stored dtype (F32, BF16, F16, and GGUF's
// block-quantized types, dequantized element by element as they are read), read in place.
// Layouts are the CPU backend's (kernels/cpu), so results can be compared op by op: matrices
// row-major [rows, cols], the paged KV cache [block][kv_head][slot][dim].
//
// Built only when nvcc is present (MOELINE_CUDA=AUTO|ON); nothing here is reached without it.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cpu/dtype.h"

namespace moeline::kernels::cuda {

// Throws std::runtime_error naming the call and CUDA's reason.
void check(cudaError_t status, const char* what);

// Whether a usable device is present; `why` says what is missing when not.
bool device_available(std::string* why);

// out[t] = widen(table[tokens[t]]), rows of `width`.
void embed(const void* table, DType dtype, int64_t width, const int32_t* tokens, int64_t n,
           float* out, cudaStream_t stream);

// As kernels::rms_norm: out = x / sqrt(mean(x²) + eps) * weight, row by row; out may alias x.
void rms_norm(const float* x, int64_t n, int64_t dim, int64_t x_stride, const void* weight,
              DType weight_dtype, float eps, float* out, int64_t out_stride, cudaStream_t stream);

// Rotates `heads` vectors of each of n tokens: vector h of token t starts at
// x + t * token_stride + h * head_stride; its first `dim` floats rotate by the token's angles
// (cos_sin: n rows of dim/2 cosines then dim/2 sines), pairs (i, i + dim/2) or (2i, 2i + 1).
void rope(float* x, int64_t n, int64_t heads, int64_t token_stride, int64_t head_stride,
          int64_t dim, const float* cos_sin, bool interleaved, cudaStream_t stream);

// Writes each token's K and V rows (kv_heads of key_dim / value_dim, contiguous per token; token
// t's at k + t * k_stride and v + t * v_stride, 0: packed) into the paged cache at slot_index[t] =
// block * block_size + slot. values may be null (MLA).
void write_kv(const float* k, const float* v, int64_t n, int64_t kv_heads, int64_t key_dim,
              int64_t value_dim, const int32_t* slot_index, float* keys, float* values,
              int64_t block_size, cudaStream_t stream, int64_t k_stride = 0, int64_t v_stride = 0);

// KV blocks between the paged cache and the format they move in between processes
// (model::KvCache::export_block): block i of `packed` holds, layer after layer, that block's keys
// then its values. In the cache, layer l's keys start at base + l * layer_stride, block-major,
// and its values key_part floats after them.
struct KvBlocks {
  float* base = nullptr;
  int64_t layers = 0, layer_stride = 0, key_part = 0;  // floats
  int64_t key_floats = 0, value_floats = 0;            // one block of one layer
  int64_t block_floats() const { return layers * (key_floats + value_floats); }  // packed
};
void pack_kv_blocks(const KvBlocks& kv, const int32_t* blocks, int64_t count, float* packed,
                    cudaStream_t stream);
void unpack_kv_blocks(const KvBlocks& kv, const int32_t* blocks, int64_t count, const float* packed,
                      cudaStream_t stream);

struct DeviceKv {
  const float* keys = nullptr;
  const float* values = nullptr;  // == keys for MLA (values are a prefix of each key row)
  int64_t block_size = 16, kv_heads = 0, key_dim = 0, value_dim = 0, value_stride = 0;
};

// Causal attention for n query tokens: token t's query heads at q + t * q_stride (heads of
// key_dim), output at out + t * out_stride (heads of value_dim); it sees positions
// [max(0, position - window + 1), position] of its sequence through its block table
// (block_tables + table_offset[t]). value_dim <= 512.
void attention(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t n,
               int64_t heads, const DeviceKv& kv, const int32_t* block_tables,
               const int32_t* table_offset, const int32_t* positions, float scale,
               int64_t sliding_window, cudaStream_t stream);

struct RouterSpec {
  int64_t experts = 0, top_k = 0;
  bool sigmoid = false;
  int group_limit = 0;  // 0 none, 1 group max, 2 group top-two sum
  int64_t n_group = 1, topk_group = 1;
  bool normalise = true, scale_normalised = false;
  double scaling = 1.0;
  const void* bias = nullptr;  // [experts] or null
  DType bias_dtype = DType::kF32;
};

// The CPU engine's route(): scores (n × experts logits, in place) become softmax or sigmoid
// scores; chosen the top-k experts per token (ties to the lower id), weights their weights.
void route(float* scores, int64_t n, const RouterSpec& spec, int32_t* chosen, float* weights,
           cudaStream_t stream);

// gate[i] = silu(gate[i]) * up[i]
void silu_mul(float* gate, const float* up, int64_t count, cudaStream_t stream);
// y[i] += x[i]
void add(float* y, const float* x, int64_t count, cudaStream_t stream);
// y[t * width + i] += bias[i] for n rows.
void add_bias(float* y, int64_t n, int64_t width, const void* bias, DType dtype,
              cudaStream_t stream);
// dst row r (dst_stride apart) = src row r (src_stride apart), `width` floats, for `rows` rows.
void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
               int64_t width, cudaStream_t stream);
// out row r = x row rows[r], rows of `width`.
void gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t count, float* out,
                 cudaStream_t stream);
// y[t] += Σ_j weights[t*k + j] * expert_out[slots[t*k + j]], j in the given order.
void combine(const float* expert_out, int64_t width, const int32_t* slots, const float* weights,
             int64_t n, int64_t k, float* y, cudaStream_t stream);
// A [rows, cols] weight matrix in any dtype (block-quantized ones included, dequantized as GGUF
// defines them) widened to F32 into `out` [rows, cols]: the weight side of a quantized GEMM.
void dequantize(const void* w, DType dtype, int64_t rows, int64_t cols, float* out,
                cudaStream_t stream);
// Weight i of a block-quantized array by the device kernels' own rule, run on the host: tests
// check the rule against the CPU without a GPU.
float dequantize_element_on_host(const void* data, DType dtype, int64_t i);
// A [rows, cols] block of F32 with row stride x_stride, converted to `dtype` into a packed
// [rows, cols] buffer: the input side of a GEMM against weights of that dtype.
void convert(const float* x, int64_t rows, int64_t cols, int64_t x_stride, void* out, DType dtype,
             cudaStream_t stream);
// y[t] (y_stride apart) = W · x[t] (x_stride apart), or y[t] += W · x[t] with `accumulate`, for
// n <= kGemvMaxRows inputs; W [rows, cols] row-major in `dtype`. One warp per output row reading
// it once for every input, activations in F32 (not rounded to the weights' dtype): a decode
// step's projections in one kernel each, where cuBLAS would convert the activations first.
inline constexpr int64_t kGemvMaxRows = 8;
void gemv(const float* x, int64_t n, int64_t x_stride, const void* w, DType dtype, int64_t rows,
          int64_t cols, float* y, int64_t y_stride, bool accumulate, cudaStream_t stream);
// The routed experts of a few tokens without leaving the device (decode): for each (token t,
// choice j) pair p = t * k + j, expert e = chosen[p] has its gate | up | down matrices at
// experts[e] (rows [inter, width], [inter, width], [width, inter] back to back, in `dtype`), and
//   act[p] = silu(gate_e · x[t]) * (up_e · x[t])      (expert_gate_up)
//   out[p] = down_e · act[p]                           (expert_down)
// One warp per output row, activations in F32 (not rounded to the weights' dtype).
void expert_gate_up(const float* x, int64_t width, const int32_t* chosen, int64_t pairs, int64_t k,
                    const void* const* experts, DType dtype, int64_t inter, float* act,
                    cudaStream_t stream);
void expert_down(const float* act, int64_t inter, const int32_t* chosen, int64_t pairs,
                 const void* const* experts, DType dtype, int64_t width, float* out,
                 cudaStream_t stream);
// y[t] += Σ_j weights[t*k + j] * pair_out[t*k + j], the j taken in ascending expert order (as the
// CPU engine sums them).
void combine_pairs(const float* pair_out, int64_t width, const int32_t* chosen,
                   const float* weights, int64_t n, int64_t k, float* y, cudaStream_t stream);
// ids[t] = the index of the largest of logits[t] (vocab values), the lowest on ties: greedy
// sampling on the device.
void argmax(const float* logits, int64_t n, int64_t vocab, int32_t* ids, cudaStream_t stream);

// Sampling with a temperature from the top_k (1..1024) candidates, cut by min_p and to the top_p
// nucleus, as model::Sampler does on the host given the same uniform draw: row t uses
// temperature[t], top_k[t], min_p[t], top_p[t] and uniform[t] in [0, 1). (Sampling from the whole
// vocabulary, top_k 0, needs its full sort and stays on the host.)
inline constexpr int64_t kMaxDeviceTopK = 1024;
void sample_top_k(const float* logits, int64_t n, int64_t vocab, const double* temperature,
                  const int32_t* top_k, const double* min_p, const double* top_p,
                  const double* uniform, int32_t* ids, cudaStream_t stream);

// The repetition, frequency and presence penalties on n rows of logits in place, as
// model::apply_penalties does on the host (bit for bit: double arithmetic, no fused multiply-add,
// one rounding to float): row t's penalised tokens are tokens[offsets[t] .. offsets[t + 1]), each
// with its count in the output so far (generated; 0: only in the prompt), and its parameters
// repetition[t], frequency[t], presence[t]. A token appears at most once per row.
void apply_penalties(float* logits, int64_t n, int64_t vocab, const int32_t* offsets,
                     const int32_t* tokens, const int32_t* generated, const double* repetition,
                     const double* frequency, const double* presence, cudaStream_t stream);

}  // namespace moeline::kernels::cuda
