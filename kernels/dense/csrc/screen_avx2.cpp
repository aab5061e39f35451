// AVX2 screen of the greedy head: screen_avx512.cpp's arithmetic 16 weights at a time
// (vpmovsxbw ymm, vpmaddwd, vpaddd), against up to 2 x rows (16 registers: 8 accumulators, a
// weight and an x), for CPUs without AVX-512. Integer sums: the dots equal the AVX-512
// kernel's bit for bit.
#include <immintrin.h>

#include "dense.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_dense {
namespace {

constexpr int64_t kPrefetchBytes = 4096;
constexpr int kU = 4;
constexpr int64_t kStep = 16;

inline int32_t hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// One K step of head row `row` against x rows r0..r0+R-1, into one chain set.
template <int R>
inline void chunk(const ScreenArgs& a, const int8_t* row, int64_t r0, int64_t k,
                  __m256i (&acc)[R]) {
  if (r0 == 0 && k % 64 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T1);
  }
  const __m256i w =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i xv =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + (r0 + r) * a.kpad + k));
    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(w, xv));
  }
}

template <int R>
void tile(const ScreenArgs& a, int64_t r0, int64_t n, int64_t n0, float* best, int64_t* count) {
  __m256i acc[kU][R];
#pragma GCC unroll 16
  for (int i = 0; i < kU * R; ++i) acc[i / R][i % R] = _mm256_setzero_si256();
  const int8_t* row = a.q + n * a.kpad;
  const int64_t full = a.kpad / (kU * kStep) * (kU * kStep);
  int64_t k = 0;
  for (; k < full; k += kU * kStep) {
#pragma GCC unroll 4
    for (int u = 0; u < kU; ++u) chunk<R>(a, row, r0, k + u * kStep, acc[u]);
  }
  for (; k < a.kpad; k += kStep) chunk<R>(a, row, r0, k, acc[0]);
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    __m256i s = acc[0][r];
#pragma GCC unroll 4
    for (int v = 1; v < kU; ++v) s = _mm256_add_epi32(s, acc[v][r]);
    screen_keep(a, r0 + r, n, n0, hsum(s), best, count);
  }
}

}  // namespace

void screen_avx2(const ScreenArgs& a, int64_t n0, int64_t n1, float* best, int64_t* count) {
  for (int64_t r = 0; r < a.m; ++r) count[r] = 0;
  for (int64_t n = n0; n < n1; ++n) {  // one stream: two measured no faster here
    int64_t r = 0;
    for (; r + 2 <= a.m; r += 2) tile<2>(a, r, n, n0, best, count);
    for (; r < a.m; ++r) tile<1>(a, r, n, n0, best, count);
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
