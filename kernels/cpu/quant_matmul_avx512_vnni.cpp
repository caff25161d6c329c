// The AVX-512 quantized kernels compiled a second time with AVX512_VNNI (CMakeLists.txt gives this
// file -mavx512vnni): vpdpbusd and vpdpwssd replace the maddubs-madd and madd-add pairs, which is
// exact integer arithmetic either way, so both builds give identical results. A separate
// translation unit keeps VNNI instructions out of the code that runs on AVX-512 CPUs without it
// (Skylake-X); cpu_features selects this build only where the CPU has VNNI.
#define MOELINE_QUANT_AVX512_ENTRY quant_matmul_rows_avx512_vnni
#define MOELINE_QUANT_AVX512_TWO_STREAMS_ENTRY quant_matmul_rows_two_streams_avx512_vnni
#include "quant_matmul_avx512.cpp"  // NOLINT(bugprone-suspicious-include)
