// AVX-512 elementwise pieces of the fused decoder layer: RMSNorm, residual add, SiLU * mul, and
// RoPE + KV-cache write (attention is in attend_avx512.cpp).
// See layer.h for the contracts. bf16 <-> fp32 conversions use integer ops (round to nearest
// even, NaN kept quiet), so only avx512f/bw/vl/dq are needed, not avx512_bf16.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layer.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

namespace pdmesh_dense {

#include "avx512_util.h"

namespace {

// dst[0:D] = rotate-half RoPE of x[0:D] with cos = cs[0:D/2], sin = cs[D/2:D], bf16 per op.
inline void rotate(const uint16_t* x, const uint16_t* cs, int64_t d, uint16_t* dst) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = mask16(half - i);
    const __m512 x1 = load_bf16(x + i, m), x2 = load_bf16(x + half + i, m);
    const __m512 c = load_bf16(cs + i, m), sn = load_bf16(cs + half + i, m);
    const __m512 lo = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c)),
                                    round_bf16(_mm512_mul_ps(x2, sn)));
    const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)),
                                    round_bf16(_mm512_mul_ps(x1, sn)));
    store_bf16(dst + i, lo, m);
    store_bf16(dst + half + i, hi, m);
  }
}

// dst[0:D] = x[0:D] with its first R channels rotated (partial rotary when R < D).
inline void rotate_head(const uint16_t* x, const uint16_t* cs, int64_t r, int64_t d,
                        uint16_t* dst) {
  rotate(x, cs, r, dst);
  if (r < d) std::memcpy(dst + r, x + r, (d - r) * sizeof(uint16_t));
}

}  // namespace

void rms_norm_avx512(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* out,
                     int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* xr = x + t * n;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = load_bf16(xr + i, mask16(n - i));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = mask16(n - i);
      const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(xr + i, m), iv));
      store_bf16(out + t * n + i, _mm512_mul_ps(normed, load_bf16(w + i, m)), m);
    }
  }
}

void add_inplace_avx512(uint16_t* h, const uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = mask16(n - i);
    store_bf16(h + i, _mm512_add_ps(load_bf16(h + i, m), load_bf16(y + i, m)), m);
  }
}

void silu_mul_avx512(const uint16_t* gu, int64_t inter, uint16_t* act, int64_t t0, int64_t t1) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* g = gu + t * 2 * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 m = mask16(inter - i);
      const __m512 gv = load_bf16(g + i, m);
      const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(
                                                               _mm512_setzero_ps(), gv))));
      store_bf16(act + t * inter + i, _mm512_mul_ps(round_bf16(silu), load_bf16(g + inter + i, m)),
                 m);
    }
  }
}

void rope_store_avx512(const uint16_t* qkv, const uint16_t* cos_sin, const StepArgs& s,
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
