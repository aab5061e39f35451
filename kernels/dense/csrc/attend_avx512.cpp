// Paged causal attention for the fused decoder layer (layer.h: attend_avx512): each work item is
// one (row, kv head); its H / KVH query heads attend to keys 0..pos of their sequence
// (first_key(c, pos)..pos in a sliding-window layer), read
// straight from the block table (no gather, no padding, no mask). fp32 math throughout.
// Fast path (head_dim 64 or 128, group <= 8): q kept in registers, scores for 16 keys at a time
// reduced by a transpose-and-add tree, then one pass over V with the group's accumulators in
// registers. Anything else runs the generic masked loop.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "layer.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

namespace pdmesh_dense {

#include "avx512_util.h"

namespace {

constexpr int kMaxGroup = 16;  // query heads per kv head handled by one work item

// Scores s[h * L + j] = scale * q_h . K[first + j] for the kv head g of row t, j < L.
void scores(const uint16_t* q_row, const StepArgs& s, const CacheArgs& c, int64_t b, int64_t g,
            int64_t group, int64_t first, int64_t L, float scale, float* sc) {
  const int64_t d = c.head_dim;
  for (int64_t j = 0; j < L; ++j) {
    const int64_t key = first + j;
    const int64_t blk = s.block_tables[b * s.max_blocks + key / s.block_size];
    const uint16_t* kp =
        c.k + ((blk * s.block_size + key % s.block_size) * c.num_kv_heads + g) * d;
    __m512 acc[kMaxGroup];
    for (int64_t h = 0; h < group; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = mask16(d - i);
      const __m512 kv = load_bf16(kp + i, m);
      for (int64_t h = 0; h < group; ++h) {
        acc[h] = _mm512_fmadd_ps(load_bf16(q_row + h * d + i, m), kv, acc[h]);
      }
    }
    for (int64_t h = 0; h < group; ++h) sc[h * L + j] = _mm512_reduce_add_ps(acc[h]) * scale;
  }
}

// In place: sc[0:L] -> exp(sc - max); returns the sum.
float softmax_numerator(float* sc, int64_t L) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < L; j += 16) {
    mx = _mm512_mask_max_ps(mx, mask16(L - j), mx, _mm512_maskz_loadu_ps(mask16(L - j), sc + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; j += 16) {
    const __mmask16 k = mask16(L - j);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), m));
    _mm512_mask_storeu_ps(sc + j, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}


// Any head_dim / group: one (row, kv head) item at a time, masked 16-lane slices of D.
void attend_generic(const uint16_t* q, const StepArgs& s, const CacheArgs& c, float scale,
                    uint16_t* out, float* scratch, int64_t item) {
  const int64_t d = c.head_dim, kvh = c.num_kv_heads, group = c.num_heads / kvh;
  {
    const int64_t t = item / kvh, g = item % kvh;
    int64_t pos, slot;
    locate(s, t, &pos, &slot);
    const int64_t first = first_key(c, pos);  // causal: keys first..pos
    const int64_t b = s.token_seq[t], L = pos + 1 - first;
    const int64_t head0 = g * group;
    const uint16_t* q_row = q + (t * c.num_heads + head0) * d;
    scores(q_row, s, c, b, g, group, first, L, scale, scratch);
    float inv[kMaxGroup];
    for (int64_t hh = 0; hh < group; ++hh) inv[hh] = 1.0f / softmax_numerator(scratch + hh * L, L);
    for (int64_t i = 0; i < d; i += 16) {  // one 16-lane slice of the head dim at a time
      const __mmask16 m = mask16(d - i);
      __m512 acc[kMaxGroup];
      for (int64_t hh = 0; hh < group; ++hh) acc[hh] = _mm512_setzero_ps();
      for (int64_t j = 0; j < L; ++j) {
        const int64_t key = first + j;
        const int64_t blk = s.block_tables[b * s.max_blocks + key / s.block_size];
        const uint16_t* vp = c.v + ((blk * s.block_size + key % s.block_size) * kvh + g) * d + i;
        const __m512 vv = load_bf16(vp, m);
        for (int64_t hh = 0; hh < group; ++hh) {
          acc[hh] = _mm512_fmadd_ps(_mm512_set1_ps(scratch[hh * L + j]), vv, acc[hh]);
        }
      }
      for (int64_t hh = 0; hh < group; ++hh) {
        store_bf16(out + (t * c.num_heads + head0 + hh) * d + i,
                   _mm512_mul_ps(acc[hh], _mm512_set1_ps(inv[hh])), m);
      }
    }
  }
}

// off[j - first] = element offset of key j's row (kv head 0) in the k / v cache, for
// first <= j < end: walks the block table once per block, so the key loops below never divide.
void key_offsets(const StepArgs& s, const CacheArgs& c, int64_t b, int64_t first, int64_t end,
                 int64_t* off) {
  const int64_t row = c.num_kv_heads * c.head_dim;
  for (int64_t j0 = first; j0 < end;) {
    const int64_t bi = j0 / s.block_size, o0 = j0 - bi * s.block_size;
    const int64_t base = int64_t{s.block_tables[b * s.max_blocks + bi]} * s.block_size * row;
    const int64_t n = std::min(s.block_size - o0, end - j0);
    for (int64_t o = 0; o < n; ++o) off[j0 - first + o] = base + (o0 + o) * row;
    j0 += n;
  }
}

// [sum(a[0]), ..., sum(a[15])]: a transpose-and-add tree (no horizontal reductions). The tree
// leaves lane 4k + m holding a[base(k) + (0, 2, 1, 3)[m]] with base = (0, 8, 4, 12); that map
// is its own inverse, so one permute with it restores key order.
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44),
                         _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88),
                         _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
  }
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
  const __m512 e = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m512i idx = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(idx, e);
}

// sc[h * L + j] = scale * q_h . K[j] for the G heads of one item; head_dim = 16 * DV.
template <int DV, int G>
void fast_scores(const uint16_t* q_row, const uint16_t* kbase, const int64_t* off, int64_t L,
                 float scale, float* sc) {
  __m512 qv[G][DV];
  for (int h = 0; h < G; ++h) {
    for (int i = 0; i < DV; ++i) {
      qv[h][i] = _mm512_mul_ps(load_bf16(q_row + (h * DV + i) * 16, 0xFFFF),
                               _mm512_set1_ps(scale));
    }
  }
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - j0);
    __m512 part[G][16];
    for (int jj = 0; jj < 16; ++jj) {
      __m512 kv[DV];
      for (int i = 0; i < DV; ++i) {
        kv[i] = jj < n ? load_bf16(kbase + off[j0 + jj] + i * 16, 0xFFFF) : _mm512_setzero_ps();
      }
      for (int h = 0; h < G; ++h) {
        __m512 acc = _mm512_mul_ps(qv[h][0], kv[0]);
        for (int i = 1; i < DV; ++i) acc = _mm512_fmadd_ps(qv[h][i], kv[i], acc);
        part[h][jj] = acc;
      }
    }
    for (int h = 0; h < G; ++h) {
      _mm512_mask_storeu_ps(sc + h * L + j0, mask16(n), reduce16(part[h]));
    }
  }
}

template <int DV, int G>
void attend_fast(const uint16_t* q_row, const uint16_t* kbase, const uint16_t* vbase,
                 const int64_t* off, int64_t L, float scale, float* sc, uint16_t* out_row) {
  fast_scores<DV, G>(q_row, kbase, off, L, scale, sc);
  float inv[G];
  for (int h = 0; h < G; ++h) inv[h] = 1.0f / softmax_numerator(sc + h * L, L);
  __m512 acc[G][DV];
  for (int h = 0; h < G; ++h) {
    for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < L; ++j) {
    __m512 vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = load_bf16(vbase + off[j] + i * 16, 0xFFFF);
    for (int h = 0; h < G; ++h) {
      const __m512 p = _mm512_set1_ps(sc[h * L + j]);
      for (int i = 0; i < DV; ++i) acc[h][i] = _mm512_fmadd_ps(p, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < G; ++h) {
    for (int i = 0; i < DV; ++i) {
      store_bf16(out_row + (h * DV + i) * 16, _mm512_mul_ps(acc[h][i], _mm512_set1_ps(inv[h])),
                 0xFFFF);
    }
  }
}

using FastFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                        int64_t, float, float*, uint16_t*);

template <int DV>
constexpr FastFn kFast[8] = {attend_fast<DV, 1>, attend_fast<DV, 2>, attend_fast<DV, 3>,
                             attend_fast<DV, 4>, attend_fast<DV, 5>, attend_fast<DV, 6>,
                             attend_fast<DV, 7>, attend_fast<DV, 8>};

FastFn fast_kernel(int64_t head_dim, int64_t group) {
  if (group < 1 || group > 8) return nullptr;
  if (head_dim == 64) return kFast<4>[group - 1];
  if (head_dim == 128) return kFast<8>[group - 1];
  return nullptr;
}

}  // namespace

void attend_avx512(const uint16_t* q, const StepArgs& s, const CacheArgs& c, float scale,
                   uint16_t* out, float* scratch, int64_t* offsets, int64_t i0, int64_t i1) {
  const int64_t d = c.head_dim, kvh = c.num_kv_heads, group = c.num_heads / kvh;
  const FastFn fast = fast_kernel(d, group);
  for (int64_t item = i0; item < i1; ++item) {
    if (fast == nullptr) {
      attend_generic(q, s, c, scale, out, scratch, item);
      continue;
    }
    const int64_t t = item / kvh, g = item % kvh;
    int64_t pos, slot;
    locate(s, t, &pos, &slot);
    const int64_t row0 = (t * c.num_heads + g * group) * d;  // first head of the group
    const int64_t first = first_key(c, pos);
    key_offsets(s, c, s.token_seq[t], first, pos + 1, offsets);
    fast(q + row0, c.k + g * d, c.v + g * d, offsets, pos + 1 - first, scale, scratch,
         out + row0);
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
