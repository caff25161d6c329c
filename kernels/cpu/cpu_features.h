#pragma once
// Which instruction-set path the kernels use. Detected once; `MOELINE_KERNELS` (avx512_vnni,
// avx512, avx2, portable) forces a path that the CPU supports, for tests that compare the paths.
// Each level includes the ones before it. avx512_vnni differs from avx512 only in the quantized
// kernels (vpdpbusd / vpdpwssd in place of maddubs-madd pairs), with identical results.

#include <cstdint>
#include <string_view>

namespace moeline::kernels {

enum class Isa { kPortable, kAvx2, kAvx512, kAvx512Vnni };

Isa best_supported_isa();
Isa active_isa();
// Forces a path (tests); returns false when the CPU cannot run it.
bool set_active_isa(Isa isa);
std::string_view isa_name(Isa isa);

// The core's L1 data cache in bytes (sysconf; 48 KiB where the system does not say), which sizes
// the prefill tiles (bf16_matmul_avx512.cpp).
int64_t l1_data_cache_bytes();

}  // namespace moeline::kernels
