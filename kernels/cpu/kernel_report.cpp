#include "kernels/cpu/kernel_report.h"

#include <cpuid.h>

#include <cstring>

#include "base/environment.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quant_matmul.h"

namespace moeline::kernels {
namespace {

std::string cpu_brand() {
  unsigned int max_leaf = __get_cpuid_max(0x80000000u, nullptr);
  if (max_leaf < 0x80000004u) return "unknown";
  char brand[49] = {};
  for (unsigned int i = 0; i < 3; ++i) {
    unsigned int regs[4];
    __get_cpuid(0x80000002u + i, &regs[0], &regs[1], &regs[2], &regs[3]);
    std::memcpy(brand + 16 * i, regs, sizeof regs);
  }
  std::string text(brand);
  const size_t first = text.find_first_not_of(' ');
  const size_t last = text.find_last_not_of(' ');
  return first == std::string::npos ? "unknown" : text.substr(first, last - first + 1);
}

}  // namespace

KernelReport kernel_report() {
  KernelReport report;
  const Isa isa = active_isa();
  report.isa = std::string(isa_name(isa));
  report.best_isa = std::string(isa_name(best_supported_isa()));
  if (const char* forced = env::get(env::kKernels)) report.forced = forced;
  report.cpu = cpu_brand();
  report.quant_math = quant_math() == QuantMath::kFast ? "fast" : "exact";
  if (bf16_math() == Bf16Math::kExact)
    report.bf16_math = "exact";
  else if (bf16_fast_in_use())
    report.bf16_math = "fast";
  else
    report.bf16_math = cpu_has_bf16_dot_product()
                           ? "exact (fast set; the avx512 path is not in use)"
                           : "exact (fast set; no AVX512_BF16)";
  const StreamTuning streams = stream_tuning();
  report.tuning = {{"wide_prefetch_bytes", streams.prefetch_bytes},
                   {"decode_streams", streams.decode_streams}};
  if (isa != Isa::kPortable)
    report.tuning.emplace_back("quant_prefetch_bytes", streams.quant_prefetch_bytes);
  report.tuning.emplace_back("kv_prefetch_bytes", detail::kKvPrefetchBytes);
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni)
    report.tuning.emplace_back("q4_k_batch_from_tokens", detail::kQ4KBatchFromTokens);
  if (isa == Isa::kAvx2) report.tuning.emplace_back("packed_k_block", detail::kAvx2PackedKBlock);
  // What sizes the BF16 fast mode's prefill tiles (bf16_matmul_avx512.cpp).
  if (bf16_fast_in_use()) report.tuning.emplace_back("l1_data_bytes", l1_data_cache_bytes());
  return report;
}

std::string forced_path_problem(const KernelReport& report) {
  if (report.forced.empty() || report.forced == report.isa) return {};
  bool known = false;
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni})
    known = known || isa_name(isa) == report.forced;
  if (!known)
    return "MOELINE_KERNELS=" + report.forced +
           " names no kernel path (avx512_vnni, avx512, avx2, portable); using " + report.isa;
  return "MOELINE_KERNELS=" + report.forced + " is a path this CPU cannot run (its best is " +
         report.best_isa + "); using " + report.isa;
}

std::vector<std::pair<std::string, std::string>> report_fields(const KernelReport& report) {
  std::vector<std::pair<std::string, std::string>> fields = {{"isa", report.isa},
                                                             {"best_isa", report.best_isa}};
  if (!report.forced.empty()) fields.emplace_back("forced", report.forced);
  fields.emplace_back("cpu", report.cpu);
  fields.emplace_back("quant_math", report.quant_math);
  fields.emplace_back("bf16_math", report.bf16_math);
  fields.emplace_back("arithmetic_revision", std::to_string(report.arithmetic_revision));
  for (const auto& [name, value] : report.tuning) fields.emplace_back(name, std::to_string(value));
  return fields;
}

}  // namespace moeline::kernels
