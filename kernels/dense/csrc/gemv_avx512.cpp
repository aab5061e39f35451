// AVX-512 dense GEMV/GEMM for decode: y[m, n] = x[m, k] @ W[n, k].T (+ bias), W bf16 row-major,
// for the few rows (1..32) of a decode step. Bandwidth bound at small m: every weight is read
// once per call, streamed straight from the caller's tensor (no packed copy).
//
// Tiling: C weight rows (1, or 2 once x outgrows L1) against R rows of x, kU 16-lane fp32
// accumulators per pair (independent chains that hide the FMA / vdpbf16ps latency), reduced
// horizontally at the end of the K sweep; the weight rows stay in L1 while every row chunk of x
// passes over them (see kStreaming / kBlocked). K tails are masked loads (zeros in, so an Inf
// or NaN past a row cannot leak in); the FMA kernel's x is zero-padded instead.
// Summation order, fixed for every output whatever m, the tile or the thread split (batch
// invariance: a row gets the same bits alone or in any batch of up to 32, which speculative
// decoding's verify rows need to reproduce one-row decode exactly): full 32-element chunk i of
// the first kU * floor(full / kU) chunks goes into chain i % kU, the remaining full chunks and
// the K tail into chain 0; then ((c0 + c1) + c2) + c3, and one horizontal tree (reduce1 ==
// lane 0 of reduce4).
// FMA kernel (fp32 x): weights widened to fp32 by shifts (exact), fp32 FMA accumulation.
// dpbf16 kernel (bf16 x, avx512_bf16): vdpbf16ps, 32 MACs per instruction, exact bf16 products
// with fp32 accumulation; like every vdpbf16ps it treats subnormal inputs as zero.
// Only the code between the target pragmas is compiled for AVX-512, so the library still loads
// on any x86-64 CPU; ops.cpp checks path_unavailable() before calling in.
#include <immintrin.h>

#include "dense.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace pdmesh_dense {
namespace {

inline __mmask32 tail_mask(int64_t left) { return (__mmask32{1} << left) - 1; }  // left < 32

inline __m512i load_w(const uint16_t* p, bool tail, __mmask32 mask) {
  return tail ? _mm512_maskz_loadu_epi16(mask, p) : _mm512_loadu_si512(p);
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]: a transpose-and-add tree, cheaper than 4 reductions.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
  const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
  const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
  const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Software prefetch of each weight row kPrefetchBytes ahead, into L2. The L2 streamer stops at
// every 4 KiB boundary, so without it each core keeps only as many misses in flight as its
// fill buffers allow: measured ~9 GB/s per core on 4 KiB pages. With it, SmolLM2-135M's 30
// fused layers at m = 1, 2 threads (Intel SPR under KVM, 4 KiB pages): 11.5 ms -> 8.5 ms; 1-2
// KiB ahead was slower, 8 KiB slower still, and T1 (L2) was a little faster than T0. The
// weights are now on 2 MiB pages where the kernel grants them (kernels/huge_pages.py); there
// too, 2 KiB ahead lost to 4 KiB (AMD Zen 4, fresh-process A/B). Prefetching past the end of
// the matrix is harmless: a prefetch never faults.
constexpr int64_t kPrefetchBytes = 4096;

// One K chunk (32 elements at k) of weight rows n..n+C-1 against R rows of x. kDp: vdpbf16ps
// on bf16 x; else fp32 FMA on the even/odd halves of the weights against x reordered alike.
template <bool kDp, int R, int C>
inline void step(const GemvArgs& a, int64_t r0, int64_t n, int64_t k, bool tail,
                 __mmask32 mask, __m512 (&acc)[R][C]) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(a.w + (n + c) * a.ldw + k) + kPrefetchBytes,
                 _MM_HINT_T1);
  }
  if constexpr (kDp) {
    __m512i w[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) w[c] = load_w(a.w + (n + c) * a.ldw + k, tail, mask);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i xv = load_w(a.x_bf16 + (r0 + r) * a.k + k, tail, mask);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)w[c], (__m512bh)xv);
      }
    }
  } else {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 we[C], wo[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i w = load_w(a.w + (n + c) * a.ldw + k, tail, mask);
      we[c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));  // elements 0, 2, ...
      wo[c] = _mm512_castsi512_ps(_mm512_and_si512(w, hi));   // elements 1, 3, ...
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {  // x is zero-padded to kpad: no masks needed
      const __m512 xe = _mm512_loadu_ps(a.x + (r0 + r) * a.kpad + k);
      const __m512 xo = _mm512_loadu_ps(a.x + (r0 + r) * a.kpad + k + 16);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(we[c], xe, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(wo[c], xo, acc[r][c]);
      }
    }
  }
}

inline float bias_at(const GemvArgs& a, int64_t n) {
  if (a.bias == nullptr) return 0.0f;
  if (a.bias_bf16) return bits_to_f32(uint32_t{static_cast<const uint16_t*>(a.bias)[n]} << 16);
  return static_cast<const float*>(a.bias)[n];
}

inline void store_one(const GemvArgs& a, int64_t r, int64_t n, float sum) {
  const float v = sum + bias_at(a, n);
  if (a.y_bf16) {
    static_cast<uint16_t*>(a.y)[r * a.n + n] = f32_to_bf16_rne(v);
  } else {
    static_cast<float*>(a.y)[r * a.n + n] = v;
  }
}

// The same tree as reduce4 for one vector (lane 0 of reduce4(a, a, a, a)): every tile sums alike.
inline float reduce1(__m512 a) {
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b, b), _mm256_hadd_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// y[r0 : r0 + R, n : n + C] = horizontal sums of acc + bias.
template <int R, int C>
inline void store(const GemvArgs& a, int64_t r0, int64_t n, __m512 (&acc)[R][C]) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    alignas(16) float s[R];
    if constexpr (R % 4 == 0) {
#pragma GCC unroll 4
      for (int r = 0; r < R; r += 4) {
        _mm_store_ps(s + r, reduce4(acc[r][c], acc[r + 1][c], acc[r + 2][c], acc[r + 3][c]));
      }
    } else {
      for (int r = 0; r < R; ++r) s[r] = reduce1(acc[r][c]);
    }
    for (int r = 0; r < R; ++r) store_one(a, r0 + r, n + c, s[r]);
  }
}

// Chains per output: the same for every tile, so that the summation order is (header).
constexpr int kU = 4;

// y[r0 : r0 + R, n : n + C] over the whole K: kU independent accumulator sets over alternating
// chunks. R * C <= 4 keeps the 4 * R * C accumulators, C weights and an x in the 32 registers.
template <bool kDp, int R, int C>
void tile(const GemvArgs& a, int64_t r0, int64_t n) {
  constexpr int U = kU;
  static_assert(R * C <= 4, "accumulators would spill");
  __m512 acc[U][R][C];
#pragma GCC unroll 16
  for (int i = 0; i < U * R * C; ++i) acc[i / (R * C)][i / C % R][i % C] = _mm512_setzero_ps();
  const int64_t full = a.k / kChunk * kChunk;
  int64_t k = 0;
  for (; k + U * kChunk <= full; k += U * kChunk) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) step<kDp, R, C>(a, r0, n, k + u * kChunk, false, 0, acc[u]);
  }
  for (; k < full; k += kChunk) step<kDp, R, C>(a, r0, n, k, false, 0, acc[0]);
  if (full < a.k) step<kDp, R, C>(a, r0, n, full, true, tail_mask(a.k - full), acc[0]);
#pragma GCC unroll 4
  for (int u = 1; u < U; ++u) {
#pragma GCC unroll 16
    for (int i = 0; i < R * C; ++i) {
      acc[0][i / C][i % C] = _mm512_add_ps(acc[0][i / C][i % C], acc[u][i / C][i % C]);
    }
  }
  store<R, C>(a, r0, n, acc[0]);
}

using TileFn = void (*)(const GemvArgs&, int64_t, int64_t);

struct RowKernel {
  int64_t rows, cols;
  TileFn wide;    // rows x cols
  TileFn narrow;  // rows x 1, for a column remainder
};

// Two tile sets, widest row chunk first (m = 7 runs as 4 + 2 + 1).
// Streaming (x fits in L1): one weight row at a time, against every row chunk of x, so the
// weights stream in address order; interleaving even 2-4 rows' streams measured 1.5-2.5x
// slower at m = 1..8 on Zen 4 (its prefetchers then track each short row as its own stream).
// Blocked (x spills out of L1, so x loads cost more than the weight stream's order): 2 weight
// rows share each x load. (Wider tiles, 8 x 1 and 4 x 4, would need fewer chains per output,
// hence another summation order: the batch invariance above rules them out.)
template <bool kDp>
constexpr RowKernel kStreaming[3] = {
    {4, 1, tile<kDp, 4, 1>, tile<kDp, 4, 1>},
    {2, 1, tile<kDp, 2, 1>, tile<kDp, 2, 1>},
    {1, 1, tile<kDp, 1, 1>, tile<kDp, 1, 1>},
};

template <bool kDp>
constexpr RowKernel kBlocked[2] = {
    {2, 2, tile<kDp, 2, 2>, tile<kDp, 2, 1>},
    {1, 2, tile<kDp, 1, 2>, tile<kDp, 1, 1>},
};

// x bytes (as the kernel reads it) above which the blocked tiles win; L1d is 32 KiB. Measured
// at K = 576 / 1536, m = 8 / 16, fp32 and bf16 x.
constexpr int64_t kStreamingMaxXBytes = int64_t{20} << 10;

// Columns [b0, b0 + width) at a time: every row chunk passes over them while they are in L1.
template <int64_t N>
void run_table(const GemvArgs& a, int64_t n0, int64_t n1, const RowKernel (&table)[N],
               int64_t width) {
  for (int64_t b0 = n0; b0 < n1; b0 += width) {
    const int64_t b1 = b0 + width < n1 ? b0 + width : n1;
    int64_t r = 0;
    for (const RowKernel& rk : table) {
      for (; a.m - r >= rk.rows; r += rk.rows) {
        int64_t n = b0;
        for (; n + rk.cols <= b1; n += rk.cols) rk.wide(a, r, n);
        for (; n < b1; ++n) rk.narrow(a, r, n);
      }
    }
  }
}

template <bool kDp>
void run_tiles(const GemvArgs& a, int64_t n0, int64_t n1) {
  const int64_t x_bytes = kDp ? a.m * a.k * 2 : a.m * a.kpad * 4;
  if (a.m >= 4 && x_bytes > kStreamingMaxXBytes) {
    run_table(a, n0, n1, kBlocked<kDp>, 4);
  } else {  // one column at a time, in two streams (dense.h)
    for (int64_t i = 0; i < n1 - n0; ++i) {
      const int64_t n = stream_column(n0, n1, i);
      run_table(a, n, n + 1, kStreaming<kDp>, 1);
    }
  }
}

}  // namespace

void reorder_x_avx512(const float* xf, const uint16_t* xb, int64_t m, int64_t k, int64_t kpad,
                      float* out) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k0 = 0; k0 < kpad; k0 += kChunk) {
      const int64_t left = k - k0;
      const __mmask32 mask = left >= kChunk ? ~__mmask32{0} : tail_mask(left);
      float* dst = out + r * kpad + k0;
      if (xf != nullptr) {
        const float* src = xf + r * k + k0;
        const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), src);
        const __m512 up = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), src + 16);
        _mm512_storeu_ps(dst, _mm512_permutex2var_ps(lo, even, up));
        _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(lo, odd, up));
      } else {
        const __m512i v = _mm512_maskz_loadu_epi16(mask, xb + r * k + k0);
        _mm512_storeu_si512(dst, _mm512_slli_epi32(v, 16));
        _mm512_storeu_si512(dst + 16, _mm512_and_si512(v, hi));
      }
    }
  }
}

void gemv_fma_avx512(const GemvArgs& a, int64_t n0, int64_t n1) { run_tiles<false>(a, n0, n1); }

void gemv_dpbf16_avx512(const GemvArgs& a, int64_t n0, int64_t n1) { run_tiles<true>(a, n0, n1); }

}  // namespace pdmesh_dense

#pragma GCC pop_options
