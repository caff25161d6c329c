#pragma once
// Which instruction-set path the kernels use. Detected once; `MOELINE_KERNELS` (avx512, avx2,
// portable) forces a path that the CPU supports, for tests that compare the paths.

#include <string_view>

namespace moeline::kernels {

enum class Isa { kPortable, kAvx2, kAvx512 };

Isa best_supported_isa();
Isa active_isa();
// Forces a path (tests); returns false when the CPU cannot run it.
bool set_active_isa(Isa isa);
std::string_view isa_name(Isa isa);

}  // namespace moeline::kernels
