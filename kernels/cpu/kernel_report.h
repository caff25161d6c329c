#pragma once
// What the CPU kernels run on and how they are tuned, for `moeline run`'s log line and the compute
// stages' /healthz: the path in use and what the CPU supports (MOELINE_KERNELS may force a lower
// path, cpu_features.h), the CPU it was chosen on, the arithmetic for quantized and BF16 weights
// (quant_matmul.h, bf16_matmul.h), and the tuning constants of the kernels in use.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moeline::kernels {

// The revision of the kernels' arithmetic: raised by every change that alters a result's bits on
// some path (a sum's order, a rounding step). Stages of one stack must compute alike and a stored
// activation is reused only by the arithmetic that computed it, so it is part of the settings
// hash peers agree on and of every reuse key (stages/common: settings_hash, reuse_model_key).
// 2: RMS norm's sum of squares in eight chains (2026-12-06).
inline constexpr uint32_t kArithmeticRevision = 2;

struct KernelReport {
  std::string isa;         // the path in use: avx512_vnni, avx512, avx2 or portable
  std::string best_isa;    // the best path this CPU can run
  std::string forced;      // MOELINE_KERNELS as set, empty when it is not
  std::string cpu;         // the CPU's brand string (CPUID), e.g. "AMD EPYC 9R14 96-Core Processor"
  std::string quant_math;  // fast or exact
  std::string bf16_math;   // BF16 weights: exact, fast, or "exact (fast set; no AVX512_BF16)"
  uint32_t arithmetic_revision = kArithmeticRevision;
  // name, value: the prefetch distances, token tiles and batch thresholds of the path in use.
  std::vector<std::pair<std::string, int64_t>> tuning;
};

KernelReport kernel_report();

// Why MOELINE_KERNELS did not choose the path in use (a name that is no path, or a path this CPU
// cannot run), for a warning; empty when it is unset or chose the path in use.
std::string forced_path_problem(const KernelReport& report);

// The report as (key, value) fields of a structured log line, the tuning entries last.
std::vector<std::pair<std::string, std::string>> report_fields(const KernelReport& report);

}  // namespace moeline::kernels
