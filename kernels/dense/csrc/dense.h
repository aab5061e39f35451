// Dense bf16-weight GEMV/GEMM for decode: the plain-C++ interface shared by the binding TU
// (ops.cpp) and the kernel TUs (gemv_avx512.cpp, gemv_avx2.cpp). Nothing here includes torch,
// so a kernel TU compiles in about a second; only ops.cpp pays for the ATen headers.
//
// Every helper in this header is `static inline`: the kernel TUs compile their code for
// AVX-512 or AVX2, and a helper with external (COMDAT) linkage could be merged by the linker
// into a baseline TU's copy, which would then execute AVX-512/AVX2 code on a CPU without it.
#pragma once

#include <cstdint>
#include <cstring>

namespace pdmesh_dense {

constexpr int64_t kChunk = 32;  // bf16 weights per 512-bit vector: the K step of the kernels
constexpr int64_t kChunk2 = 16;  // bf16 weights per 256-bit vector: the AVX2 kernel's K step

// Code paths (the `path` argument of every op), one per tier of kernels/tier.py; the ids are
// those of kernels.mxfp4's ops, so one number names a tier in both libraries. 0 (mxfp4's
// scalar path) has no dense counterpart: there, the reference is plain torch.
constexpr int64_t kPathAvx512 = 1;      // AVX-512 F/BW/VL/DQ, fp32 FMA for any x
constexpr int64_t kPathAvx2 = 2;        // AVX2 + FMA + F16C, fp32 FMA for any x
constexpr int64_t kPathAvx512Bf16 = 3;  // as kPathAvx512, but vdpbf16ps for bf16 x
constexpr int64_t kGroup = 8;   // output columns per work item of the parallel split

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

// y[m, n] = x[m, k] @ W[n, k].T (+ bias), W bf16 row-major with row stride ldw (>= k).
// Kernels are called on a range of output columns [n0, n1) and write y[:, n0:n1] for all m.
struct GemvArgs {
  const uint16_t* w;      // [n, ldw] bf16 bits
  const float* x;         // FMA kernels: [m, kpad] fp32, each chunk (32 elements for AVX-512,
                          // 16 for AVX2) as its even then its odd elements, zero-padded to
                          // kpad = a multiple of the chunk
  const uint16_t* x_bf16; // dpbf16 kernel: [m, k] bf16 bits, natural order
  const void* bias;       // [n] fp32, or bf16 when bias_bf16; nullptr: no bias
  bool bias_bf16;
  void* y;                // [m, n] fp32, or bf16 when y_bf16
  bool y_bf16;
  int64_t m, k, n, ldw, kpad;
};

using GemvKernel = void (*)(const GemvArgs& a, int64_t n0, int64_t n1);

struct CpuSupport {
  bool avx2;    // avx2, fma and f16c present (and enabled by the OS): the AVX2 kernels run
  bool avx512;  // avx512f/bw/vl/dq present (and enabled by the OS)
  bool bf16;    // avx512_bf16 present: the dpbf16 kernel can run
};

const CpuSupport& cpu_support();  // detected once (ops.cpp)
// nullptr when this CPU runs code path `path`, else why not (the ops raise with it).
const char* path_unavailable(int64_t path);
// AVX-512 kernels; call only when cpu_support() allows (the dpbf16 one needs .bf16 too).
void gemv_fma_avx512(const GemvArgs& a, int64_t n0, int64_t n1);
void gemv_dpbf16_avx512(const GemvArgs& a, int64_t n0, int64_t n1);
// x [m, k] (xf fp32, or xb bf16 bits when xf is nullptr) -> out [m, kpad] fp32 in the FMA
// kernel's order: each 32-chunk as its 16 even then 16 odd elements, zeros past k.
void reorder_x_avx512(const float* xf, const uint16_t* xb, int64_t m, int64_t k, int64_t kpad,
                      float* out);
// AVX2 kernel (gemv_avx2.cpp); call only when cpu_support().avx2. Its x is reorder_x_avx2's
// layout: each 16-chunk as its 8 even then 8 odd elements, zeros past k, kpad = ceil(k/16)*16.
void gemv_fma_avx2(const GemvArgs& a, int64_t n0, int64_t n1);
void reorder_x_avx2(const float* xf, const uint16_t* xb, int64_t m, int64_t k, int64_t kpad,
                    float* out);

}  // namespace pdmesh_dense
