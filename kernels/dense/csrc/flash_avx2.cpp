// Causal prefill attention in fp32 FMA on AVX2 (layer.h: FlashArgs): the flash kernel of the
// avx2 tier (AMD Zen 3 and other CPUs without AVX-512), where torch's CPU flash kernel reaches
// a quarter of the FMA peak at 200 tokens and about half at 2,000+ (README, "Prefill attention
// on AVX2").
//
// bf16 widens to fp32 exactly, so K and V are widened once while packed and every product is
// an fp32 FMA:
//   S = Q K^T: the keys packed 8 to a tile, channel-major (k_packed [KVH, tiles, D, 8 keys]
//              fp32); one query row's channel is a broadcast, so lane j of an accumulator is
//              key j's score. Q is widened and pre-scaled once per work item.
//   O += P V:  the values as fp32 rows (v_packed [KVH, keys, D]); one row's probability is the
//              broadcast, so lane i is channel i.
// A work item is a.tokens query tokens of one kv head (about 96 rows: each K / V block, from
// L3 or DRAM at long contexts, serves that many queries while the item's scratch stays in L2):
// their group's query heads are the rows (token-major), padded to a multiple of kRowTile with
// a zero query whose output is dropped. Keys go by blocks of kFlashKeys with the online
// softmax, as in flash_avx512bf16.cpp: per row the running max m and sum l (of the unrounded
// exponentials); the probabilities are rounded to bf16 before P V, as HF's attention rounds
// them to the model's dtype; O is rescaled by exp(m_old - m_new) when the max moves.
// Register budget (16 ymm): the S tile is 6 rows x 16 keys and the P V tile 6 rows x 16
// channels, 12 accumulators each, so two FMA ports with a 4-cycle latency stay fed; per
// channel (or key) two tile loads and six broadcasts.
// Memory: the packed K / V (2 x ctx x KVH x D fp32) and a per-thread scratch, linear in ctx.
#include <immintrin.h>

#include <cstring>

#include "layer.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_dense {

#include "avx2_util.h"

namespace {

constexpr int kTileKeys = 8;  // keys per packed K tile (one ymm of scores)
constexpr int kRowTile = 6;   // query rows per micro-kernel (x 2 vectors: 12 accumulators)
alignas(32) const uint16_t kZeroQuery[kFlashMaxHeadDim] = {};

// No std:: templates in this target region (dense.h): see flash_avx512bf16.cpp.
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline float maxf(float a, float b) { return a > b ? a : b; }

// Where each scratch array of a work item starts (flash_scratch_floats sizes the whole).
struct Scratch {
  float* s;  // [rows, kFlashKeys] scores, then bf16-rounded probabilities in place
  float* q;  // [rows, D] widened, pre-scaled queries
  float* o;  // [rows, D] unnormalised output
  float* m;  // [rows] running max of the scaled scores
  float* l;  // [rows] running sum of exp(score - m)
};

Scratch carve(float* base, int64_t rows, int64_t d) {
  Scratch s;
  s.s = base;
  s.q = s.s + rows * kFlashKeys;
  s.o = s.q + rows * d;
  s.m = s.o + rows * d;
  s.l = s.m + rows;
  return s;
}

// S[r, 0..16) for 6 rows of q (stride d) and the 16 keys of two packed tiles.
void scores_6x16(const float* q, const float* tiles, int64_t d, float* s) {
  __m256 acc[kRowTile][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRowTile; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* t1 = tiles + d * kTileKeys;
  for (int64_t c = 0; c < d; ++c) {
    const __m256 k0 = _mm256_loadu_ps(tiles + c * kTileKeys);
    const __m256 k1 = _mm256_loadu_ps(t1 + c * kTileKeys);
#pragma GCC unroll 6
    for (int r = 0; r < kRowTile; ++r) {
      const __m256 qc = _mm256_broadcast_ss(q + r * d + c);
      acc[r][0] = _mm256_fmadd_ps(qc, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qc, k1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRowTile; ++r) {
    _mm256_storeu_ps(s + r * kFlashKeys, acc[r][0]);
    _mm256_storeu_ps(s + r * kFlashKeys + kTileKeys, acc[r][1]);
  }
}

// O[r, c .. c + 16) += sum_j P[r, j] V[j, c .. c + 16) for 6 rows and `keys` keys.
void accumulate_6x16(const float* p, const float* v, int64_t keys, int64_t d, float* o) {
  __m256 acc[kRowTile][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRowTile; ++r) {
    acc[r][0] = _mm256_loadu_ps(o + r * d);
    acc[r][1] = _mm256_loadu_ps(o + r * d + 8);
  }
  for (int64_t j = 0; j < keys; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * d);
    const __m256 v1 = _mm256_loadu_ps(v + j * d + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRowTile; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * kFlashKeys + j);
      acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRowTile; ++r) {
    _mm256_storeu_ps(o + r * d, acc[r][0]);
    _mm256_storeu_ps(o + r * d + 8, acc[r][1]);
  }
}

inline float hmax(__m256 v) {  // the largest of 8 lanes, by shuffles (no store and reload)
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// p rounded to bf16 precision (RNE), for the finite p >= 0 of a softmax: no NaN case.
inline __m256 round_prob(__m256 p) {
  const __m256i b = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Online-softmax update of one row for a key block whose first `valid` keys (of `width`, a
// multiple of 8) it may see: s becomes the row's probabilities (bf16-rounded, zeros past
// valid); m, l and O (rescaled) follow. Only a block on the row's diagonal needs the mask.
void softmax_row(float* s, float* m, float* l, float* o, int64_t d, int64_t valid,
                 int64_t width) {
  if (valid <= 0) {  // every key of this block is after the row's position
    std::memset(s, 0, width * sizeof(float));
    return;
  }
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t full = valid / 8 * 8;  // keys [0, full) visible in whole vectors
  const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
  // The partial vector at `full` (if any) keeps lanes < valid - full; later ones keep none.
  const __m256 edge = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid - full)), iota));
  __m256 top = ninf;
  for (int64_t j = 0; j < full; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  if (full < width) {
    top = _mm256_max_ps(top, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + full), edge));
  }
  const float m_new = maxf(*m, hmax(top));
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + j, round_prob(e));
  }
  if (full < width) {
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + full), vm)), edge);
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + full, round_prob(e));
    for (int64_t j = full + 8; j < width; j += 8) _mm256_storeu_ps(s + j, _mm256_setzero_ps());
  }
  if (*m != m_new) {  // rescale: the first block (m = -inf) finds l and O at zero
    const float corr = *m == -__builtin_inff()
                           ? 0.0f
                           : _mm256_cvtss_f32(exp256(_mm256_set1_ps(*m - m_new)));
    const __m256 vc = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < d; i += 8) {
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), vc));
    }
    *l *= corr;
  }
  *l += hsum(sum);
  *m = m_new;
}

// Rows r[0..8) of 8 fp32 each -> out[i * 8 + j] = r[j][i] (a standard 8 x 8 transpose).
void transpose_8x8(const __m256 (&r)[8], float* out) {
  __m256 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g) {  // u[4 g + w], per 128-bit lane: word w of rows 4 g .. 4 g + 3
    const __m256* x = t + 4 * g;
    u[4 * g] = _mm256_shuffle_ps(x[0], x[2], 0x44);
    u[4 * g + 1] = _mm256_shuffle_ps(x[0], x[2], 0xEE);
    u[4 * g + 2] = _mm256_shuffle_ps(x[1], x[3], 0x44);
    u[4 * g + 3] = _mm256_shuffle_ps(x[1], x[3], 0xEE);
  }
#pragma GCC unroll 4
  for (int w = 0; w < 4; ++w) {
    _mm256_storeu_ps(out + w * 8, _mm256_permute2f128_ps(u[w], u[4 + w], 0x20));
    _mm256_storeu_ps(out + (4 + w) * 8, _mm256_permute2f128_ps(u[w], u[4 + w], 0x31));
  }
}

// Channels c .. c + 7 of a key's row, widened; zeros for a key past the context.
inline __m256 row8(const uint16_t* r, int64_t c) {
  return r ? load_bf16_8(r + c, 8) : _mm256_setzero_ps();
}

}  // namespace

void flash_pack_avx2(const FlashArgs& a, int64_t i0, int64_t i1) {
  // Items are 16-key units of one kv head (the caller's split): two K tiles each.
  const int64_t d = a.d, padded = flash_padded_keys(a.ctx), units = padded / 16;
  float* k_packed = static_cast<float*>(a.k_packed);
  float* v_packed = static_cast<float*>(a.v_packed);
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t h = item / units, key0 = item % units * 16;
    for (int64_t t = key0; t < key0 + 16; t += kTileKeys) {
      const uint16_t* kr[kTileKeys];  // each key's K / V row in the cache; nullptr past ctx
      const uint16_t* vr[kTileKeys];
      for (int64_t j = 0; j < kTileKeys; ++j) {
        const int64_t key = t + j;
        kr[j] = vr[j] = nullptr;
        if (key < a.ctx) {
          const int64_t slot =
              a.block_table[key / a.block_size] * a.block_size + key % a.block_size;
          kr[j] = a.k_cache + (slot * a.kv_heads + h) * d;
          vr[j] = a.v_cache + (slot * a.kv_heads + h) * d;
        }
      }
      float* kt = k_packed + (h * padded + t) * d;  // tile t / 8: [D][8 keys]
      for (int64_t c = 0; c < d; c += 8) {
        __m256 rows[kTileKeys];
#pragma GCC unroll 8
        for (int j = 0; j < kTileKeys; ++j) rows[j] = row8(kr[j], c);
        transpose_8x8(rows, kt + c * kTileKeys);
      }
      for (int64_t j = 0; j < kTileKeys; ++j) {
        float* vt = v_packed + (h * padded + t + j) * d;
        for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(vt + c, row8(vr[j], c));
      }
    }
  }
}

void flash_item_avx2(const FlashArgs& a, int64_t item, float* scratch) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, blocks = flash_query_blocks(a);
  const int64_t h = item % a.kv_heads, qb = blocks - 1 - item / a.kv_heads;  // longest first
  const int64_t t0 = qb * a.tokens, t1 = min64(a.q_len, t0 + a.tokens);
  const int64_t live = (t1 - t0) * group, rows = (live + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t cached = a.ctx - a.q_len, padded = flash_padded_keys(a.ctx);
  const Scratch w = carve(scratch, rows, d);
  int64_t pos[kFlashMaxTokens * kFlashMaxGroup + kRowTile];
  const __m256 vscale = _mm256_set1_ps(a.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group;
    const uint16_t* src = r < live ? a.q + (t * a.heads + h * group + r % group) * d : kZeroQuery;
    for (int64_t c = 0; c < d; c += 8) {
      _mm256_storeu_ps(w.q + r * d + c, _mm256_mul_ps(load_bf16_8(src + c, 8), vscale));
    }
    pos[r] = r < live ? cached + t : 0;
    w.m[r] = -__builtin_inff();
    w.l[r] = 0.0f;
  }
  std::memset(w.o, 0, rows * d * sizeof(float));
  const int64_t end = cached + t1;  // keys [0, end) are visible to some row
  const float* k_head = static_cast<const float*>(a.k_packed) + h * padded * d;
  const float* v_head = static_cast<const float*>(a.v_packed) + h * padded * d;
  for (int64_t k0 = 0; k0 < end; k0 += kFlashKeys) {
    // Whole 16-key pairs of tiles (the packing pads to kFlashKeys with zero keys, masked below).
    const int64_t width = min64(kFlashKeys, (end - k0 + 15) / 16 * 16);
    for (int64_t r = 0; r < rows; r += kRowTile) {
      // Rows are token-major, so the tile's last live row sees the most keys; keys past it
      // are masked in all six rows: their scores and P V terms are skipped.
      const int64_t seen = min64(width, pos[min64(r + kRowTile, live) - 1] - k0 + 1);
      if (seen <= 0) continue;  // no row of the tile sees this block: m, l and O stand
      for (int64_t j = 0; j < seen; j += 2 * kTileKeys) {
        scores_6x16(w.q + r * d, k_head + (k0 + j) * d, d, w.s + r * kFlashKeys + j);
      }
      for (int64_t i = r; i < r + kRowTile; ++i) {
        softmax_row(w.s + i * kFlashKeys, w.m + i, w.l + i, w.o + i * d, d,
                    min64(width, pos[i] - k0 + 1), (seen + 15) / 16 * 16);
      }
      for (int64_t c = 0; c < d; c += 16) {
        accumulate_6x16(w.s + r * kFlashKeys, v_head + k0 * d + c, seen, d, w.o + r * d + c);
      }
    }
  }
  for (int64_t r = 0; r < live; ++r) {
    const int64_t t = t0 + r / group;
    uint16_t* dst = a.out + (t * a.heads + h * group + r % group) * d;
    const __m256 inv = _mm256_set1_ps(1.0f / w.l[r]);
    for (int64_t c = 0; c < d; c += 8) {
      store_bf16_8(dst + c, _mm256_mul_ps(_mm256_loadu_ps(w.o + r * d + c), inv), 8);
    }
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
