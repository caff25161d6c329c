// The CUDA backend against the CPU backend: each op on random data, then whole models. Every test
// that needs a device skips with the reason when CUDA has none; main() turns skips into CTest's
// "skipped" where no GPU is expected and into a failure where one is (see main), so a GPU machine
// cannot pass the suite by skipping it.
//
// Tolerances: F32 ops differ from the CPU's only in summation order (~1e-6 relative); cuBLAS
// multiplies 16-bit weights with activations rounded to that width (BF16: 8 bits of mantissa,
// ~4e-3 per element), so BF16 models are held to 1e-2. Whole F32 models must pick the same greedy
// tokens (on the tiny models the top two logits are never within the ~1e-5 the routes differ by).
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "../unit/kernel_test_inputs.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/ops.h"
#include "model/cuda_engine.h"
#include "model/forward.h"
#include "model/sampling.h"
#include "offload/expert_pool.h"
#include "offload/resident_provider.h"

namespace moeline {
namespace {

namespace cu = kernels::cuda;

// The generated tiny models: MOELINE_TEST_MODELS in the environment (a GPU machine running a
// binary built elsewhere), else where this build's tests generate them.
std::string models_dir() {
  const char* from_environment = std::getenv("MOELINE_TEST_MODELS");
  return from_environment ? from_environment : MOELINE_TEST_MODELS;
}

#define REQUIRE_DEVICE()                                  \
  do {                                                    \
    std::string why;                                      \
    if (!cu::device_available(&why)) GTEST_SKIP() << why; \
  } while (0)

double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// A device copy of host data, freed at scope end.
template <class T>
struct Device {
  T* data = nullptr;
  size_t count = 0;
  explicit Device(const std::vector<T>& host) : count(host.size()) {
    cu::check(cudaMalloc(reinterpret_cast<void**>(&data), std::max<size_t>(count, 1) * sizeof(T)),
              "malloc");
    cu::check(cudaMemcpy(data, host.data(), count * sizeof(T), cudaMemcpyHostToDevice), "copy");
  }
  ~Device() { cudaFree(data); }
  std::vector<T> host() const {
    std::vector<T> out(count);
    cu::check(cudaMemcpy(out.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost), "copy");
    return out;
  }
};

std::vector<float> random_floats(size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng) * scale;
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = kernels::float_to_bf16(v[i]);
  return out;
}

TEST(CudaOps, RmsNormMatchesTheCpu) {
  REQUIRE_DEVICE();
  const int64_t n = 7, dim = 1000;
  const auto x = random_floats(n * dim, 1), w = random_floats(dim, 2);
  std::vector<float> want(x.size());
  kernels::rms_norm(x.data(), n, dim, dim, {w.data(), kernels::DType::kF32, dim}, 1e-6f,
                    want.data(), dim);
  Device<float> dx(x), dw(w), dout(std::vector<float>(x.size()));
  cu::rms_norm(dx.data, n, dim, dim, dw.data, kernels::DType::kF32, 1e-6f, dout.data, dim, nullptr);
  EXPECT_LE(relative_l2(dout.host(), want), 1e-6);
}

TEST(CudaOps, RopeMatchesTheCpuInBothLayouts) {
  REQUIRE_DEVICE();
  for (bool interleaved : {false, true}) {
    const kernels::Rope rope(std::vector<double>{1.0, 0.3, 0.05, 0.001}, 1.2, interleaved);
    const int64_t n = 5, heads = 3, stride = 10;  // 8 rotated dims in vectors of 10
    auto x = random_floats(n * heads * stride, 3);
    std::vector<float> angles(static_cast<size_t>(n * 8));
    for (int64_t t = 0; t < n; ++t) rope.angles(100 + t * 37, angles.data() + t * 8);
    Device<float> dx(x), da(angles);
    cu::rope(dx.data, n, heads, heads * stride, stride, 8, da.data, interleaved, nullptr);
    for (int64_t t = 0; t < n; ++t)
      rope.rotate(x.data() + t * heads * stride, heads, stride, angles.data() + t * 8);
    EXPECT_LE(relative_l2(dx.host(), x), 1e-6) << "interleaved " << interleaved;
  }
}

TEST(CudaOps, MatmulMatchesTheCpu) {
  REQUIRE_DEVICE();
  kernels::ThreadPool pool(2);
  const int64_t rows = 96, cols = 200;
  const auto w = random_floats(rows * cols, 4, 0.1f);
  const auto w16 = to_bf16(w);
  for (int64_t n : {1, 5, 33}) {
    const auto x = random_floats(n * cols, 5);
    for (bool bf16 : {false, true}) {
      const kernels::MatrixView host_w{bf16 ? static_cast<const void*>(w16.data()) : w.data(),
                                       bf16 ? kernels::DType::kBF16 : kernels::DType::kF32, rows,
                                       cols};
      std::vector<float> want(static_cast<size_t>(n * rows));
      kernels::matmul(pool,
                      kernels::MatmulTask{.x = x.data(), .n = n, .w = host_w, .y = want.data()});
      Device<float> dw32(w), dx(x), dy(std::vector<float>(want.size()));
      Device<uint16_t> dw16(w16);
      cu::Blas blas(nullptr);
      blas.matmul(
          dx.data, n,
          {bf16 ? static_cast<const void*>(dw16.data) : dw32.data, host_w.dtype, rows, cols},
          dy.data);
      cu::check(cudaDeviceSynchronize(), "sync");
      EXPECT_LE(relative_l2(dy.host(), want), bf16 ? 1e-2 : 1e-5) << "n " << n << " bf16 " << bf16;
    }
  }
}

// The decode path's GEMV (n <= kGemvMaxRows): F32 activations against the stored weights, as the
// CPU computes them, so even BF16 weights agree to summation order; strided inputs and outputs,
// and accumulation into the output (the residual stream).
TEST(CudaOps, GemvMatchesTheCpuWithStridesAndAccumulation) {
  REQUIRE_DEVICE();
  kernels::ThreadPool pool(2);
  // 260 = 32 vectors of 8 and a tail of 4; odd BF16 rows start 8 bytes off a vector boundary.
  const int64_t rows = 130, cols = 260;
  const auto w = random_floats(rows * cols, 6, 0.1f);
  const auto w16 = to_bf16(w);
  for (int64_t n : {int64_t{1}, int64_t{3}, cu::kGemvMaxRows}) {
    const int64_t x_stride = cols + 5, y_stride = rows + 7;
    const auto x = random_floats(n * x_stride, 7);
    const auto base = random_floats(n * y_stride, 8);
    for (bool bf16 : {false, true}) {
      const kernels::MatrixView host_w{bf16 ? static_cast<const void*>(w16.data()) : w.data(),
                                       bf16 ? kernels::DType::kBF16 : kernels::DType::kF32, rows,
                                       cols};
      std::vector<float> packed_x(static_cast<size_t>(n * cols)),
          product(static_cast<size_t>(n * rows));
      for (int64_t t = 0; t < n; ++t)
        std::copy_n(x.begin() + t * x_stride, cols, packed_x.begin() + t * cols);
      kernels::matmul(pool, kernels::MatmulTask{
                                .x = packed_x.data(), .n = n, .w = host_w, .y = product.data()});
      for (bool accumulate : {false, true}) {
        std::vector<float> want = base;
        for (int64_t t = 0; t < n; ++t)
          for (int64_t r = 0; r < rows; ++r)
            want[static_cast<size_t>(t * y_stride + r)] =
                (accumulate ? base[static_cast<size_t>(t * y_stride + r)] : 0.0f) +
                product[static_cast<size_t>(t * rows + r)];
        Device<float> dw32(w), dx(x), dy(base);
        Device<uint16_t> dw16(w16);
        cu::gemv(dx.data, n, x_stride, bf16 ? static_cast<const void*>(dw16.data) : dw32.data,
                 host_w.dtype, rows, cols, dy.data, y_stride, accumulate, nullptr);
        cu::check(cudaDeviceSynchronize(), "sync");
        std::vector<float> got = dy.host();
        // Outside each row's `rows` outputs nothing is written.
        for (int64_t t = 0; t < n; ++t)
          for (int64_t r = rows;
               r < y_stride && t * y_stride + r < static_cast<int64_t>(got.size()); ++r)
            EXPECT_EQ(got[static_cast<size_t>(t * y_stride + r)],
                      base[static_cast<size_t>(t * y_stride + r)]);
        EXPECT_LE(relative_l2(got, want), 1e-5)
            << "n " << n << " bf16 " << bf16 << " accumulate " << accumulate;
      }
    }
  }
}

// The device's dequantization rule for every block-quantized type, run on the host (no GPU
// needed), against the CPU's: the same weights to a rounding (nvcc may fuse d*scale*q - dmin*m).
TEST(CudaOps, QuantizedDecodeRuleMatchesTheCpuOnTheHost) {
  const int64_t rows = 6, cols = 512;
  for (kernels::DType dtype : kernels::kQuantizedTypes) {
    const std::vector<uint8_t> bytes = kernels::test::random_quantized_rows(dtype, rows, cols, 23);
    const kernels::MatrixView w{bytes.data(), dtype, rows, cols};
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      kernels::widen_row(w, r, row.data());
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_NEAR(cu::dequantize_element_on_host(bytes.data(), dtype, r * cols + c),
                    row[static_cast<size_t>(c)],
                    1e-6 * std::abs(row[static_cast<size_t>(c)]) + 1e-12)
            << kernels::dtype_name(dtype) << " row " << r << " col " << c;
    }
  }
}

// Every block-quantized type (GGUF's, as a GGUF model's weights arrive on the device): the
// dequantize kernel against the CPU's exact dequantization (the GPU may fuse d*scale*q - dmin*m
// into one rounding: 1e-6 relative per weight), and the decode GEMV and the prefill route
// (dequantize, then an F32 GEMM) against the CPU's exact mode, to summation order (1e-5).
TEST(CudaOps, QuantizedWeightsMatchTheCpu) {
  REQUIRE_DEVICE();
  kernels::ThreadPool pool(2);
  const kernels::QuantMath saved = kernels::quant_math();
  kernels::set_quant_math(kernels::QuantMath::kExact);
  const int64_t rows = 40, cols = 512;
  for (kernels::DType dtype : kernels::kQuantizedTypes) {
    const std::vector<uint8_t> bytes = kernels::test::random_quantized_rows(dtype, rows, cols, 21);
    const kernels::MatrixView host_w{bytes.data(), dtype, rows, cols};
    std::vector<float> widened(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) kernels::widen_row(host_w, r, widened.data() + r * cols);
    Device<uint8_t> dw(bytes);
    Device<float> dequantized(std::vector<float>(widened.size()));
    cu::dequantize(dw.data, dtype, rows, cols, dequantized.data, nullptr);
    cu::check(cudaDeviceSynchronize(), "sync");
    const std::vector<float> got_weights = dequantized.host();
    for (size_t i = 0; i < widened.size(); ++i)
      ASSERT_NEAR(got_weights[i], widened[i], 1e-6 * std::abs(widened[i]) + 1e-12)
          << kernels::dtype_name(dtype) << " weight " << i;
    for (int64_t n : {int64_t{3}, int64_t{20}}) {
      const auto x = random_floats(n * cols, 22);
      std::vector<float> want(static_cast<size_t>(n * rows));
      kernels::matmul(pool,
                      kernels::MatmulTask{.x = x.data(), .n = n, .w = host_w, .y = want.data()});
      Device<float> dx(x), dy(std::vector<float>(want.size()));
      cu::Blas blas(nullptr);
      blas.matmul(dx.data, n, {dw.data, dtype, rows, cols}, dy.data);
      cu::check(cudaDeviceSynchronize(), "sync");
      EXPECT_LE(relative_l2(dy.host(), want), 1e-5) << kernels::dtype_name(dtype) << " n " << n;
    }
  }
  kernels::set_quant_math(saved);
}

TEST(CudaOps, PagedAttentionMatchesTheCpuForGqaAndLatentCaches) {
  REQUIRE_DEVICE();
  kernels::ThreadPool pool(2);
  struct Shape {
    int64_t heads, kv_heads, key_dim, value_dim;
    bool latent;
  };
  for (const Shape shape : {Shape{8, 2, 64, 64, false}, Shape{16, 1, 576, 512, true}}) {
    const int64_t blocks = 40, bs = 16;
    auto keys = random_floats(blocks * bs * shape.kv_heads * shape.key_dim, 6);
    auto values = shape.latent ? std::vector<float>{}
                               : random_floats(blocks * bs * shape.kv_heads * shape.value_dim, 7);
    std::vector<int32_t> table(blocks);
    for (int64_t b = 0; b < blocks; ++b)
      table[static_cast<size_t>(b)] = static_cast<int32_t>((b * 7 + 3) % blocks);
    const std::vector<int32_t> positions = {0, 17, 300, 639};
    const int64_t n = static_cast<int64_t>(positions.size());
    const auto q = random_floats(n * shape.heads * shape.key_dim, 8, 0.05f);
    std::vector<float> want(static_cast<size_t>(n * shape.heads * shape.value_dim));
    const kernels::PagedKvLayer cpu{keys.data(),
                                    shape.latent ? keys.data() : values.data(),
                                    bs,
                                    shape.kv_heads,
                                    shape.key_dim,
                                    shape.value_dim,
                                    shape.latent ? shape.key_dim : shape.value_dim};
    std::vector<kernels::AttentionQuery> queries;
    for (int64_t t = 0; t < n; ++t)
      queries.push_back({q.data() + t * shape.heads * shape.key_dim,
                         want.data() + t * shape.heads * shape.value_dim, table.data(),
                         positions[static_cast<size_t>(t)]});
    const float scale = 0.1f;
    kernels::paged_attention(pool, cpu, queries, shape.heads, scale, 0);
    Device<float> dk(keys), dv(shape.latent ? keys : values), dq(q),
        dout(std::vector<float>(want.size()));
    Device<int32_t> dtable(table), doffset(std::vector<int32_t>(static_cast<size_t>(n), 0)),
        dpos(positions);
    const cu::DeviceKv kv{dk.data,
                          shape.latent ? dk.data : dv.data,
                          bs,
                          shape.kv_heads,
                          shape.key_dim,
                          shape.value_dim,
                          shape.latent ? shape.key_dim : shape.value_dim};
    cu::attention(dq.data, shape.heads * shape.key_dim, dout.data, shape.heads * shape.value_dim, n,
                  shape.heads, kv, dtable.data, doffset.data, dpos.data, scale, 0, nullptr);
    cu::check(cudaDeviceSynchronize(), "sync");
    EXPECT_LE(relative_l2(dout.host(), want), 1e-5) << "latent " << shape.latent;
  }
}

TEST(CudaOps, ArgmaxTakesTheLowestIdOnTies) {
  REQUIRE_DEVICE();
  const int64_t vocab = 50000;
  auto logits = random_floats(3 * vocab, 9);
  logits[123] = 99.0f;            // row 0
  logits[vocab + 40000] = 99.0f;  // row 1: a tie, the lower id wins
  logits[vocab + 40001] = 99.0f;
  logits[2 * vocab + vocab - 1] = 99.0f;  // row 2: the last id
  Device<float> dl(logits);
  Device<int32_t> ids(std::vector<int32_t>(3, -1));
  cu::argmax(dl.data, 3, vocab, ids.data, nullptr);
  EXPECT_EQ(ids.host(), (std::vector<int32_t>{123, 40000, static_cast<int32_t>(vocab - 1)}));
}

TEST(CudaOps, TopKSamplingPicksWhatTheHostSamplerPicks) {
  REQUIRE_DEVICE();
  const int64_t vocab = 5000;
  int compared = 0;
  for (double temperature : {0.7, 1.3})
    for (int32_t top_k : {1, 40, 1000})
      for (double top_p : {1.0, 0.9, 0.5})
        for (double min_p : {0.0, 0.05}) {
          for (uint64_t seed = 1; seed <= 8; ++seed) {
            const auto logits =
                random_floats(static_cast<size_t>(vocab), static_cast<unsigned>(seed));
            model::SamplingParams params;
            params.temperature = temperature;
            params.top_k = top_k;
            params.top_p = top_p;
            params.min_p = min_p;
            params.seed = seed;
            model::Sampler sampler(params);
            const int32_t want = sampler.sample(logits.data(), vocab);
            // The sampler's one uniform draw for this sample (model/sampling.cpp).
            std::mt19937_64 rng(seed);
            const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
            Device<float> dl(logits);
            Device<double> dt(std::vector<double>{temperature}), dp(std::vector<double>{top_p}),
                dm(std::vector<double>{min_p}), du(std::vector<double>{u});
            Device<int32_t> dk(std::vector<int32_t>{top_k}), id(std::vector<int32_t>{-1});
            cu::sample_top_k(dl.data, 1, vocab, dt.data, dk.data, dm.data, dp.data, du.data,
                             id.data, nullptr);
            ASSERT_EQ(id.host()[0], want) << "T " << temperature << " k " << top_k << " p " << top_p
                                          << " min_p " << min_p << " seed " << seed;
            ++compared;
          }
        }
  EXPECT_EQ(compared, 288);
}

TEST(CudaOps, PenaltiesMatchTheHostBitForBit) {
  REQUIRE_DEVICE();
  const int64_t vocab = 5000, rows = 3;
  auto logits = random_floats(static_cast<size_t>(rows * vocab), 17, 4.0f);
  const std::vector<model::SamplingParams> params = {
      {.presence_penalty = 0.7, .frequency_penalty = 0.3, .repetition_penalty = 1.3},
      {.presence_penalty = -1.25, .frequency_penalty = 2.0, .repetition_penalty = 0.8},
      {.repetition_penalty = 1.05}};
  std::vector<int32_t> offsets = {0}, tokens, generated;
  std::vector<double> repetition, frequency, presence;
  std::vector<float> want = logits;
  std::mt19937 rng(5);
  for (int64_t t = 0; t < rows; ++t) {
    // Distinct tokens, some only in the prompt (count 0), some generated up to 5 times.
    std::vector<model::PenalizedToken> row;
    for (int32_t token = static_cast<int32_t>(rng() % 7); token < vocab;
         token += 1 + static_cast<int32_t>(rng() % 97))
      row.push_back({token, static_cast<int32_t>(rng() % 6)});
    model::apply_penalties(want.data() + t * vocab, vocab, row, params[static_cast<size_t>(t)]);
    for (const auto& entry : row)
      tokens.push_back(entry.token), generated.push_back(entry.generated);
    offsets.push_back(static_cast<int32_t>(tokens.size()));
    repetition.push_back(params[static_cast<size_t>(t)].repetition_penalty);
    frequency.push_back(params[static_cast<size_t>(t)].frequency_penalty);
    presence.push_back(params[static_cast<size_t>(t)].presence_penalty);
  }
  Device<float> dl(logits);
  Device<int32_t> doff(offsets), dtok(tokens), dgen(generated);
  Device<double> drep(repetition), dfreq(frequency), dpres(presence);
  cu::apply_penalties(dl.data, rows, vocab, doff.data, dtok.data, dgen.data, drep.data, dfreq.data,
                      dpres.data, nullptr);
  const std::vector<float> got = dl.host();
  ASSERT_EQ(got.size(), want.size());
  int64_t changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "logit " << i;
    changed += got[i] != logits[i];
  }
  EXPECT_GT(changed, 100);  // the penalties did something
}

TEST(CudaOps, DeviceExpertsMatchTheCpuExperts) {
  REQUIRE_DEVICE();
  // Three experts of a BF16 layer, two tokens choosing two each.
  const int64_t width = 64, inter = 40, experts = 3, k = 2, n = 2;
  std::vector<std::vector<uint16_t>> weights;
  for (int e = 0; e < experts; ++e)
    weights.push_back(to_bf16(random_floats(static_cast<size_t>(3 * inter * width), 20 + e, 0.1f)));
  const auto x = random_floats(static_cast<size_t>(n * width), 30);
  const std::vector<int32_t> chosen = {2, 0, 1, 2};
  const std::vector<float> pick_weights = {0.7f, 0.3f, 0.4f, 0.6f};
  // The CPU: y[t] = Σ over the choices in ascending expert order of w * down(silu(gate x) * up x).
  std::vector<float> want(static_cast<size_t>(n * width), 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<std::pair<int32_t, float>> picks;
    for (int64_t j = 0; j < k; ++j)
      picks.emplace_back(chosen[static_cast<size_t>(t * k + j)],
                         pick_weights[static_cast<size_t>(t * k + j)]);
    std::sort(picks.begin(), picks.end());
    for (const auto& [e, w] : picks) {
      std::vector<float> dense(weights[static_cast<size_t>(e)].size());
      kernels::widen(weights[static_cast<size_t>(e)].data(), kernels::DType::kBF16,
                     static_cast<int64_t>(dense.size()), dense.data());
      std::vector<float> act(static_cast<size_t>(inter));
      for (int64_t i = 0; i < inter; ++i) {
        const float g = kernels::dot(dense.data() + i * width, x.data() + t * width, width);
        const float u =
            kernels::dot(dense.data() + (inter + i) * width, x.data() + t * width, width);
        act[static_cast<size_t>(i)] = g / (1.0f + std::exp(-g)) * u;
      }
      for (int64_t d = 0; d < width; ++d)
        want[static_cast<size_t>(t * width + d)] +=
            w * kernels::dot(dense.data() + 2 * inter * width + d * inter, act.data(), inter);
    }
  }
  std::vector<std::unique_ptr<Device<uint16_t>>> device_weights;
  std::vector<const void*> table;
  for (const auto& w : weights) {
    device_weights.push_back(std::make_unique<Device<uint16_t>>(w));
    table.push_back(device_weights.back()->data);
  }
  Device<const void*> dtable(table);
  Device<float> dx(x), act(std::vector<float>(static_cast<size_t>(n * k * inter))),
      pair_out(std::vector<float>(static_cast<size_t>(n * k * width))),
      y(std::vector<float>(want.size(), 0.0f)), dw(pick_weights);
  Device<int32_t> dchosen(chosen);
  cu::expert_gate_up(dx.data, width, dchosen.data, n * k, k, dtable.data, kernels::DType::kBF16,
                     inter, act.data, nullptr);
  cu::expert_down(act.data, inter, dchosen.data, n * k, dtable.data, kernels::DType::kBF16, width,
                  pair_out.data, nullptr);
  cu::combine_pairs(pair_out.data, width, dchosen.data, dw.data, n, k, y.data, nullptr);
  cu::check(cudaDeviceSynchronize(), "sync");
  EXPECT_LE(relative_l2(y.host(), want), 1e-5);
}

struct Generation {
  std::vector<int32_t> tokens;
  std::vector<float> first_logits, last_logits;
};

// Greedy generation of `steps` tokens after `prompt`: prefill, then one token at a time.
template <class Forward>
Generation generate(Forward&& forward, model::BlockPool& pool, const std::vector<int32_t>& prompt,
                    int64_t vocab, int steps) {
  Generation run;
  model::Sequence sequence(1, 0, 0);
  std::vector<float> logits;
  model::SequenceInput input{&sequence, prompt, true};
  EXPECT_TRUE(forward(std::span(&input, 1), logits));
  run.first_logits = logits;
  for (int step = 0; step < steps; ++step) {
    run.tokens.push_back(model::argmax(logits.data(), vocab));
    input = {&sequence, std::span(&run.tokens.back(), 1), true};
    EXPECT_TRUE(forward(std::span(&input, 1), logits));
  }
  run.last_logits = logits;
  sequence.release(pool);
  return run;
}

class CudaModel : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaModel, GeneratesWhatTheCpuEngineGeneratesAtEveryExpertBudget) {
  REQUIRE_DEVICE();
  auto loaded = model::Model::load(models_dir() + "/" + GetParam());
  ASSERT_TRUE(loaded) << loaded.error().message;
  const model::Model& m = **loaded;
  const int64_t vocab = m.config().vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 37; ++i) prompt.push_back(static_cast<int32_t>((i * 53 + 7) % vocab));
  kernels::ThreadPool threads(2);
  offload::ResidentExpertProvider experts(m.experts());
  model::KvCache cache(m.config(), 64);
  model::Engine cpu(m, experts, threads, cache);
  const Generation want =
      generate([&](auto batch, auto& logits) { return cpu.forward(batch, logits).ok(); },
               cache.pool(), prompt, vocab, 16);
  const bool f32 = m.dtype_summary() == "F32";
  std::vector<Generation> budgets;
  for (double budget : {1.0, 0.5, 0.25}) {
    auto engine = model::CudaEngine::create(m, {.kv_blocks = 64, .expert_budget_fraction = budget});
    ASSERT_TRUE(engine) << engine.error().message;
    const Generation got = generate(
        [&](auto batch, auto& logits) {
          const moeline::Status status = (*engine)->forward(batch, logits);
          EXPECT_TRUE(status.ok()) << (status.ok() ? "" : status.error().message);
          return status.ok();
        },
        (*engine)->pool(), prompt, vocab, 16);
    EXPECT_LE(relative_l2(got.first_logits, want.first_logits), f32 ? 1e-4 : 1e-2)
        << "budget " << budget;
    if (f32) {
      EXPECT_EQ(got.tokens, want.tokens) << "budget " << budget;
    }
    if (budget == 1.0) {
      // Decode steps replayed from CUDA graphs run the very kernels of an eager step.
      EXPECT_GT((*engine)->graph_replays(), 0u);
      auto eager = model::CudaEngine::create(
          m, {.kv_blocks = 64, .expert_budget_fraction = 1.0, .decode_graphs = false});
      ASSERT_TRUE(eager) << eager.error().message;
      const Generation without =
          generate([&](auto batch, auto& logits) { return (*eager)->forward(batch, logits).ok(); },
                   (*eager)->pool(), prompt, vocab, 16);
      EXPECT_EQ((*eager)->graph_replays(), 0u);
      EXPECT_EQ(without.tokens, got.tokens);
      EXPECT_EQ(without.last_logits, got.last_logits);
    }
    if (budget < 1.0) {
      const model::CudaExpertStats stats = (*engine)->expert_stats();
      EXPECT_GT(stats.misses, 0u) << "budget " << budget;
      // A prompt's experts are the same GEMMs whatever the budget: identical bits. (Decode steps
      // with every expert resident run them as GEMVs on F32 activations instead, so only F32
      // models must keep the same tokens there; they do above, against the CPU.)
      EXPECT_EQ(got.first_logits, budgets.front().first_logits) << "budget " << budget;
    }
    budgets.push_back(got);
  }
  // The device tier fed from the node's shared host pool (half the experts there, a quarter on
  // the device), with predictive prefetch: the same prompt results.
  const offload::ExpertCatalog catalog = m.expert_catalog();
  auto created = offload::ExpertPool::create(
      catalog, {.name = "/moeline-cuda-test-" + std::to_string(::getpid()),
                .budget_bytes = catalog.total_expert_bytes() / 2});
  ASSERT_TRUE(created) << created.error().message;
  auto host_pool = std::move(*created);
  auto attached = offload::PoolClient::attach(host_pool->name(), catalog);
  ASSERT_TRUE(attached) << attached.error().message;
  auto client = std::move(*attached);
  auto pooled = model::CudaEngine::create(
      m, {.kv_blocks = 64, .expert_budget_fraction = 0.25, .host_experts = client.get()});
  ASSERT_TRUE(pooled) << pooled.error().message;
  const Generation from_pool =
      generate([&](auto batch, auto& logits) { return (*pooled)->forward(batch, logits).ok(); },
               (*pooled)->pool(), prompt, vocab, 16);
  EXPECT_EQ(from_pool.first_logits, budgets.front().first_logits);
  if (f32) {
    EXPECT_EQ(from_pool.tokens, want.tokens);
  }
  const model::CudaExpertStats stats = (*pooled)->expert_stats();
  EXPECT_GT(stats.misses, 0u);
  EXPECT_GT(stats.prefetched, 0u);
  EXPECT_LE(stats.prefetch_used, stats.prefetched);

  // Misses computed where the weights are, on the CPU, once a copy has been timed (forced here):
  // the same tokens; the prompt's logits too, since its misses are copied before any was timed.
  auto on_cpu = model::CudaEngine::create(m, {.kv_blocks = 64,
                                              .expert_budget_fraction = 0.25,
                                              .host_experts = client.get(),
                                              .cpu_threads = &threads,
                                              .cpu_preference = 1e9});
  ASSERT_TRUE(on_cpu) << on_cpu.error().message;
  const Generation mixed =
      generate([&](auto batch, auto& logits) { return (*on_cpu)->forward(batch, logits).ok(); },
               (*on_cpu)->pool(), prompt, vocab, 16);
  EXPECT_GT((*on_cpu)->expert_stats().computed_on_cpu, 0u);
  EXPECT_LE(relative_l2(mixed.last_logits, budgets.front().last_logits), f32 ? 1e-4 : 1e-2);
  if (f32) {
    EXPECT_EQ(mixed.tokens, want.tokens);
  }
}

// Every router event a forward pass sends, flattened.
struct RecordedRouting : model::RouterObserver {
  std::vector<int64_t> layers;
  std::vector<model::RoutedToken> tokens;
  std::vector<int32_t> chosen;
  std::vector<float> scores, weights;
  void on_router(const model::RouterEvent& event) override {
    layers.push_back(event.layer);
    const auto n = static_cast<int64_t>(event.tokens.size());
    tokens.insert(tokens.end(), event.tokens.begin(), event.tokens.end());
    chosen.insert(chosen.end(), event.chosen, event.chosen + n * event.top_k);
    weights.insert(weights.end(), event.weights, event.weights + n * event.top_k);
    scores.insert(scores.end(), event.scores, event.scores + n * event.experts);
  }
};

// What the stages do: a prompt's KV leaves one engine in KvCache's block format and enters
// another (prefill on one process, decode on the next; prefix reuse from the store), in both
// directions between the CPU and the device; and the router observers (expert usage, activation
// signatures) see on the device what they see on the CPU, decode graphs included.
TEST_P(CudaModel, HandsKvToAndFromTheCpuEngineAndReportsRouting) {
  REQUIRE_DEVICE();
  auto loaded = model::Model::load(models_dir() + "/" + GetParam());
  ASSERT_TRUE(loaded) << loaded.error().message;
  const model::Model& m = **loaded;
  const int64_t vocab = m.config().vocab_size;
  const bool f32 = m.dtype_summary() == "F32";
  // Whole blocks: the unused slots of a last, partial block hold whatever an earlier sequence
  // left there, which no reader sees but a byte comparison of exported blocks would.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 3 * model::kBlockTokens; ++i)
    prompt.push_back(static_cast<int32_t>((i * 31 + 5) % vocab));
  const auto blocks =
      static_cast<size_t>((prompt.size() + model::kBlockTokens - 1) / model::kBlockTokens);
  kernels::ThreadPool threads(2);
  offload::ResidentExpertProvider experts(m.experts());
  model::KvCache cache(m.config(), 64);
  model::Engine cpu(m, experts, threads, cache);
  auto created = model::CudaEngine::create(m, {.kv_blocks = 64});
  ASSERT_TRUE(created) << created.error().message;
  model::CudaEngine& gpu = **created;
  ASSERT_EQ(gpu.kv_block_bytes(), cpu.kv_block_bytes());
  RecordedRouting cpu_routing, gpu_routing;

  // Prefill on `from`, then decode `steps` greedy tokens on `to` from the exported KV.
  auto hand_over = [&](model::ForwardPass& from, model::ForwardPass& to, std::vector<uint8_t>& kv,
                       std::vector<float>& prompt_logits) {
    model::Sequence prefilled(1, 0, 0);
    model::SequenceInput input{&prefilled, prompt, true};
    EXPECT_TRUE(from.forward(std::span(&input, 1), prompt_logits).ok());
    kv.resize(blocks * from.kv_block_bytes());
    EXPECT_TRUE(from.export_kv(std::span(prefilled.block_table()).first(blocks), kv.data()).ok());
    prefilled.release(from.blocks());
    model::Sequence decoded(2, 0, 0);
    EXPECT_TRUE(decoded.reserve(to.blocks(), static_cast<int64_t>(prompt.size())));
    EXPECT_TRUE(to.import_kv(std::span(decoded.block_table()).first(blocks), kv.data()).ok());
    decoded.commit(prompt);
    std::vector<int32_t> tokens{model::argmax(prompt_logits.data(), vocab)};
    std::vector<float> logits;
    for (int step = 0; step < 8; ++step) {
      input = {&decoded, std::span(&tokens.back(), 1), true};
      EXPECT_TRUE(to.forward(std::span(&input, 1), logits).ok());
      tokens.push_back(model::argmax(logits.data(), vocab));
    }
    decoded.release(to.blocks());
    return tokens;
  };
  std::vector<uint8_t> cpu_kv, gpu_kv, cpu_kv_again, gpu_kv_again;
  std::vector<float> cpu_logits, gpu_logits, unused;
  cpu.set_router_observer(&cpu_routing);
  const std::vector<int32_t> cpu_only = hand_over(cpu, cpu, cpu_kv, cpu_logits);
  cpu.set_router_observer(nullptr);
  const std::vector<int32_t> cpu_to_gpu = hand_over(cpu, gpu, cpu_kv_again, unused);
  const std::vector<int32_t> gpu_to_cpu = hand_over(gpu, cpu, gpu_kv, gpu_logits);
  gpu.set_router_observer(&gpu_routing);
  const std::vector<int32_t> gpu_only = hand_over(gpu, gpu, gpu_kv_again, unused);
  gpu.set_router_observer(nullptr);
  EXPECT_EQ(cpu_kv, cpu_kv_again);  // the CPU is deterministic: same prompt, same bytes
  EXPECT_EQ(gpu_kv, gpu_kv_again);  // and so is the device, whatever blocks the KV landed in
  const auto as_floats = [](const std::vector<uint8_t>& bytes) {
    std::vector<float> floats(bytes.size() / sizeof(float));
    std::memcpy(floats.data(), bytes.data(), floats.size() * sizeof(float));
    return floats;
  };
  EXPECT_LE(relative_l2(as_floats(gpu_kv), as_floats(cpu_kv)), f32 ? 1e-5 : 1e-2);
  EXPECT_LE(relative_l2(gpu_logits, cpu_logits), f32 ? 1e-4 : 1e-2);
  if (f32) {
    EXPECT_EQ(cpu_to_gpu, cpu_only);
    EXPECT_EQ(gpu_to_cpu, cpu_only);
    EXPECT_EQ(gpu_only, cpu_only);
  }
  // A prefill and 8 decode steps on each engine alone (the device's from graphs after the first
  // step): the same events, tokens and positions; the same experts in F32.
  EXPECT_GT(gpu.graph_replays(), 0u);
  EXPECT_EQ(gpu_routing.layers, cpu_routing.layers);
  ASSERT_EQ(gpu_routing.tokens.size(), cpu_routing.tokens.size());
  for (size_t i = 0; i < cpu_routing.tokens.size(); ++i) {
    EXPECT_EQ(gpu_routing.tokens[i].sequence_id, cpu_routing.tokens[i].sequence_id) << i;
    EXPECT_EQ(gpu_routing.tokens[i].position, cpu_routing.tokens[i].position) << i;
  }
  ASSERT_EQ(gpu_routing.scores.size(), cpu_routing.scores.size());
  EXPECT_LE(relative_l2(gpu_routing.scores, cpu_routing.scores), f32 ? 1e-4 : 2e-2);
  EXPECT_LE(relative_l2(gpu_routing.weights, cpu_routing.weights), f32 ? 1e-4 : 2e-2);
  if (f32) {
    EXPECT_EQ(gpu_routing.chosen, cpu_routing.chosen);
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, CudaModel,
                         ::testing::Values("mixtral-f32", "qwen3-f32", "mixtral-bf16", "qwen3-bf16",
                                           "glm4-bf16", "deepseek2-f32", "deepseek3-f32",
                                           "deepseek3-bf16-fused"));

TEST(CudaEngine, RefusesABudgetThatIsNotOne) {
  REQUIRE_DEVICE();
  auto mixtral = model::Model::load(models_dir() + "/mixtral-f32");
  ASSERT_TRUE(mixtral);
  EXPECT_FALSE(model::CudaEngine::create(**mixtral, {.expert_budget_fraction = 0.0}));
  EXPECT_FALSE(model::CudaEngine::create(**mixtral, {.expert_budget_fraction = 1.5}));
}

}  // namespace
}  // namespace moeline

namespace {

// Whether this host should have a usable GPU, decided without the CUDA runtime (whose failure is
// what decides the skips): MOELINE_EXPECT_GPU=1 or 0 when set, else an NVIDIA device node.
bool gpu_expected(std::string* reason) {
  if (const char* setting = std::getenv("MOELINE_EXPECT_GPU")) {
    *reason = std::string("MOELINE_EXPECT_GPU=") + setting;
    return std::string_view(setting) == "1";
  }
  *reason = "/dev/nvidia0 exists";
  return std::filesystem::exists("/dev/nvidia0");
}

// CTest's SKIP_RETURN_CODE for this binary (tests/CMakeLists.txt).
constexpr int kSkipped = 77;

}  // namespace

// Exit status: 0 when every selected test ran and passed; 77 (reported by CTest as skipped) when
// tests skipped for want of a GPU on a host where none is expected; 1 when a test failed, when no
// test was selected, when a GPU is expected but CUDA cannot use it (a driver too old for the
// bundled runtime included), or when a GPU is usable but a test still skipped.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string why, expectation;
  const bool device = moeline::kernels::cuda::device_available(&why);
  const bool expected = gpu_expected(&expectation);
  if (!device && expected) {
    std::printf("moeline_cuda_tests: a GPU is expected here (%s) but CUDA cannot use one: %s\n",
                expectation.c_str(), why.c_str());
    return 1;
  }
  const int status = RUN_ALL_TESTS();
  if (status != 0) return status;
  const auto* unit = ::testing::UnitTest::GetInstance();
  if (unit->test_to_run_count() == 0) {
    std::printf("moeline_cuda_tests: no test matched the filter\n");
    return 1;
  }
  if (unit->skipped_test_count() > 0) {
    if (device) {
      std::printf("moeline_cuda_tests: a CUDA device is usable but %d tests skipped\n",
                  unit->skipped_test_count());
      return 1;
    }
    std::printf("moeline_cuda_tests: %d tests skipped: %s\n", unit->skipped_test_count(),
                why.c_str());
    return kSkipped;
  }
  return 0;
}
