// Causal prefill attention with bf16 dot products (layer.h: FlashArgs): a flash-attention
// kernel for CPUs with avx512_bf16 and no AMX, where torch's CPU flash kernel converts bf16 to
// fp32 and runs at fp32 FMA speed (README, "Prefill attention on bf16 dot products").
//
// Both products run on vdpbf16ps (32 multiply-adds per instruction, fp32 accumulation):
//   S = Q K^T: the keys packed 16 to a tile, each pair of channels interleaved
//              (k_packed [KVH, tiles, D/2, 16 keys, 2]); one query row's channel pair is a
//              32-bit broadcast, so lane j of an accumulator is key j's score.
//   O += P V:  the values packed in key pairs (v_packed [KVH, keys/2, D, 2]); one row's pair
//              of probabilities is the broadcast, so lane i is channel i.
// A work item is kFlashTokens query tokens of one kv head: their group's query heads are the
// rows (token-major), padded to a multiple of 8 with a zero query whose output is dropped.
// Keys go by blocks of kFlashKeys with the online softmax: per row the running max m and sum
// l; each block's scores are masked (key > position), exponentiated against the new max, summed
// in fp32 and rounded to bf16 for P V, as HF's attention rounds its probabilities to the
// model's dtype; O is rescaled by exp(m_old - m_new) when the max moves.
// Memory: the packed K/V (2 x ctx x KVH x D bf16) and a per-thread scratch, linear in ctx.
#include <immintrin.h>

#include "layer.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace pdmesh_dense {

#include "avx512_util.h"

namespace {

constexpr int kTileKeys = 16;   // keys per packed K tile (one zmm of scores)
constexpr int kRowTile = 8;     // query rows per S micro-kernel (x 2 key tiles: 16 accumulators)
alignas(64) const uint16_t kZeroQuery[kFlashMaxHeadDim] = {};

// No std:: templates in this target region: an instantiation compiled for AVX-512 could be
// merged by the linker into a baseline TU's copy (dense.h).
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline float maxf(float a, float b) { return a > b ? a : b; }

// Lanes [0, left) of 16, for any left (mask16 wants left >= 1).
inline __mmask16 lanes(int64_t left) { return left <= 0 ? __mmask16{0} : mask16(left); }

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline __m512bh broadcast_pair(const uint16_t* p) {  // p[0], p[1] into every 32-bit lane
  uint32_t w;
  __builtin_memcpy(&w, p, sizeof(w));
  return as_bh(_mm512_set1_epi32(static_cast<int>(w)));
}

// Where each scratch array of a work item starts (flash_scratch_floats sizes the whole).
struct Scratch {
  float* s;       // [rows, kFlashKeys] scores
  uint16_t* p;    // [rows, kFlashKeys] bf16 probabilities
  float* o;       // [rows, D] unnormalised output
  float* m;       // [rows] running max (of scale * score)
  float* l;       // [rows] running sum of exp(score - m)
};

Scratch carve(float* base, int64_t rows, int64_t d) {
  Scratch s;
  s.s = base;
  s.p = reinterpret_cast<uint16_t*>(s.s + rows * kFlashKeys);
  s.o = s.s + rows * kFlashKeys + rows * kFlashKeys / 2;
  s.m = s.o + rows * d;
  s.l = s.m + rows;
  return s;
}

// S[r, 0..32) for 8 rows and the 32 keys of two packed tiles: 16 accumulators, per channel
// pair two tile loads and eight broadcasts.
void scores_8x32(const uint16_t* const* q, const uint16_t* tiles, int64_t d, float* s) {
  __m512 acc[kRowTile][2];
#pragma GCC unroll 8
  for (int r = 0; r < kRowTile; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t tile_elems = d * kTileKeys;  // D/2 pairs x 16 keys x 2
  for (int64_t p = 0; p < d / 2; ++p) {
    const __m512bh k0 = as_bh(_mm512_loadu_si512(tiles + p * 2 * kTileKeys));
    const __m512bh k1 = as_bh(_mm512_loadu_si512(tiles + tile_elems + p * 2 * kTileKeys));
#pragma GCC unroll 8
    for (int r = 0; r < kRowTile; ++r) {
      const __m512bh qp = broadcast_pair(q[r] + 2 * p);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qp);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qp);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRowTile; ++r) {
    _mm512_storeu_ps(s + r * kFlashKeys, acc[r][0]);
    _mm512_storeu_ps(s + r * kFlashKeys + kTileKeys, acc[r][1]);
  }
}

// O[r0 .. r0+R, :] += P[r, 0..2 pairs) V for R rows and NV = D/16 channel vectors, R * NV <= 16
// accumulators; per key pair NV value loads and R broadcasts.
template <int R, int NV>
void accumulate_pv(const uint16_t* p, const uint16_t* vpairs, int64_t pairs, float* o) {
  constexpr int64_t d = NV * 16;
  __m512 acc[R][NV];
#pragma GCC unroll 16
  for (int i = 0; i < R * NV; ++i) acc[i / NV][i % NV] = _mm512_loadu_ps(o + (i / NV) * d + (i % NV) * 16);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh v[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) v[c] = as_bh(_mm512_loadu_si512(vpairs + (jp * d + c * 16) * 2));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh pp = broadcast_pair(p + r * kFlashKeys + 2 * jp);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], pp);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R * NV; ++i) _mm512_storeu_ps(o + (i / NV) * d + (i % NV) * 16, acc[i / NV][i % NV]);
}

template <int NV>
void accumulate_rows(const uint16_t* p, const uint16_t* vpairs, int64_t pairs, float* o,
                     int64_t rows) {
  constexpr int R = 16 / NV;  // divides 8 for NV in {2, 4, 8, 16}; NV 6 (D 96) takes R 2
  constexpr int Rows = R >= 2 ? (R >= 4 ? (R >= 8 ? 8 : 4) : 2) : 1;
  for (int64_t r = 0; r < rows; r += Rows) {
    accumulate_pv<Rows, NV>(p + r * kFlashKeys, vpairs, pairs, o + r * NV * 16);
  }
}

void accumulate(const uint16_t* p, const uint16_t* vpairs, int64_t pairs, float* o, int64_t rows,
                int64_t d) {
  switch (d / 16) {
    case 2: return accumulate_rows<2>(p, vpairs, pairs, o, rows);
    case 4: return accumulate_rows<4>(p, vpairs, pairs, o, rows);
    case 6: return accumulate_rows<6>(p, vpairs, pairs, o, rows);
    case 8: return accumulate_rows<8>(p, vpairs, pairs, o, rows);
    case 10: return accumulate_rows<10>(p, vpairs, pairs, o, rows);
    case 12: return accumulate_rows<12>(p, vpairs, pairs, o, rows);
    case 14: return accumulate_rows<14>(p, vpairs, pairs, o, rows);
    default: return accumulate_rows<16>(p, vpairs, pairs, o, rows);  // d == 256
  }
}

// Online-softmax update of one row for a key block whose first `valid` keys (of `width`, a
// multiple of 16) it may see: P row (bf16, zeros past valid), m, l, and O rescaled.
void softmax_row(float* s, uint16_t* p, float* m, float* l, float* o, int64_t d, int64_t valid,
                 int64_t width, float scale) {
  if (valid <= 0) {  // every key of this block is after the row's position
    __builtin_memset(p, 0, width * sizeof(uint16_t));
    return;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 top = _mm512_set1_ps(-__builtin_inff());
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 keep = lanes(valid - j);
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), vscale);
    _mm512_storeu_ps(s + j, x);
    top = _mm512_mask_max_ps(top, keep, top, x);
  }
  const float m_new = maxf(*m, _mm512_reduce_max_ps(top));
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(lanes(valid - j),
                                         exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  const float corr = *m == -__builtin_inff() ? 0.0f : __builtin_expf(*m - m_new);
  *l = *l * corr + _mm512_reduce_add_ps(sum);
  *m = m_new;
  if (corr != 1.0f) {
    const __m512 vc = _mm512_set1_ps(corr);
    for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), vc));
  }
}

// 32 bf16 of a key's row from channel `at` (16 words); zeros for a key past the context.
inline __m512i row(const uint16_t* r, int64_t at) {
  return r ? _mm512_loadu_si512(r + at) : _mm512_setzero_si512();
}

// rows[j] holds words 0..15 of key j (a word: a pair of bf16 channels); out[p * 16 + j] =
// rows[j][p]. A 16 x 16 transpose of 32-bit words in three rounds: words of row pairs, then
// pairs of row pairs (per 128-bit lane, 4 rows x 4 words), then the lanes.
void transpose_16x16(const __m512i (&rows)[16], uint32_t* out) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  // u[4 g + w], lane L: word 4 L + w of rows 4 g .. 4 g + 3.
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const __m512i* q = t + 4 * g;
    u[4 * g] = _mm512_unpacklo_epi64(q[0], q[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
  }
#pragma GCC unroll 4
  for (int w = 0; w < 4; ++w) {  // lane L of each group -> word 4 L + w of all 16 rows
    const __m512i v0 = _mm512_shuffle_i32x4(u[w], u[4 + w], 0x88);   // lanes 0, 2
    const __m512i v1 = _mm512_shuffle_i32x4(u[w], u[4 + w], 0xDD);   // lanes 1, 3
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + w], u[12 + w], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + w], u[12 + w], 0xDD);
    _mm512_storeu_si512(out + (0 + w) * 16, _mm512_shuffle_i32x4(v0, v2, 0x88));
    _mm512_storeu_si512(out + (4 + w) * 16, _mm512_shuffle_i32x4(v1, v3, 0x88));
    _mm512_storeu_si512(out + (8 + w) * 16, _mm512_shuffle_i32x4(v0, v2, 0xDD));
    _mm512_storeu_si512(out + (12 + w) * 16, _mm512_shuffle_i32x4(v1, v3, 0xDD));
  }
}

}  // namespace

void flash_pack_avx512bf16(const FlashArgs& a, int64_t i0, int64_t i1) {
  const int64_t d = a.d, tiles = flash_padded_keys(a.ctx) / kTileKeys;
  // V pairs: channels c .. c + 15 of keys 2i and 2i + 1 interleaved, then c + 16 .. c + 31.
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = static_cast<uint16_t>(i);
    lo_idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    hi_idx[2 * i] = static_cast<uint16_t>(16 + i);
    hi_idx[2 * i + 1] = static_cast<uint16_t>(48 + i);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t h = item / tiles, tile = item % tiles;
    uint32_t* kt = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(a.k_packed) +
                                               (h * tiles + tile) * kTileKeys * d);
    uint16_t* vt = static_cast<uint16_t*>(a.v_packed) + (h * tiles + tile) * kTileKeys * d;
    const uint16_t* kr[kTileKeys];  // each key's K / V row in the cache; nullptr past ctx
    const uint16_t* vr[kTileKeys];
    for (int64_t j = 0; j < kTileKeys; ++j) {
      const int64_t key = tile * kTileKeys + j;
      kr[j] = vr[j] = nullptr;
      if (key < a.ctx) {
        const int64_t slot = a.block_table[key / a.block_size] * a.block_size + key % a.block_size;
        kr[j] = a.k_cache + (slot * a.kv_heads + h) * d;
        vr[j] = a.v_cache + (slot * a.kv_heads + h) * d;
      }
    }
    for (int64_t c = 0; c < d; c += 32) {  // K: word [p][j] = channels 2p, 2p + 1 of key j
      __m512i rows[kTileKeys];
#pragma GCC unroll 16
      for (int j = 0; j < kTileKeys; ++j) rows[j] = row(kr[j], c);
      transpose_16x16(rows, kt + (c / 2) * kTileKeys);
    }
    for (int64_t j = 0; j < kTileKeys; j += 2) {  // V: [pair][channel][key of the pair]
      uint16_t* vp = vt + (j / 2) * d * 2;
      for (int64_t c = 0; c < d; c += 32) {
        const __m512i x = row(vr[j], c), y = row(vr[j + 1], c);
        _mm512_storeu_si512(vp + 2 * c, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(vp + 2 * c + 32, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
  }
}

void flash_item_avx512bf16(const FlashArgs& a, int64_t item, float* scratch) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, blocks = flash_query_blocks(a);
  const int64_t h = item % a.kv_heads, qb = blocks - 1 - item / a.kv_heads;  // longest first
  const int64_t t0 = qb * kFlashTokens, t1 = min64(a.q_len, t0 + kFlashTokens);
  const int64_t live = (t1 - t0) * group, rows = (live + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t cached = a.ctx - a.q_len, tiles = flash_padded_keys(a.ctx) / kTileKeys;
  const Scratch w = carve(scratch, rows, d);
  const uint16_t* q[kFlashTokens * kFlashMaxGroup];
  int64_t pos[kFlashTokens * kFlashMaxGroup];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group;
    q[r] = r < live ? a.q + (t * a.heads + h * group + r % group) * d : kZeroQuery;
    pos[r] = r < live ? cached + t : 0;
    w.m[r] = -__builtin_inff();
    w.l[r] = 0.0f;
  }
  __builtin_memset(w.o, 0, rows * d * sizeof(float));
  const int64_t end = cached + t1;  // keys [0, end) are visible to some row
  const uint16_t* k_head = static_cast<const uint16_t*>(a.k_packed) + h * tiles * kTileKeys * d;
  const uint16_t* v_head = static_cast<const uint16_t*>(a.v_packed) + h * tiles * kTileKeys * d;
  for (int64_t k0 = 0; k0 < end; k0 += kFlashKeys) {
    // Whole 32-key tiles (the packing pads to kFlashKeys with zero keys, masked below).
    const int64_t width = min64(kFlashKeys, (end - k0 + 31) / 32 * 32);
    for (int64_t r = 0; r < rows; r += kRowTile) {
      for (int64_t j = 0; j < width; j += 2 * kTileKeys) {
        scores_8x32(q + r, k_head + (k0 + j) * d, d, w.s + r * kFlashKeys + j);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      softmax_row(w.s + r * kFlashKeys, w.p + r * kFlashKeys, w.m + r, w.l + r, w.o + r * d, d,
                  min64(width, pos[r] - k0 + 1), width, a.scale);
    }
    accumulate(w.p, v_head + k0 * d, width / 2, w.o, rows, d);
  }
  for (int64_t r = 0; r < live; ++r) {
    const int64_t t = t0 + r / group;
    uint16_t* dst = a.out + (t * a.heads + h * group + r % group) * d;
    const __m512 inv = _mm512_set1_ps(1.0f / w.l[r]);
    for (int64_t i = 0; i < d; i += 16) {
      store_bf16(dst + i, _mm512_mul_ps(_mm512_loadu_ps(w.o + r * d + i), inv), 0xFFFF);
    }
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
