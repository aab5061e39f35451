// Fused MXFP4 GEMV/GEMM for decode, AVX-512: y[m, n] = x[m, k] @ W[n, k].T (+ bias) straight from
// the packed bytes, for the few rows (1..32) of a decode step. Nothing is materialised: per block
// the 16-entry E2M1 table (built by the bit-manipulation converter) is scaled once, and vpermps /
// vpermw turn each packed byte's nibbles into weights with one instruction per 16/32 weights.
//
// Register tiling: R rows of x times C output columns of accumulators; weights of a column group
// stay in L1 while every row chunk passes over them, and x (<= 32 x k) stays in L2.
// fp32 x: exact fp32 products, fp32 accumulation (FMA), the same tolerance as an fp32 matmul.
// bf16 x (avx512_bf16 only): vdpbf16ps on exact bf16 weights, 32 MACs per instruction; like
// every vdpbf16ps it treats subnormal inputs (|v| < 2^-126) as zero. Row chunks of 8 decode
// scaled weights (table x scale, then vpermw) and share them across the rows. Smaller chunks,
// the single-stream decode case, are bound by that decoding, so they work on two blocks of a
// column at once with the unscaled table: one vpermw per 32 weights, no table scaling, and the
// two blocks' scales applied to the fp32 dot products (exact: powers of two), x being in the
// matching pair layout (kernels.h).
#include <immintrin.h>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace pdmesh_mxfp4 {
namespace {

constexpr int64_t kColumnGroup = 24;  // output columns whose weights are reused by all row chunks

inline __m512 scale_ps(uint32_t s) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kScaleTable.bits[s])));
}

// The 16 E2M1 values in code order (e2m1_to_f32_bits per lane; built once per call).
inline __m512 e2m1_table_ps() {
  alignas(64) uint32_t bits[16];
  for (uint32_t c = 0; c < 16; ++c) bits[c] = e2m1_to_f32_bits(c);
  return _mm512_castsi512_ps(_mm512_load_si512(bits));
}

// Horizontal sums of four accumulators -> {sum(a), sum(b), sum(c), sum(d)}: 13 instructions
// where four separate reductions take about 32.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: ab = {a0+a2, b0+b2, a1+a3, b1+b3}, cd likewise.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  // Per 128-bit lane: {sum a, sum b, sum c, sum d} of that lane.
  __m512 v = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));  // lanes + lanes two apart
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));  // + the neighbour lane
  return _mm512_castps512_ps128(v);
}

// sums[i] = horizontal sum of acc[i], four at a time. The leftovers take the same tree (each
// lane of reduce4 sums its own input only), so a column's bits do not depend on its tile's
// width: any split of the output columns (ops.cpp's, or the dense decode team's) agrees.
template <int N>
inline void reduce_all(const __m512* acc, float* sums) {
  int i = 0;
#pragma GCC unroll 8
  for (; i + 4 <= N; i += 4) {
    _mm_storeu_ps(sums + i, reduce4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
  }
  const __m512 zero = _mm512_setzero_ps();
  for (; i < N; ++i) sums[i] = _mm_cvtss_f32(reduce4(acc[i], zero, zero, zero));
}

inline const __m128i* block_bytes(const LinearArgs& a, int64_t n, int64_t j) {
  return reinterpret_cast<const __m128i*>(a.blocks + (n * (a.k / kBlock) + j) * kBlockBytes);
}

// y[r0 .. r0+R, n .. n+C] = the sum of each accumulator (+ bias), as fp32 or (kBf16) bf16.
template <bool kBf16, int R, int C>
inline void store_tile(const LinearArgs& a, int64_t r0, int64_t n, const __m512 (&acc)[R][C]) {
  float sums[R * C];
  reduce_all<R * C>(&acc[0][0], sums);
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) {
    const int r = i / C, c = i % C;
    const float v = sums[i] + (a.bias ? a.bias[n + c] : 0.0f);
    const int64_t at = a.y_at(r0 + r, n + c);
    if constexpr (kBf16) {
      static_cast<uint16_t*>(a.y)[at] = f32_to_bf16_rne(v);
    } else {
      static_cast<float*>(a.y)[at] = v;
    }
  }
}

template <int R, int C>
void tile_f32(const LinearArgs& a, int64_t r0, int64_t n, __m512 table) {
  const int64_t nb = a.k / kBlock;
  __m512 acc[R][C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    __m512 even[C], odd[C];  // x is reordered per block: 16 even elements, then 16 odd
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512 t = _mm512_mul_ps(table, scale_ps(a.scales[(n + c) * nb + j]));
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(block_bytes(a, n + c, j)));
      even[c] = _mm512_permutexvar_ps(v, t);  // vpermps reads index bits 3..0: the low nibble
      odd[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xr = a.x + (r0 + r) * a.k + j * kBlock;
      const __m512 xe = _mm512_loadu_ps(xr);
      const __m512 xo = _mm512_loadu_ps(xr + 16);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(even[c], xe, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(odd[c], xo, acc[r][c]);
      }
    }
  }
  store_tile<false, R, C>(a, r0, n, acc);
}

// 32 bf16 copies of the scaled table (vpermw reads 5 index bits; entries 16..31 repeat 0..15).
inline __m512i scaled_table_bf16(__m512 table, uint32_t s) {
  const __m512 t = _mm512_mul_ps(table, scale_ps(s));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(t, t));
}

template <int R, int C>
void tile_bf16(const LinearArgs& a, int64_t r0, int64_t n, __m512 table) {
  const int64_t nb = a.k / kBlock;
  __m512 acc[R][C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    __m512i w[C];  // 32 bf16 weights in element order: word 2i from byte i's low nibble
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i t = scaled_table_bf16(table, a.scales[(n + c) * nb + j]);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(block_bytes(a, n + c, j)));
      // Low word: the byte (index bits 3..0 = low nibble); high word: the byte >> 4.
      w[c] = _mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), t);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xr = _mm512_loadu_si512(a.x_bf16 + (r0 + r) * a.k + j * kBlock);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], reinterpret_cast<__m512bh>(w[c]),
                                     reinterpret_cast<__m512bh>(xr));
      }
    }
  }
  store_tile<true, R, C>(a, r0, n, acc);
}

inline const float* scale_ptr(uint8_t s) {
  return reinterpret_cast<const float*>(&kScaleTable.bits[s]);
}

// Pair tiles: blocks j and j + 1 of a column are 32 contiguous bytes. Zero-extended to words,
// byte i (of either block) indexes the table with its low nibble (element 2i) and, shifted,
// its high nibble (element 2i + 1): lo holds the even elements of both blocks, hi the odd ones,
// matching x's pair layout. vdpbf16ps sums adjacent words, so lanes 0..7 of the dot product
// belong to block j and lanes 8..15 to block j + 1, each half scaled by its own block's scale.
template <int R, int C>
void tile_pair(const LinearArgs& a, int64_t r0, int64_t n, __m512) {
  const int64_t nb = a.k / kBlock, pairs = x_pairs(a.k);
  const __m512i table = _mm512_load_si512(kBf16Table.bits);
  __m512 acc[R][C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm512_setzero_ps();
  // The next tile's C rows of blocks are contiguous (C * nb * 16 bytes): each pair step
  // prefetches C * 32 of them, so they arrive from DRAM while this tile computes (short rows in
  // several streams are what the hardware prefetcher handles worst). Prefetching past the end
  // of the tensor is harmless.
  const char* next = reinterpret_cast<const char*>(a.blocks + (n + C) * nb * kBlockBytes);
  _mm_prefetch(reinterpret_cast<const char*>(a.scales + (n + C) * nb), _MM_HINT_T0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t j = 2 * p;
    const bool full = j + 1 < nb;  // else the second block is past k: zero weights, scale 1
#pragma GCC unroll 4
    for (int64_t off = 0; off < C * 2 * kBlockBytes; off += 64) {
      _mm_prefetch(next + p * C * 2 * kBlockBytes + off, _MM_HINT_T0);
    }
    __m512i lo[C], hi[C];
    const float* s0[C];  // fp32 scales of blocks j and j + 1 (entries of kScaleTable)
    const float* s1[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const uint8_t* bp = a.blocks + ((n + c) * nb + j) * kBlockBytes;
      const __m256i bytes = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp))
                                 : _mm256_zextsi128_si256(_mm_loadu_si128(
                                       reinterpret_cast<const __m128i*>(bp)));
      const __m512i v = _mm512_cvtepu8_epi16(bytes);
      lo[c] = _mm512_permutexvar_epi16(v, table);
      hi[c] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);  // words are < 256
      const uint8_t* sp = a.scales + (n + c) * nb + j;
      s0[c] = scale_ptr(sp[0]);
      s1[c] = scale_ptr(full ? sp[1] : uint8_t{127});  // 127: 1.0 for the zero half
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = a.x_pairs + ((r0 + r) * pairs + p) * 2 * kBlock;
      const __m512bh xl = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr));
      const __m512bh xh = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + kBlock));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), reinterpret_cast<__m512bh>(lo[c]), xl);
        d = _mm512_dpbf16_ps(d, reinterpret_cast<__m512bh>(hi[c]), xh);
        // Two masked FMAs with broadcast memory operands: lanes 0..7 scaled by block j's
        // scale, 8..15 by block j + 1's (cheaper than building a blended scale vector).
        acc[r][c] = _mm512_mask3_fmadd_ps(d, _mm512_set1_ps(*s0[c]), acc[r][c], 0x00FF);
        acc[r][c] = _mm512_mask3_fmadd_ps(d, _mm512_set1_ps(*s1[c]), acc[r][c], 0xFF00);
      }
    }
  }
  store_tile<true, R, C>(a, r0, n, acc);
}

using TileFn = void (*)(const LinearArgs&, int64_t, int64_t, __m512);

// Tiles for one row-chunk height: C columns at a time, then single columns for the tail.
struct RowKernel {
  int rows;
  int cols;
  TileFn wide;
  TileFn narrow;
};

constexpr int kRowKernels = 5;

// Columns [n0, n1), grouped; inside a group every row chunk (8, 4, 3, 2, 1 rows) runs over it.
void run_tiles(const LinearArgs& a, int64_t n0, int64_t n1,
               const RowKernel (&kernels)[kRowKernels]) {
  const __m512 table = e2m1_table_ps();
  for (int64_t g0 = n0; g0 < n1; g0 += kColumnGroup) {
    const int64_t g1 = g0 + kColumnGroup < n1 ? g0 + kColumnGroup : n1;
    int64_t r = 0;
    for (const RowKernel& rk : kernels) {
      for (; a.m - r >= rk.rows; r += rk.rows) {
        int64_t n = g0;
        for (; n + rk.cols <= g1; n += rk.cols) rk.wide(a, r, n, table);
        for (; n < g1; ++n) rk.narrow(a, r, n, table);
      }
    }
  }
}

// Tile shapes keep accumulators + decoded weights + x within the 32 zmm registers.
constexpr RowKernel kF32Kernels[kRowKernels] = {
    {8, 2, tile_f32<8, 2>, tile_f32<8, 1>},
    {4, 4, tile_f32<4, 4>, tile_f32<4, 1>},
    {3, 4, tile_f32<3, 4>, tile_f32<3, 1>},
    {2, 4, tile_f32<2, 4>, tile_f32<2, 1>},
    {1, 4, tile_f32<1, 4>, tile_f32<1, 1>},
};

constexpr RowKernel kBf16Kernels[kRowKernels] = {
    {8, 3, tile_bf16<8, 3>, tile_bf16<8, 1>},
    {4, 3, tile_pair<4, 3>, tile_pair<4, 1>},
    {3, 4, tile_pair<3, 4>, tile_pair<3, 1>},
    {2, 4, tile_pair<2, 4>, tile_pair<2, 1>},
    {1, 4, tile_pair<1, 4>, tile_pair<1, 1>},
};

}  // namespace

void linear_f32_avx512(const LinearArgs& a, int64_t n0, int64_t n1) {
  run_tiles(a, n0, n1, kF32Kernels);
}

void linear_bf16_avx512(const LinearArgs& a, int64_t n0, int64_t n1) {
  run_tiles(a, n0, n1, kBf16Kernels);
}

void pair_x_bf16_avx512(const uint16_t* x, int64_t m, int64_t k, uint16_t* out) {
  const int64_t nb = k / kBlock, pairs = x_pairs(k);
  alignas(64) uint16_t even[32], odd[32];
  for (int i = 0; i < 32; ++i) {
    even[i] = static_cast<uint16_t>(2 * i);  // words 0..31 of a, then 32..63 of b
    odd[i] = static_cast<uint16_t>(2 * i + 1);
  }
  const __m512i ie = _mm512_load_si512(even), io = _mm512_load_si512(odd);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* src = x + r * k + 2 * p * kBlock;
      const __m512i a = _mm512_loadu_si512(src);
      const __m512i b = 2 * p + 1 < nb ? _mm512_loadu_si512(src + kBlock) : _mm512_setzero_si512();
      uint16_t* dst = out + (r * pairs + p) * 2 * kBlock;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, ie, b));
      _mm512_storeu_si512(dst + kBlock, _mm512_permutex2var_epi16(a, io, b));
    }
  }
}

}  // namespace pdmesh_mxfp4

#pragma GCC pop_options
