// AVX-512BW screen of the greedy head (dense.h ScreenArgs): int8 weights widened to int16
// (vpmovsxbw), vpmaddwd pair sums against int16 x, accumulated in int32.
//
// Why integers: the screen reads the head's int8 copy once per step at memory bandwidth, and
// its arithmetic must hide under that stream on two cores. Per 32 weights this is a widening
// load, one vpmaddwd and one vpaddd; the fp32 route (widen to int32, convert, FMA per 16) costs
// twice the instructions, and Zen 4 splits every 512-bit op in two. Integer sums are also
// exact: the dots do not depend on order, tile or tier (the AVX2 kernel gives the same).
// One weight row at a time, in address order, against up to 4 x rows, kU chains each: as the
// bf16 GEMV found (gemv_avx512.cpp), Zen 4's prefetchers track interleaved short rows as
// separate streams and slow down. No std:: calls here: a template instantiated in this target
// region could be merged into a baseline TU (dense.h).
#include <immintrin.h>

#include "dense.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace pdmesh_dense {
namespace {

constexpr int64_t kPrefetchBytes = 4096;  // as the bf16 GEMV: rows are on 4 KiB pages
constexpr int kU = 4;                     // accumulator chains per x row

// Rows r0..r0+R-1 of x against head row n; finishes each (see dense.h).
// One K step of head row `row` against x rows r0..r0+R-1, into one chain set.
template <int R>
inline void chunk(const ScreenArgs& a, const int8_t* row, int64_t r0, int64_t k,
                  __m512i (&acc)[R]) {
  if (r0 == 0 && k % 64 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T1);
  }
  const __m512i w =
      _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i xv = _mm512_loadu_si512(a.xq + (r0 + r) * a.kpad + k);
    acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(w, xv));
  }
}

template <int R>
void tile(const ScreenArgs& a, int64_t r0, int64_t n, int64_t n0, float* best, int64_t* count) {
  __m512i acc[kU][R];
#pragma GCC unroll 16
  for (int i = 0; i < kU * R; ++i) acc[i / R][i % R] = _mm512_setzero_si512();
  const int8_t* row = a.q + n * a.kpad;
  const int64_t full = a.kpad / (kU * kScreenChunk) * (kU * kScreenChunk);
  int64_t k = 0;
  for (; k < full; k += kU * kScreenChunk) {
#pragma GCC unroll 4
    for (int u = 0; u < kU; ++u) chunk<R>(a, row, r0, k + u * kScreenChunk, acc[u]);
  }
  for (; k < a.kpad; k += kScreenChunk) chunk<R>(a, row, r0, k, acc[0]);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m512i s = acc[0][r];
#pragma GCC unroll 4
    for (int v = 1; v < kU; ++v) s = _mm512_add_epi32(s, acc[v][r]);
    screen_keep(a, r0 + r, n, n0, _mm512_reduce_add_epi32(s), best, count);
  }
}

}  // namespace

void screen_avx512(const ScreenArgs& a, int64_t n0, int64_t n1, float* best, int64_t* count) {
  for (int64_t r = 0; r < a.m; ++r) count[r] = 0;
  for (int64_t n = n0; n < n1; ++n) {  // one stream: two measured no faster here
    int64_t r = 0;
    for (; r + 4 <= a.m; r += 4) tile<4>(a, r, n, n0, best, count);
    for (; r + 2 <= a.m; r += 2) tile<2>(a, r, n, n0, best, count);
    for (; r < a.m; ++r) tile<1>(a, r, n, n0, best, count);
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
