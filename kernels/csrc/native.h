// What every native library of kernels/ (dense, mxfp4) shares: the code-path ids their ops take,
// the scalar bf16 conversions, and the CPU detection behind their features() op, whose bits
// kernels/_native.py reads (`Library`). Plain baseline C++: include it before any
// `#pragma GCC target` region.
//
// Every function here is `static inline`: the kernel TUs compile their code for AVX-512 or AVX2,
// and a helper with external (COMDAT) linkage could be merged by the linker into a copy built for
// another target, which would then execute AVX-512/AVX2 code on a CPU without it.
#pragma once

#include <cstdint>
#include <cstring>

namespace pdmesh_native {

// Code paths (the `path` argument of the ops), one per kernels/tier.py rung; the Backend enums of
// kernels/dense/backend.py and kernels/mxfp4/backend.py carry the same numbers.
constexpr int64_t kPathScalar = 0;      // plain C++ (mxfp4 only; dense's reference is torch)
constexpr int64_t kPathAvx512 = 1;      // AVX-512 F/BW/VL/DQ, fp32 FMA, never vdpbf16ps
constexpr int64_t kPathAvx2 = 2;        // AVX2 + FMA + F16C, fp32 FMA
constexpr int64_t kPathAvx512Bf16 = 3;  // as kPathAvx512, but vdpbf16ps for bf16 x
// ORed onto an MXFP4 path id: the fused linear quantises x to int8 per 32-block first (W4A8,
// kernels/mxfp4/csrc/kernels.h quantize_x_a8) and multiplies integers. Only the linear ops
// (pdmesh_mxfp4::linear, column_kernel) take it; it travels through kernels.dense's fused layer
// as part of the MXFP4 path id.
constexpr int64_t kActInt8 = 16;

// features() bits: which tiers' code the library contains, and what this CPU reports.
constexpr int64_t kHasAvx512Code = 1;
constexpr int64_t kCpuAvx512 = 2;  // avx512f/bw/vl/dq
constexpr int64_t kCpuBf16 = 4;    // avx512_bf16
constexpr int64_t kHasAvx2Code = 8;
constexpr int64_t kCpuAvx2 = 16;
constexpr int64_t kCpuFma = 32;
constexpr int64_t kCpuF16c = 64;

// What this CPU reports. __builtin_cpu_supports reads libgcc's cpuid results, which also record
// whether the OS saves the ymm / zmm register state. All false off x86.
struct CpuFeatures {
  bool avx2, fma, f16c;  // the AVX2 tier needs all three
  bool avx512;           // avx512f/bw/vl/dq
  bool avx512_bf16;      // avx512_bf16 (vdpbf16ps), on top of avx512
  bool amx_bf16;         // AMX tiles with bf16 (torch's own kernels use them: layer_ops.cpp)

  bool avx2_tier() const { return avx2 && fma && f16c; }
};

static inline CpuFeatures detect_cpu_features() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return {__builtin_cpu_supports("avx2") != 0, __builtin_cpu_supports("fma") != 0,
          __builtin_cpu_supports("f16c") != 0, avx512,
          avx512 && __builtin_cpu_supports("avx512bf16"),
          __builtin_cpu_supports("amx-bf16") != 0};
#else
  return {false, false, false, false, false, false};
#endif
}

// Detected once per translation unit that asks (the answer never changes).
static inline const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect_cpu_features();
  return features;
}

// The features() op's answer for a library that contains the given tiers' code.
static inline int64_t feature_bits(bool has_avx2_code, bool has_avx512_code) {
  const CpuFeatures& c = cpu_features();
  return (has_avx512_code ? kHasAvx512Code : 0) | (c.avx512 ? kCpuAvx512 : 0) |
         (c.avx512_bf16 ? kCpuBf16 : 0) | (has_avx2_code ? kHasAvx2Code : 0) |
         (c.avx2 ? kCpuAvx2 : 0) | (c.fma ? kCpuFma : 0) | (c.f16c ? kCpuF16c : 0);
}

static inline float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint32_t f32_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// fp32 -> bf16, round to nearest even; NaN stays a quiet NaN (as c10::BFloat16 does).
static inline uint16_t f32_to_bf16_rne(float f) {
  const uint32_t bits = f32_to_bits(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// An MXFP4 projection over a slice of output columns, as plain functions: what the dense
// library's decode team (one parallel region per step) calls on each thread for an MXFP4
// weight, where the torch op pdmesh_mxfp4::linear would open a parallel region of its own per
// projection. The MXFP4 library's op column_kernel(path) returns the address of the one
// instance for that code path (it lives as long as the library). Each output column is summed
// in one fixed order whatever the slice, so any split of the columns gives the bits the op does.
struct Mxfp4Columns {
  // Bytes of per-thread scratch that prepare() fills for x [m, k] (k a multiple of 32).
  int64_t (*x_scratch_bytes)(int64_t m, int64_t k);
  // x bf16 [m, k] -> x_scratch, in the layout run() reads.
  void (*prepare)(const uint16_t* x, int64_t m, int64_t k, void* x_scratch);
  // y bf16 [m, n] (row stride n), columns [n0, n1) = x @ W.T (+ bias), rounded once to bf16.
  // W is blocks uint8 [n, k/32, 16] and scales uint8 [n, k/32]; bias fp32 [n] or nullptr.
  // y_scratch: m * (n1 - n0) floats (tiers without a bf16 kernel sum in fp32 there first).
  void (*run)(const uint16_t* x, const void* x_scratch, const uint8_t* blocks,
              const uint8_t* scales, const float* bias, int64_t m, int64_t k, int64_t n,
              int64_t n0, int64_t n1, uint16_t* y, float* y_scratch);
};

}  // namespace pdmesh_native
