// AVX2 elementwise pieces of the fused decoder layer: RMSNorm, residual add, SiLU * mul, and
// RoPE + KV-cache write (attention is in attend_avx2.cpp). See layer.h for the contracts.
// Bit-identical to layer_avx512.cpp: the same fp32 operations in the same order on each element
// (avx2_util.h), and RMSNorm's sum of squares kept in 16 lanes (two 8-lane halves) and reduced
// in _mm512_reduce_add_ps's order.
#include <immintrin.h>

#include <cstring>

#include "layer.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_dense {

#include "avx2_util.h"

namespace {

// dst[0:D] = rotate-half RoPE of x[0:D] with cos = cs[0:D/2], sin = cs[D/2:D], bf16 per op.
inline void rotate(const uint16_t* x, const uint16_t* cs, int64_t d, uint16_t* dst) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const int64_t left = half - i;
    const __m256 x1 = load_bf16_8(x + i, left), x2 = load_bf16_8(x + half + i, left);
    const __m256 c = load_bf16_8(cs + i, left), sn = load_bf16_8(cs + half + i, left);
    const __m256 lo = _mm256_sub_ps(round_bf16(_mm256_mul_ps(x1, c)),
                                    round_bf16(_mm256_mul_ps(x2, sn)));
    const __m256 hi = _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, c)),
                                    round_bf16(_mm256_mul_ps(x1, sn)));
    store_bf16_8(dst + i, lo, left);
    store_bf16_8(dst + half + i, hi, left);
  }
}

// dst[0:D] = x[0:D] with its first R channels rotated (partial rotary when R < D).
inline void rotate_head(const uint16_t* x, const uint16_t* cs, int64_t r, int64_t d,
                        uint16_t* dst) {
  rotate(x, cs, r, dst);
  if (r < d) std::memcpy(dst + r, x + r, (d - r) * sizeof(uint16_t));
}

}  // namespace

void rms_norm_avx2(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* out,
                   int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* xr = x + t * n;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7, 8-15 of 16
    for (int64_t i = 0; i < n; i += 16) {
      const __m256 a = load_bf16_8(xr + i, n - i);
      const __m256 b = n - i > 8 ? load_bf16_8(xr + i + 8, n - i - 8) : _mm256_setzero_ps();
      lo = _mm256_fmadd_ps(a, a, lo);
      hi = _mm256_fmadd_ps(b, b, hi);
    }
    const float inv = 1.0f / __builtin_sqrtf(reduce16_add(lo, hi) / static_cast<float>(n) + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 8) {
      const int64_t left = n - i;
      const __m256 normed = round_bf16(_mm256_mul_ps(load_bf16_8(xr + i, left), iv));
      store_bf16_8(out + t * n + i, _mm256_mul_ps(normed, load_bf16_8(w + i, left)), left);
    }
  }
}

void add_inplace_avx2(uint16_t* h, const uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t left = n - i;
    store_bf16_8(h + i, _mm256_add_ps(load_bf16_8(h + i, left), load_bf16_8(y + i, left)), left);
  }
}

void silu_mul_avx2(const uint16_t* gu, int64_t inter, uint16_t* act, int64_t t0, int64_t t1) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* g = gu + t * 2 * inter;
    for (int64_t i = 0; i < inter; i += 8) {
      const int64_t left = inter - i;
      const __m256 gv = load_bf16_8(g + i, left);
      const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(
                                                               _mm256_setzero_ps(), gv))));
      store_bf16_8(act + t * inter + i,
                   _mm256_mul_ps(round_bf16(silu), load_bf16_8(g + inter + i, left)), left);
    }
  }
}

void rope_store_avx2(const uint16_t* qkv, const uint16_t* cos_sin, const StepArgs& s,
                     const CacheArgs& c, uint16_t* q_out, int64_t t0, int64_t t1) {
  const int64_t d = c.head_dim, r = c.rotary_dim, h = c.num_heads, kvh = c.num_kv_heads;
  const int64_t row = (h + 2 * kvh) * d;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t pos, slot;
    locate(s, t, &pos, &slot);
    const uint16_t* x = qkv + t * row;
    const uint16_t* cs = cos_sin + pos * r;
    for (int64_t n = 0; n < h; ++n) rotate_head(x + n * d, cs, r, d, q_out + (t * h + n) * d);
    for (int64_t n = 0; n < kvh; ++n) {
      rotate_head(x + (h + n) * d, cs, r, d, c.k + (slot * kvh + n) * d);
      std::memcpy(c.v + (slot * kvh + n) * d, x + (h + kvh + n) * d, d * sizeof(uint16_t));
    }
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
