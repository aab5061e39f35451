// What the CPU can run, asked once. Plain baseline code (no target pragma), compiled into both
// variants: __builtin_cpu_supports reads libgcc's cpuid results, which also record whether the
// OS saves the ymm / zmm register state.
#include "kernels.h"

namespace pdmesh_mxfp4 {
namespace {

CpuFeatures detect() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return {__builtin_cpu_supports("avx2") != 0, __builtin_cpu_supports("fma") != 0,
          __builtin_cpu_supports("f16c") != 0, avx512,
          avx512 && __builtin_cpu_supports("avx512bf16")};
#else
  return {false, false, false, false, false};
#endif
}

}  // namespace

CpuFeatures cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace pdmesh_mxfp4
