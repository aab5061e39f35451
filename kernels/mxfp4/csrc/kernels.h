// MXFP4 CPU kernels: the plain-C++ interface shared by the binding TU (ops.cpp) and the kernel
// TUs (scalar.cpp; avx2*.cpp; avx512*.cpp). Nothing here includes torch, so the kernel TUs
// compile in about a second; only ops.cpp pays for the ATen headers.
//
// Format (OCP MX v1.0, as gpt-oss checkpoints): blocks of 32 FP4 E2M1 elements share one E8M0
// scale 2^(s-127) (s == 255 is NaN). Byte i of a block's 16 packed bytes holds element 2i in its
// low nibble and element 2i+1 in its high nibble.
//
// Every helper in this header is `static inline`: avx2*.cpp and avx512*.cpp compile their code
// for AVX2 / AVX-512, and a helper with external (COMDAT) linkage could be merged by the linker
// into the scalar TU's copy, which would then execute AVX2 / AVX-512 code on a CPU without it.
#pragma once

#include <cstdint>
#include <cstring>

#include "native.h"

namespace pdmesh_mxfp4 {

constexpr int64_t kBlock = 32;       // elements per block
constexpr int64_t kBlockBytes = 16;  // packed bytes per block
constexpr uint32_t kNanScale = 255;  // E8M0 NaN
constexpr uint32_t kHalfBits = 0x3F000000u;  // fp32 0.5: the exponent bias for E2M1 -> fp32
constexpr uint32_t kMantBit = 0x00400000u;   // E2M1 mantissa bit, placed at fp32 bit 22

// E2M1 code (bit 3 sign, bits 2..1 exponent, bit 0 mantissa) -> fp32 bits, by bit manipulation.
// Normal codes: placing the 3 magnitude bits at fp32 bits 24..22 and adding 0x3F000000 rebiases
// the exponent (E2M1 bias 1 -> fp32 bias 127). Two traps: code 0 must stay +0.0 (hence the
// non-zero mask on the add), and the subnormal code 1 (0.5) would come out as 0.75, so its
// mantissa bit is taken back out.
static constexpr inline uint32_t e2m1_to_f32_bits(uint32_t code) {
  const uint32_t mag = code & 7u;
  const uint32_t nonzero = 0u - static_cast<uint32_t>(mag != 0);  // all ones unless +-0
  uint32_t bits = ((mag << 22) + kHalfBits) & nonzero;
  bits -= static_cast<uint32_t>(mag == 1) * kMantBit;
  return bits | ((code & 8u) << 28);
}

// E8M0 scale byte -> fp32 bits of 2^(s-127). s == 0 is the fp32 subnormal 2^-127 (0x00400000);
// s == 255 gets the same bit ORed onto its all-ones exponent, which makes it a quiet NaN.
static constexpr inline uint32_t e8m0_to_f32_bits(uint32_t s) {
  return (s << 23) | ((s == 0 || s == kNanScale) ? kMantBit : 0u);
}

// e8m0_to_f32_bits for every byte, computed at compile time: one load per block in the kernels.
struct ScaleTable {
  uint32_t bits[256];
};
static constexpr ScaleTable make_scale_table() {
  ScaleTable t{};
  for (uint32_t s = 0; s < 256; ++s) t.bits[s] = e8m0_to_f32_bits(s);
  return t;
}
static constexpr ScaleTable kScaleTable = make_scale_table();

// fp32 bits of 2^(s-128), half the scale, for the int8-activation kernels, whose weight table holds
// twice each E2M1 value (integers). s == 0 and 1 are the fp32 subnormals 2^-128 and 2^-127; s ==
// 255 is a quiet NaN, as in kScaleTable.
static constexpr inline uint32_t e8m0_half_to_f32_bits(uint32_t s) {
  if (s == kNanScale) return 0x7FC00000u;
  return s >= 2 ? (s - 1) << 23 : kMantBit >> (1 - s);
}
static constexpr ScaleTable make_half_scale_table() {
  ScaleTable t{};
  for (uint32_t s = 0; s < 256; ++s) t.bits[s] = e8m0_half_to_f32_bits(s);
  return t;
}
static constexpr ScaleTable kHalfScaleTable = make_half_scale_table();

// The 16 unscaled E2M1 values as bf16 bit patterns (exact: at most 2 significant bits), in code
// order and repeated once: vpermw reads 5 index bits, so a code with junk in bit 4 still finds
// its value. Built by the bit-manipulation converter above.
struct Bf16Table {
  alignas(64) uint16_t bits[32];
};
static constexpr Bf16Table make_bf16_table() {
  Bf16Table t{};
  for (uint32_t c = 0; c < 32; ++c) t.bits[c] = static_cast<uint16_t>(e2m1_to_f32_bits(c & 15u) >> 16);
  return t;
}
static constexpr Bf16Table kBf16Table = make_bf16_table();

using pdmesh_native::bits_to_f32;
using pdmesh_native::cpu_features;
using pdmesh_native::CpuFeatures;
using pdmesh_native::f32_to_bf16_rne;
using pdmesh_native::f32_to_bits;

// Arguments of the fused y[m, n] = x[m, k] @ W[n, k].T (+ bias). Kernels are called on a range
// of output columns [n0, n1) and write y[:, n0:n1] for all m rows.
struct LinearArgs {
  // [m, k] fp32, each 32-block permuted into the table's x_order (16 even then 16 odd elements
  // unless the table names another order).
  const float* x;
  const uint16_t* x_bf16; // [m, k] bf16 in natural order (only for linear_bf16)
  const uint16_t* x_pairs;  // [m, pairs(k) * 64] bf16 in pair layout (linear_bf16; see below)
  // Int8 activations (linear_a8): xq [m, k] in quantize_x_a8's layout, xd [m, k/32] their scales.
  const int8_t* xq;
  const float* xd;
  const uint8_t* blocks;  // [n, k/32, 16]
  const uint8_t* scales;  // [n, k/32]
  const float* bias;      // [n] or nullptr
  void* y;                // [m, n] fp32 (linear_f32) or bf16 (linear_bf16); see y_at
  int64_t m, k, n;
  // y's row stride and the column its first element holds: 0 and 0 mean ldy = n, y0 = 0 (the
  // whole [m, n] output); a caller writing one column slice [y0, ...) sets both.
  int64_t ldy = 0, y0 = 0;

  // Offset in y of output (r, c).
  int64_t y_at(int64_t r, int64_t c) const { return r * (ldy ? ldy : n) + c - y0; }
};

// The pair layout of bf16 x for linear_bf16: per row, for each pair of 32-blocks (j, j+1), the
// 16 even elements of block j then the 16 even elements of block j+1 (32 values), then their
// odd elements likewise. With odd k/32 the last pair's second block is zeros.
static inline int64_t x_pairs(int64_t k) { return (k / kBlock + 1) / 2; }

// One code path. Ranges are in blocks (quantize, dequantize) or output columns (linear).
struct KernelTable {
  void (*quantize)(const float* w, int64_t nblocks, uint8_t* blocks, uint8_t* scales);
  // stream: non-temporal stores are allowed (out is 64-byte aligned and too big for the caches).
  void (*dequantize_f32)(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                         float* out, bool stream);
  void (*dequantize_bf16)(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                          uint16_t* out, bool stream);
  void (*linear_f32)(const LinearArgs& a, int64_t n0, int64_t n1);
  void (*linear_bf16)(const LinearArgs& a, int64_t n0, int64_t n1);  // nullptr: unsupported
  // x [m, k] bf16 -> out [m, x_pairs(k) * 64] in pair layout; set iff linear_bf16 is.
  void (*pair_x_bf16)(const uint16_t* x, int64_t m, int64_t k, uint16_t* out);
  // The order linear_f32 reads each 32-block of x in: position i holds element x_order[i].
  // nullptr: 16 even then 16 odd elements (the order of a block's low, then high nibbles).
  const uint8_t* x_order;
  // W4A8: y = x @ W.T with x quantised by quantize_x_a8 (LinearArgs::xq, xd), fp32 y.
  void (*linear_a8)(const LinearArgs& a, int64_t n0, int64_t n1);
};

// Int8 activations, the same bits on every path (kernels/mxfp4/reference.py quantize_x_a8 is the
// oracle): per 32-block of x, d = amax / 127 and q = round_half_even(x * (1 / d)) in fp32, so
// |q| <= 127; an all-zero block gets d = 0 and q = 0, a block holding Inf or NaN d = NaN and
// q = 0 (every output that reads it is NaN, as in the fp32 kernels). q is stored per block as its
// 16 even then 16 odd elements: the order of the low, then high nibbles of the packed bytes.
// x fp32 [nblocks * 32] (or bf16) -> q int8 [nblocks * 32], d fp32 [nblocks].
void quantize_x_a8(const float* x, int64_t nblocks, int8_t* q, float* d);
void quantize_x_a8_bf16(const uint16_t* x, int64_t nblocks, int8_t* q, float* d);

const KernelTable& scalar_table();

// The MSE encoder (kernels/mxfp4/encoder.py's quantize_mse, bit for bit), portable code for
// every path: nblocks blocks of 32 fp32 values -> packed codes and scale bytes.
void quantize_mse_blocks(const float* w, int64_t nblocks, uint8_t* blocks, uint8_t* scales);

#ifndef PDMESH_MXFP4_SCALAR_ONLY
// The AVX2 table (path 2), or nullptr when the CPU lacks avx2/fma/f16c.
const KernelTable* avx2_table();
// The AVX-512 table without vdpbf16ps (path 1), or nullptr when the CPU lacks avx512f/bw/vl/dq.
const KernelTable* avx512_table();
// The AVX-512 table whose bf16-x linear uses vdpbf16ps (path 3), or nullptr without
// avx512_bf16.
const KernelTable* avx512_bf16_table();
// Fused kernels of avx2_linear.cpp and avx2_a8.cpp; call only through avx2_table() (or the
// AVX-512 tables, whose CPUs run AVX2 code as well).
void linear_f32_avx2(const LinearArgs& a, int64_t n0, int64_t n1);
void linear_a8_avx2(const LinearArgs& a, int64_t n0, int64_t n1);
// quantize_x_a8 and its bf16 twin in AVX2 (avx2_a8.cpp), the same bits.
void quantize_x_a8_avx2(const float* x, int64_t nblocks, int8_t* q, float* d);
void quantize_x_a8_bf16_avx2(const uint16_t* x, int64_t nblocks, int8_t* q, float* d);
// Fused kernels of avx512_linear.cpp; call only through avx512_table() / avx512_bf16_table().
void linear_f32_avx512(const LinearArgs& a, int64_t n0, int64_t n1);
void linear_bf16_avx512(const LinearArgs& a, int64_t n0, int64_t n1);
void pair_x_bf16_avx512(const uint16_t* x, int64_t m, int64_t k, uint16_t* out);
#endif

}  // namespace pdmesh_mxfp4
