#include "kernels/cpu/cpu_features.h"
#include "base/environment.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

namespace moeline::kernels {
namespace {

Isa detect() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512vnni") ? Isa::kAvx512Vnni : Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kPortable;
}

bool supports(Isa wanted) {
  return static_cast<int>(wanted) <= static_cast<int>(detect());
}

Isa initial_isa() {
  Isa isa = detect();
  if (const char* forced = env::get(env::kKernels)) {
    for (Isa candidate : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni}) {
      if (isa_name(candidate) == forced && supports(candidate)) isa = candidate;
    }
  }
  return isa;
}

std::atomic<Isa>& active() {
  static std::atomic<Isa> isa{initial_isa()};
  return isa;
}

}  // namespace

Isa best_supported_isa() {
  return detect();
}
Isa active_isa() {
  return active().load(std::memory_order_relaxed);
}

bool set_active_isa(Isa isa) {
  if (!supports(isa)) return false;
  active().store(isa);
  return true;
}

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Vnni:
      return "avx512_vnni";
  }
  return "?";
}

int64_t l1_data_cache_bytes() {
  static const int64_t bytes = [] {
    const long reported = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return reported >= 4096 ? static_cast<int64_t>(reported) : int64_t{48} << 10;
  }();
  return bytes;
}

}  // namespace moeline::kernels
