// Fused MXFP4 GEMV/GEMM for decode, AVX2 + FMA: y[m, n] = x[m, k] @ W[n, k].T (+ bias) straight
// from the packed bytes, for the few rows (1..32) of a decode step. fp32 arithmetic throughout:
// ops.cpp hands bf16 x over widened to fp32 and rounds the fp32 result back to bf16.
//
// Per (column, block): the 16 packed bytes are broadcast to both 128-bit lanes, one variable
// shift and a mask leave the low-nibble codes in lane 0 and the high-nibble codes in lane 1, and
// avx2.h's decoder (two vpshufb into the low / high bytes of the bf16 patterns, a byte
// interleave, then a shift or a mask per vector) turns them into 4 vectors of 8 unscaled fp32
// weights: 10 instructions per 32 weights, shared by every row of the tile. Each row takes 4
// FMAs into the block's partial dot product and one more FMA that adds it, times the block's
// power-of-two scale (exact unless the product is subnormal or overflows), to its accumulator.
// The weights come out in a fixed permutation of the block (avx2::kXOrder), in which ops.cpp
// lays x out once per call, so no decoded weight is ever shuffled back.
//
// Tiles: 4 rows x 1 column (accumulator + partial dot per row: 8 of the 16 ymm registers), 1-3
// rows for the rest; single-row decode takes 4 columns side by side so that their independent
// FMA chains overlap. A 16-column group's packed bytes stay in L1 while every row chunk passes
// over them, and each block step prefetches the next tile's bytes (contiguous; a few short
// rows side by side are what the hardware prefetcher follows worst: at k = 1536 this doubled
// the single-row speed on weights coming from DRAM).
//
// Every row runs the same instruction sequence whatever the tile shape, the batch or the
// column range a thread gets, so results depend neither on the thread count nor on the other
// rows of the batch.
#include <immintrin.h>

#include "kernels.h"
#include "avx2.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_mxfp4 {
namespace {

using avx2::Decoder;

// y[r0 .. r0 + R, n .. n + C] (+ bias).
template <int R, int C>
void f32_tile(const LinearArgs& a, int64_t r0, int64_t n) {
  const Decoder dec = Decoder::make();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i nibble_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const float* scale_table = reinterpret_cast<const float*>(kScaleTable.bits);
  const int64_t nb = a.k / kBlock;
  const float* x0 = a.x + r0 * a.k;
  // The next tile's C rows of blocks follow this tile's; prefetching past the end is harmless.
  const char* next = reinterpret_cast<const char*>(a.blocks + (n + C) * nb * kBlockBytes);
  __m256 acc[C][R];
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) acc[i / R][i % R] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    _mm_prefetch(next + j * C * kBlockBytes, _MM_HINT_T0);
    const float* xj = x0 + j * kBlock;
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const int64_t at = (n + c) * nb + j;
      const __m256i bytes = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.blocks + at * kBlockBytes)));
      // Lane 0: the low nibbles; lane 1: the high nibbles (shifted down by 4 in each dword).
      const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(bytes, nibble_shift), dec.nibble);
      const __m256 scale = _mm256_broadcast_ss(scale_table + a.scales[at]);
      __m256i words[2];
      dec.words(codes, &words[0], &words[1]);
      __m256 dot[R];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words[h], 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words[h], high));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const float* xv = xj + r * a.k + 16 * h;  // vectors 2h and 2h + 1 of the block
          dot[r] = h == 0 ? _mm256_mul_ps(even, _mm256_loadu_ps(xv))
                          : _mm256_fmadd_ps(even, _mm256_loadu_ps(xv), dot[r]);
          dot[r] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xv + 8), dot[r]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[c][r] = _mm256_fmadd_ps(dot[r], scale, acc[c][r]);
    }
  }
  avx2::store_tile<R, C>(a, r0, n, acc);
}

struct Tiles {
  template <int R, int C>
  static void tile(const LinearArgs& a, int64_t r0, int64_t n) { f32_tile<R, C>(a, r0, n); }
};

}  // namespace

void linear_f32_avx2(const LinearArgs& a, int64_t n0, int64_t n1) {
  avx2::drive_columns<Tiles>(a, n0, n1);
}

}  // namespace pdmesh_mxfp4

#pragma GCC pop_options
