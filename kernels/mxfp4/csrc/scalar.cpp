// Portable scalar MXFP4 kernels: the fallback path, and the semantics the AVX2 and AVX-512 paths
// must match bit for bit (quantize, dequantize). Compiled with the default target flags only, so
// this TU runs on any x86-64 (or other) CPU.
#include <algorithm>
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
      y[r * a.n + n] = sum + bias;
    }
  }
}

const KernelTable kScalarTable = {
    quantize_scalar, dequantize_f32_scalar, dequantize_bf16_scalar, linear_f32_scalar, nullptr,
    nullptr, nullptr,
};

}  // namespace

const KernelTable& scalar_table() { return kScalarTable; }

}  // namespace pdmesh_mxfp4
