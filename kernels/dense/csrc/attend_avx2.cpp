// AVX2 paged causal attention for the fused decoder layer (layer.h: attend_avx2): each work item
// is one (row, kv head); its G = H / KVH query heads attend to keys 0..pos of their sequence
// (first_key(c, pos)..pos in a sliding-window layer),
// read straight from the block table (no gather, no padding, no mask). fp32 math throughout:
// scores (q . k) * scale, softmax with exp256 (the AVX-512 tier's exp, bit for bit), then the
// p-weighted sum of V divided by the softmax sum, rounded to bf16 once.
// Reduction order: q . k over 8-lane slices of the head dim then a fixed hsum tree; the V sum
// key by key. The AVX-512 kernels use 16 lanes (and, on their fast path, pre-scale q), so the
// two tiers agree to within fp32 summation error, not bit for bit. Each item is computed by one
// thread whatever the split, so the thread count never changes a result.
// Any head_dim (even) and G <= 16: the kernel is instantiated per G so the G accumulators live
// in registers. No std:: templates here: an out-of-line copy compiled for AVX2 could be merged
// by the linker into a baseline TU (see dense.h).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "layer.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_dense {

#include "avx2_util.h"

namespace {

constexpr int kMaxGroup = 16;  // query heads per kv head handled by one work item

// off[j - first] = element offset of key j's row (kv head 0) in the k / v cache, for
// first <= j < end: walks the block table once per block, so the key loops below never divide.
void key_offsets(const StepArgs& s, const CacheArgs& c, int64_t b, int64_t first, int64_t end,
                 int64_t* off) {
  const int64_t row = c.num_kv_heads * c.head_dim;
  for (int64_t j0 = first; j0 < end;) {
    const int64_t bi = j0 / s.block_size, o0 = j0 - bi * s.block_size;
    const int64_t base = int64_t{s.block_tables[b * s.max_blocks + bi]} * s.block_size * row;
    const int64_t n = end - j0 < s.block_size - o0 ? end - j0 : s.block_size - o0;
    for (int64_t o = 0; o < n; ++o) off[j0 - first + o] = base + (o0 + o) * row;
    j0 += n;
  }
}

// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) of each of a0..a3 -> [s0, s1, s2, s3].
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// In place: sc[0:L] -> exp(sc - max); returns the sum (8 lanes, then the hsum tree).
float softmax_numerator(float* sc, int64_t L) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < L; j += 8) mx = _mm256_max_ps(mx, load_f32_8(sc + j, L - j, -INFINITY));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 m = _mm256_broadcastss_ps(m4);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; j += 8) {
    const int64_t left = L - j;
    // Lanes past L hold -inf - m = -inf: exp256 clamps it, so mask them out of the sum.
    __m256 e = exp256(_mm256_sub_ps(load_f32_8(sc + j, left, -INFINITY), m));
    if (left < 8) {
      const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
      e = _mm256_and_ps(e, _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(left)),
                                         _CMP_LT_OQ));
    }
    store_f32_8(sc + j, e, left);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(16) float s[4];
  _mm_store_ps(s, reduce4(sum, sum, sum, sum));
  return s[0];
}

// One item: q_row [G, D] bf16 (the group's heads), keys / values at kbase / vbase + off[j].
// qf: G * D floats of scratch, sc: G * L floats.
template <int G>
void attend_item(const uint16_t* q_row, const uint16_t* kbase, const uint16_t* vbase,
                 const int64_t* off, int64_t L, int64_t d, float scale, float* qf, float* sc,
                 uint16_t* out_row) {
  for (int h = 0; h < G; ++h) {
    for (int64_t i = 0; i < d; i += 8) store_f32_8(qf + h * d + i, load_bf16_8(q_row + h * d + i,
                                                                                d - i), d - i);
  }
  // Scores: one key at a time, its 8-lane slices widened once for all G heads.
  for (int64_t j = 0; j < L; ++j) {
    const uint16_t* kp = kbase + off[j];
    __m256 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 kv = load_bf16_8(kp + i, d - i);
      for (int h = 0; h < G; ++h) {
        acc[h] = _mm256_fmadd_ps(load_f32_8(qf + h * d + i, d - i, 0.0f), kv, acc[h]);
      }
    }
    int h = 0;
    for (; h + 4 <= G; h += 4) {
      alignas(16) float s[4];
      _mm_store_ps(s, reduce4(acc[h], acc[h + 1], acc[h + 2], acc[h + 3]));
      for (int u = 0; u < 4; ++u) sc[(h + u) * L + j] = s[u] * scale;
    }
    for (; h < G; ++h) {
      alignas(16) float s[4];
      _mm_store_ps(s, reduce4(acc[h], acc[h], acc[h], acc[h]));
      sc[h * L + j] = s[0] * scale;
    }
  }
  float inv[G];
  for (int h = 0; h < G; ++h) inv[h] = 1.0f / softmax_numerator(sc + h * L, L);
  // Weighted V: S slices of the head dim at a time, G * S accumulators in registers.
  constexpr int S = G >= 8 ? 1 : 8 / G;
  for (int64_t i0 = 0; i0 < d; i0 += 8 * S) {
    __m256 acc[G][S];
    for (int h = 0; h < G; ++h) {
      for (int s = 0; s < S; ++s) acc[h][s] = _mm256_setzero_ps();
    }
    const int64_t left = d - i0;
    for (int64_t j = 0; j < L; ++j) {
      const uint16_t* vp = vbase + off[j] + i0;
      __m256 vv[S];
      for (int s = 0; s < S; ++s) {
        vv[s] = left > 8 * s ? load_bf16_8(vp + 8 * s, left - 8 * s) : _mm256_setzero_ps();
      }
      for (int h = 0; h < G; ++h) {
        const __m256 p = _mm256_broadcast_ss(sc + h * L + j);
        for (int s = 0; s < S; ++s) acc[h][s] = _mm256_fmadd_ps(p, vv[s], acc[h][s]);
      }
    }
    for (int h = 0; h < G; ++h) {
      for (int s = 0; s < S && left > 8 * s; ++s) {
        store_bf16_8(out_row + h * d + i0 + 8 * s,
                     _mm256_mul_ps(acc[h][s], _mm256_set1_ps(inv[h])), left - 8 * s);
      }
    }
  }
}

using ItemFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                        int64_t, int64_t, float, float*, float*, uint16_t*);

constexpr ItemFn kItem[kMaxGroup] = {
    attend_item<1>,  attend_item<2>,  attend_item<3>,  attend_item<4>,
    attend_item<5>,  attend_item<6>,  attend_item<7>,  attend_item<8>,
    attend_item<9>,  attend_item<10>, attend_item<11>, attend_item<12>,
    attend_item<13>, attend_item<14>, attend_item<15>, attend_item<16>};

}  // namespace

void attend_avx2(const uint16_t* q, const StepArgs& s, const CacheArgs& c, float scale,
                 uint16_t* out, float* scratch, int64_t* offsets, int64_t i0, int64_t i1) {
  const int64_t d = c.head_dim, kvh = c.num_kv_heads, group = c.num_heads / kvh;
  const ItemFn item_fn = kItem[group - 1];  // 1 <= group <= 16: checked by the binding
  float* qf = scratch;                       // group * d floats, then the scores
  float* sc = scratch + group * d;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t t = item / kvh, g = item % kvh;
    int64_t pos, slot;
    locate(s, t, &pos, &slot);
    const int64_t row0 = (t * c.num_heads + g * group) * d;  // first head of the group
    const int64_t first = first_key(c, pos);
    key_offsets(s, c, s.token_seq[t], first, pos + 1, offsets);
    item_fn(q + row0, c.k + g * d, c.v + g * d, offsets, pos + 1 - first, d, scale, qf, sc,
            out + row0);
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
