// Portable scalar MXFP4 kernels: the fallback path, and the semantics the AVX2 and AVX-512 paths
// must match bit for bit (quantize, dequantize). Compiled with the default target flags only, so
// this TU runs on any x86-64 (or other) CPU.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace pdmesh_mxfp4 {
namespace {

// Magnitude a (in [0, 8)) -> E2M1 magnitude code 0..7, round to nearest even, saturating at 6.
// The E2M1 grid has step 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 8); on each piece the code is
// offset + round(a / step), and ties to an even integer are ties to an even code.
inline uint32_t e2m1_magnitude_rne(float a) {
  float t;
  uint32_t offset;
  if (a < 2.0f) {
    t = a * 2.0f;
    offset = 0;
  } else if (a < 4.0f) {
    t = a;
    offset = 2;
  } else {
    t = a * 0.5f;
    offset = 4;
  }
  uint32_t q = static_cast<uint32_t>(t);  // t >= 0: truncation is floor
  const float frac = t - static_cast<float>(q);
  q += (frac > 0.5f || (frac == 0.5f && (q & 1u))) ? 1u : 0u;
  const uint32_t code = q + offset;
  return code > 7u ? 7u : code;
}

void quantize_scalar(const float* w, int64_t nblocks, uint8_t* blocks, uint8_t* scales) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* src = w + b * kBlock;
    uint8_t* dst = blocks + b * kBlockBytes;
    // |x| bit patterns order like the values, with Inf and NaN above every finite value.
    uint32_t amax = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const uint32_t mag = f32_to_bits(src[i]) & 0x7FFFFFFFu;
      amax = mag > amax ? mag : amax;
    }
    const uint32_t exp = amax >> 23;  // floor(log2(amax)) + 127 for normal amax
    if (exp == 0xFFu) {  // Inf or NaN in the block: NaN scale, codes zero
      scales[b] = static_cast<uint8_t>(kNanScale);
      std::memset(dst, 0, kBlockBytes);
      continue;
    }
    // OCP: shared exponent floor(log2(amax)) - emax_elem (2), clamped to E8M0's minimum 2^-127.
    const uint32_t s = exp > 2u ? exp - 2u : 0u;
    scales[b] = static_cast<uint8_t>(s);
    const float inv_scale = bits_to_f32((254u - s) << 23);  // 2^(127 - s), always normal
    for (int64_t i = 0; i < kBlockBytes; ++i) {
      uint32_t nib[2];
      for (int h = 0; h < 2; ++h) {
        const uint32_t bits = f32_to_bits(src[2 * i + h]);
        const float a = bits_to_f32(bits & 0x7FFFFFFFu) * inv_scale;
        nib[h] = e2m1_magnitude_rne(a) | ((bits >> 28) & 8u);
      }
      dst[i] = static_cast<uint8_t>(nib[0] | (nib[1] << 4));
    }
  }
}

inline float e2m1_to_f32(uint32_t code) { return bits_to_f32(e2m1_to_f32_bits(code)); }

void dequantize_f32_scalar(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                           float* out, bool /*stream*/) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const float scale = bits_to_f32(e8m0_to_f32_bits(scales[b]));
    const uint8_t* src = blocks + b * kBlockBytes;
    float* dst = out + b * kBlock;
    for (int64_t i = 0; i < kBlockBytes; ++i) {
      dst[2 * i] = e2m1_to_f32(src[i] & 15u) * scale;
      dst[2 * i + 1] = e2m1_to_f32(src[i] >> 4) * scale;
    }
  }
}

// The fp32 products are exact (<= 2 significant bits), so bf16 is their top half, no rounding.
void dequantize_bf16_scalar(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                            uint16_t* out, bool /*stream*/) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const float scale = bits_to_f32(e8m0_to_f32_bits(scales[b]));
    const uint8_t* src = blocks + b * kBlockBytes;
    uint16_t* dst = out + b * kBlock;
    for (int64_t i = 0; i < kBlockBytes; ++i) {
      dst[2 * i] = static_cast<uint16_t>(f32_to_bits(e2m1_to_f32(src[i] & 15u) * scale) >> 16);
      dst[2 * i + 1] = static_cast<uint16_t>(f32_to_bits(e2m1_to_f32(src[i] >> 4) * scale) >> 16);
    }
  }
}

constexpr int kLanes = 8;  // independent partial sums per row, so the compiler can vectorise

// y[:, n0:n1] for fp32 x. x is in the per-block even/odd order (see LinearArgs), so the 16 low
// nibbles of a block pair with x[0:16] of that block and the 16 high nibbles with x[16:32].
void linear_f32_scalar(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.k / kBlock;
  std::vector<float> acc(static_cast<size_t>(a.m) * kLanes);
  float* y = static_cast<float*>(a.y);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < nb; ++j) {
      const float scale = bits_to_f32(e8m0_to_f32_bits(a.scales[n * nb + j]));
      const uint8_t* src = a.blocks + (n * nb + j) * kBlockBytes;
      float w[kBlock];
      for (int64_t i = 0; i < kBlockBytes; ++i) {
        w[i] = e2m1_to_f32(src[i] & 15u) * scale;
        w[i + kBlockBytes] = e2m1_to_f32(src[i] >> 4) * scale;
      }
      for (int64_t r = 0; r < a.m; ++r) {
        const float* xr = a.x + r * a.k + j * kBlock;
        float* p = acc.data() + r * kLanes;
        for (int64_t i = 0; i < kBlock; ++i) p[i % kLanes] += w[i] * xr[i];
      }
    }
    const float bias = a.bias ? a.bias[n] : 0.0f;
    for (int64_t r = 0; r < a.m; ++r) {
      const float* p = acc.data() + r * kLanes;
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += p[l];
      y[a.y_at(r, n)] = sum + bias;
    }
  }
}

// W4A8 (kernels.h: quantize_x_a8): per (row, column, block) the exact integer dot of q and
// twice the E2M1 values, times d_x * 2^(s - 128), summed in fp32 in block order.
void linear_a8_scalar(const LinearArgs& a, int64_t n0, int64_t n1) {
  constexpr int8_t kTwice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const float* half_scale = reinterpret_cast<const float*>(kHalfScaleTable.bits);
  const int64_t nb = a.k / kBlock;
  float* y = static_cast<float*>(a.y);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < a.m; ++r) {
      float sum = 0.0f;
      for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* bytes = a.blocks + (n * nb + j) * kBlockBytes;
        const int8_t* q = a.xq + r * a.k + j * kBlock;  // 16 even, then 16 odd elements
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlockBytes; ++i) {
          dot += kTwice[bytes[i] & 15u] * q[i] + kTwice[bytes[i] >> 4] * q[kBlockBytes + i];
        }
        sum += static_cast<float>(dot) * (half_scale[a.scales[n * nb + j]] * a.xd[r * nb + j]);
      }
      y[a.y_at(r, n)] = sum + (a.bias ? a.bias[n] : 0.0f);
    }
  }
}

const KernelTable kScalarTable = {
    quantize_scalar, dequantize_f32_scalar, dequantize_bf16_scalar, linear_f32_scalar, nullptr,
    nullptr, nullptr, linear_a8_scalar,
};

// kernels.h: quantize_x_a8. fp32 x: 1 / d and the product are single IEEE roundings, and
// round_half_even(v) for |v| <= 127.5 is (v + 1.5 * 2^23) - 1.5 * 2^23 under the default
// rounding mode (no libm call on baseline x86-64; no -ffast-math here folds it away).
template <typename Load>
void quantize_blocks_a8(int64_t nblocks, int8_t* q, float* d, Load load) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  for (int64_t b = 0; b < nblocks; ++b) {
    float v[kBlock];
    uint32_t amax = 0;  // |x| bit patterns order like the values; Inf and NaN above all others
    for (int64_t i = 0; i < kBlock; ++i) {
      v[i] = load(b * kBlock + i);
      const uint32_t mag = f32_to_bits(v[i]) & 0x7FFFFFFFu;
      amax = mag > amax ? mag : amax;
    }
    int8_t* out = q + b * kBlock;
    if (amax >= 0x7F800000u || amax == 0) {
      d[b] = amax == 0 ? 0.0f : bits_to_f32(0x7FC00000u);
      std::memset(out, 0, kBlock);
      continue;
    }
    d[b] = bits_to_f32(amax) / 127.0f;
    const float inv = 1.0f / d[b];
    for (int64_t i = 0; i < kBlock; ++i) {
      const float r = (v[i] * inv + kRound) - kRound;
      out[(i & 1) * (kBlock / 2) + i / 2] = static_cast<int8_t>(r);
    }
  }
}

}  // namespace

void quantize_x_a8(const float* x, int64_t nblocks, int8_t* q, float* d) {
  quantize_blocks_a8(nblocks, q, d, [x](int64_t i) { return x[i]; });
}

void quantize_x_a8_bf16(const uint16_t* x, int64_t nblocks, int8_t* q, float* d) {
  quantize_blocks_a8(nblocks, q, d,
                     [x](int64_t i) { return bits_to_f32(static_cast<uint32_t>(x[i]) << 16); });
}

const KernelTable& scalar_table() { return kScalarTable; }

// ---- The MSE encoder (kernels/mxfp4/encoder.py), bit for bit -------------------------------
// Per block: the OCP exponent and its neighbours kMseOffsets are tried in that order, and the
// first of least squared error wins. Everything is float64, as in the Python encoder: |v| / 2^e
// and each E2M1 value times 2^e are exact there, each difference is exact, and the squares are
// summed in element order 0..31, the order encoder.block_sq_error fixes, so both sides round
// every partial sum the same way and pick the same exponent even on near ties. Separate
// statements for the square and the add: no compiler may fuse them into an FMA (clang fuses
// only within one expression; GCC has no FMA to use in this TU's baseline x86-64 target).
namespace {

constexpr int kMseOffsets[3] = {0, 1, -1};
constexpr double kE2M1Magnitudes[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

// E2M1 magnitude code of a >= 0 (not NaN) in float64, round to nearest even, saturating: below
// 1, rint(2a) (0, 0.5, 1); from 1 up, E2M1 is a float with one mantissa bit and the code is
// 2 + 2 * exponent + mantissa, read off the float64 bits rounded to one mantissa bit (ties to
// even). No branch on the value: reference.e2m1_codes computes it the same way.
inline uint32_t e2m1_code_f64(double a) {
  uint64_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  const int64_t rounded =
      static_cast<int64_t>((bits + ((uint64_t{1} << 50) - 1) + ((bits >> 51) & 1)) >> 51);
  const int64_t high = std::min<int64_t>(rounded - (2 * 1023 - 2), 7);
  // rint(2a) for a < 1 by the 2^52 trick (no libm call on baseline x86-64); min keeps it bounded.
  const double twice = std::min(a, 1.0) * 2.0;
  const int64_t low = static_cast<int64_t>((twice + 0x1p52) - 0x1p52);
  return static_cast<uint32_t>(a < 1.0 ? low : high);
}

// floor(log2(amax)) - 2 clamped to [-127, 127] (amax finite, > 0), else -127: ocp_exponent.
inline int ocp_exponent_f64(double amax) {
  if (!(amax > 0.0)) return -127;
  int exp = 0;
  std::frexp(amax, &exp);  // amax = m * 2^exp, m in [0.5, 1)
  return std::clamp(exp - 1 - 2, -127, 127);
}

double block_sq_error(const double* mag, int e) {
  const double scale = std::ldexp(1.0, e), inv = std::ldexp(1.0, -e);
  double err = 0.0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const double d = kE2M1Magnitudes[e2m1_code_f64(mag[i] * inv)] * scale - mag[i];
    const double sq = d * d;
    err = err + sq;
  }
  return err;
}

}  // namespace

void quantize_mse_blocks(const float* w, int64_t nblocks, uint8_t* blocks, uint8_t* scales) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* src = w + b * kBlock;
    uint8_t* dst = blocks + b * kBlockBytes;
    double mag[kBlock];
    double amax = 0.0;
    bool finite = true;
    for (int64_t i = 0; i < kBlock; ++i) {
      mag[i] = std::fabs(static_cast<double>(src[i]));
      finite = finite && std::isfinite(mag[i]);
      amax = mag[i] > amax ? mag[i] : amax;
    }
    if (!finite) {  // as the OCP path: NaN scale, codes zero
      scales[b] = static_cast<uint8_t>(kNanScale);
      std::memset(dst, 0, kBlockBytes);
      continue;
    }
    const int ocp = ocp_exponent_f64(amax);
    int best = ocp;
    double best_err = 0.0;
    for (int j = 0; j < 3; ++j) {
      const int e = std::clamp(ocp + kMseOffsets[j], -127, 127);
      const double err = block_sq_error(mag, e);
      if (j == 0 || err < best_err) {
        best = e;
        best_err = err;
      }
    }
    scales[b] = static_cast<uint8_t>(best + 127);
    const double inv = std::ldexp(1.0, -best);
    for (int64_t i = 0; i < kBlockBytes; ++i) {
      uint32_t nib[2];
      for (int h = 0; h < 2; ++h) {
        const uint32_t sign = (f32_to_bits(src[2 * i + h]) >> 28) & 8u;
        nib[h] = e2m1_code_f64(mag[2 * i + h] * inv) | sign;
      }
      dst[i] = static_cast<uint8_t>(nib[0] | (nib[1] << 4));
    }
  }
}

}  // namespace pdmesh_mxfp4
