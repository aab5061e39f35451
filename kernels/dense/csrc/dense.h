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

#include "native.h"

namespace pdmesh_dense {

constexpr int64_t kChunk = 32;  // bf16 weights per 512-bit vector: the K step of the kernels
constexpr int64_t kChunk2 = 16;  // bf16 weights per 256-bit vector: the AVX2 kernel's K step

// Code paths (the `path` argument of every op) and the helpers every native library shares.
// Path 0 (mxfp4's scalar path) has no dense counterpart: there, the reference is plain torch.
using pdmesh_native::bits_to_f32;
using pdmesh_native::cpu_features;
using pdmesh_native::CpuFeatures;
using pdmesh_native::f32_to_bf16_rne;
using pdmesh_native::f32_to_bits;
using pdmesh_native::kPathAvx2;
using pdmesh_native::kPathAvx512;
using pdmesh_native::kPathAvx512Bf16;

constexpr int64_t kGroup = 8;   // output columns per work item of the parallel split

// Columns [n0, n1) of a bandwidth-bound kernel as two interleaved streams: the i-th column
// visited is n0 + i / 2 for even i and mid + i / 2 for odd i (mid = the slice's middle). One
// weight row after another is one DRAM stream per core, and a core keeps too few misses in
// flight on one stream to reach the memory's bandwidth. Two streams half a slice apart: a
// 226 MB GEMV 24.8 -> 26.7 GB/s, and single-stream bf16 decode +5-20% in fresh-process A/B
// runs (AMD Zen 4, 2 threads; README, "the two-stream GEMV"). Adjacent rows interleaved in one
// tile are slower instead: the prefetchers then see many short streams (gemv_avx512.cpp). Each
// column is computed alone, so results do not change. Below kTwoStreamMinCols columns the
// halves are too short to pay for a second stream start, and the order is plain. An index
// map, not a loop taking a callable: the loop stays in the kernel's own target region, where
// its body inlines.
constexpr int64_t kTwoStreamMinCols = 64;
static inline int64_t stream_column(int64_t n0, int64_t n1, int64_t i) {
  if (n1 - n0 < kTwoStreamMinCols) return n0 + i;
  return (i % 2 == 0 ? n0 : n0 + (n1 - n0 + 1) / 2) + i / 2;
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

// nullptr when this CPU runs code path `path`, else why not (the ops raise with it).
const char* path_unavailable(int64_t path);
// AVX-512 kernels; call only when cpu_features() allows (the dpbf16 one needs .avx512_bf16
// too).
void gemv_fma_avx512(const GemvArgs& a, int64_t n0, int64_t n1);
void gemv_dpbf16_avx512(const GemvArgs& a, int64_t n0, int64_t n1);
// x [m, k] (xf fp32, or xb bf16 bits when xf is nullptr) -> out [m, kpad] fp32 in the FMA
// kernel's order: each 32-chunk as its 16 even then 16 odd elements, zeros past k.
void reorder_x_avx512(const float* xf, const uint16_t* xb, int64_t m, int64_t k, int64_t kpad,
                      float* out);
// AVX2 kernel (gemv_avx2.cpp); call only when cpu_features().avx2_tier(). Its x is reorder_x_avx2's
// layout: each 16-chunk as its 8 even then 8 odd elements, zeros past k, kpad = ceil(k/16)*16.
void gemv_fma_avx2(const GemvArgs& a, int64_t n0, int64_t n1);
void reorder_x_avx2(const float* xf, const uint16_t* xb, int64_t m, int64_t k, int64_t kpad,
                    float* out);

// The greedy head's screen (greedy_head.cpp). For head rows n in [n0, n1) and x rows r:
//   dot = q[n, :] . xq[r, :], summed exactly in int32 (q int8 [n, kpad], xq int16 [m, kpad],
//         both zero-padded to kpad, a multiple of kScreenChunk; the caller's x scale keeps
//         every partial sum inside int32), so every tier and split gives the same dots;
//   approx = dot * (scale[n] * xs[r]);  bound = a[n] * xnorm[r] + b[n] * xresid[r] + 1e-20;
//   best[r] = max(best[r], approx - bound) (running, in and out);
//   row n is kept when approx + bound >= cut(best[r]) at that point (cut: below), written to
//   cand[r * n_total + n0 + j] (upper[...] = approx + bound), j < count[r] (out).
// best only rises and cut is monotone, so a row dropped here fails the final, global cut too.
constexpr int64_t kScreenChunk = 32;
struct ScreenArgs {
  const int8_t* q;     // [n, kpad]
  const int16_t* xq;   // [m, kpad]
  const float* scale;  // [n] per head row: s
  const float* a;      // [n] bound per unit |x|
  const float* b;      // [n] bound per unit |x - xs xq|
  const float* xs;     // [m] x scales
  const float* xnorm;  // [m] |x|, rounded up
  const float* xresid; // [m] |x - xs xq|, rounded up
  int32_t* cand;       // [m, n] candidate columns (each call writes its own [n0, n1) part)
  float* upper;        // [m, n] their approx + bound
  int64_t m, n, kpad;
};
// The candidate cut for a best lower bound: within 1/32 (several bf16 ulps, see greedy_head.cpp).
static inline float screen_cut(float best) {
  return best - (best < 0 ? -best : best) * (1.0f / 32) - 1e-20f;
}
// The scalar end of a screened (x row, head row) pair, shared by both tiers: approx, bound,
// the running best, and the survivor list (see above).
static inline void screen_keep(const ScreenArgs& a, int64_t x, int64_t n, int64_t n0,
                               int32_t dot, float* best, int64_t* count) {
  const float approx = static_cast<float>(dot) * (a.scale[n] * a.xs[x]);
  const float bound = a.a[n] * a.xnorm[x] + a.b[n] * a.xresid[x] + 1e-20f;
  const float lo = approx - bound, up = approx + bound;
  if (lo > best[x]) best[x] = lo;
  if (up >= screen_cut(best[x])) {
    const int64_t slot = x * a.n + n0 + count[x]++;
    a.cand[slot] = static_cast<int32_t>(n);
    a.upper[slot] = up;
  }
}
// Call only when cpu_features() allows the tier; best and count are [m].
void screen_avx512(const ScreenArgs& a, int64_t n0, int64_t n1, float* best, int64_t* count);
void screen_avx2(const ScreenArgs& a, int64_t n0, int64_t n1, float* best, int64_t* count);

}  // namespace pdmesh_dense
