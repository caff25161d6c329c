#pragma once
// Every environment variable the moeline executable reads by name, in one place. Besides these,
// each stage setting KEY can also be given as MOELINE_<KEY> (upper case, '-' as '_'), between the
// config file and the flags (stages/runtime/config.h). The scripts' own variables are documented
// where they are read (MOELINE_BENCH_* at the top of scripts/bench, MOELINE_EXPECT_GPU in
// tests/README.md). tests/boundaries checks that no library or tool calls getenv but through here.

namespace moeline::env {

struct Variable {
  const char* name;
  const char* meaning;
};

inline constexpr Variable kModel{
    "MOELINE_MODEL",
    "the model folder or GGUF file when --model is not given (run, stages, stack)"};
inline constexpr Variable kKernels{
    "MOELINE_KERNELS",
    "forces a CPU kernel path: portable, avx2, avx512 or avx512_vnni (when the CPU has it)"};
inline constexpr Variable kKernelTuning{
    "MOELINE_KERNEL_TUNING",
    "overrides how the CPU kernels stream weights: decode_streams=1|2,prefetch_bytes=0..8192,"
    "quant_prefetch_bytes=0..8192 (default: chosen from the CPU's vendor; the kernel report shows "
    "it)"};
inline constexpr Variable kEndpoint{"MOELINE_ENDPOINT",
                                    "the gateway's client endpoint for `moeline client`"};
inline constexpr Variable kApiKey{"MOELINE_API_KEY", "the API key `moeline client` presents"};
inline constexpr Variable kServerKey{
    "MOELINE_SERVER_KEY", "the gateway's public Curve key for `moeline client` (enables Curve)"};

inline constexpr Variable kTerm{
    "TERM", "TERM=dumb turns off the progress line drawn on a terminal (base/progress.h)"};

inline constexpr Variable kAll[] = {kModel,  kKernels,   kKernelTuning, kEndpoint,
                                    kApiKey, kServerKey, kTerm};

// The variable's value; nullptr when it is not set.
const char* get(const Variable& variable);
// The value of a stage setting's MOELINE_<KEY> (stages/runtime/config.h); nullptr when not set.
const char* get_setting(const char* variable_name);

}  // namespace moeline::env
