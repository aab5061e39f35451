// AVX2 + FMA dense GEMV/GEMM for decode: y[m, n] = x[m, k] @ W[n, k].T (+ bias), W bf16
// row-major, for the few rows (1..32) of a decode step on CPUs without AVX-512 (AMD Zen 2/3,
// Intel Haswell .. Comet Lake). Bandwidth bound at small m: every weight is read once per call,
// streamed straight from the caller's tensor (no packed copy).
//
// Arithmetic: weights widened to fp32 by shifts (exact), x in fp32 (a bf16 x is widened exactly
// too), fp32 FMA accumulation; the output is rounded once (to bf16 for bf16 x).
// Summation order, fixed for every output whatever m, the tile or the thread split: K is cut
// into 16-element chunks; chunk i adds its 8 even-index products into chain E[i % 2] and its 8
// odd-index ones into chain O[i % 2] (8 fp32 lanes each); the output is
// hsum((E0 + O0) + (E1 + O1)) + bias, hsum(v) = ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)).
// So a row's result does not depend on the batch it came in (no load-dependent reduction
// order), and 1 or N threads agree bit for bit. The AVX-512 kernels sum over 16-lane vectors in
// a different order: the tiers agree to within fp32 accumulation error, not bit for bit.
//
// Four independent chains per output hide the FMA latency at m = 1; 1..3 x rows share each
// widened weight vector (streaming tiles), or, once x outgrows L1, each x load feeds two weight
// rows (blocked tiles). From 12 rows (16 for an LM head's slice) 2 x 2 tiles run the two
// chain sets one after the other (paired tiles), the same FMAs in the same order with half the
// accumulators live, so that each widened weight feeds two rows and each x load two columns.
// A K tail (k % 16 != 0) is copied into a zeroed 16-element buffer, so an Inf or NaN past a row
// cannot leak in; x is zero-padded to kpad by reorder_x_avx2.
// Only the code between the target pragmas is compiled for AVX2, so the library still loads on
// any x86-64 CPU; ops.cpp checks path_unavailable() before calling in.
#include <immintrin.h>

#include <cstring>

#include "dense.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_dense {
namespace {

// 16 bf16 weights at p; `left` (< 16) of them when tail, zeros after.
inline __m256i load_w(const uint16_t* p, bool tail, int64_t left) {
  if (!tail) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint16_t buf[kChunk2] = {};
  std::memcpy(buf, p, static_cast<size_t>(left) * sizeof(uint16_t));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}

// hsum of each of a0..a3 (the tree in the header comment) -> [s0, s1, s2, s3].
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The same tree for one vector (lane 0 of reduce4(a, ...)), so every tile sums alike.
inline float reduce1(__m256 a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, a), _mm256_hadd_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// Accumulator chains of an R x C tile: [u][0] even products, [u][1] odd ones, of chunks ≡ u.
template <int R, int C>
struct Acc {
  __m256 v[2][2][R][C];
};

// Chunk k (16 elements) of weight rows n..n+C-1 against R rows of x, into one chain set: its
// even-element chains e and odd-element chains o.
template <int R, int C>
inline void step(const GemvArgs& a, int64_t r0, int64_t n, int64_t k, bool tail, int64_t left,
                 __m256 (&e)[R][C], __m256 (&o)[R][C]) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 we[C], wo[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const __m256i w = load_w(a.w + (n + c) * a.ldw + k, tail, left);
    we[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));  // elements 0, 2, ...
    wo[c] = _mm256_castsi256_ps(_mm256_and_si256(w, hi));   // elements 1, 3, ...
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {  // x is zero-padded to kpad: no tail handling needed
    const __m256 xe = _mm256_loadu_ps(a.x + (r0 + r) * a.kpad + k);
    const __m256 xo = _mm256_loadu_ps(a.x + (r0 + r) * a.kpad + k + 8);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      e[r][c] = _mm256_fmadd_ps(we[c], xe, e[r][c]);
      o[r][c] = _mm256_fmadd_ps(wo[c], xo, o[r][c]);
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

// Reduces and stores an R x C tile's per-output vectors sum[r * C + c] = (E0 + O0) + (E1 + O1).
template <int R, int C>
inline void finish(const GemvArgs& a, int64_t r0, int64_t n, const __m256 (&sum)[R * C]) {
  int i = 0;
  for (; i + 4 <= R * C; i += 4) {
    alignas(16) float s[4];
    _mm_store_ps(s, reduce4(sum[i], sum[i + 1], sum[i + 2], sum[i + 3]));
    for (int j = 0; j < 4; ++j) store_one(a, r0 + (i + j) / C, n + (i + j) % C, s[j]);
  }
  for (; i < R * C; ++i) store_one(a, r0 + i / C, n + i % C, reduce1(sum[i]));
}

// y[r0 : r0 + R, n : n + C] over the whole K.
template <int R, int C>
void tile(const GemvArgs& a, int64_t r0, int64_t n) {
  Acc<R, C> acc;
#pragma GCC unroll 16
  for (int i = 0; i < 4 * R * C; ++i) {
    acc.v[i / (2 * R * C)][i / (R * C) % 2][i / C % R][i % C] = _mm256_setzero_ps();
  }
  const int64_t chunks = a.k / kChunk2, full = chunks * kChunk2;
  int64_t k = 0;
  for (; k + 2 * kChunk2 <= full; k += 2 * kChunk2) {
    step<R, C>(a, r0, n, k, false, 0, acc.v[0][0], acc.v[0][1]);
    step<R, C>(a, r0, n, k + kChunk2, false, 0, acc.v[1][0], acc.v[1][1]);
  }
  if (k < full) step<R, C>(a, r0, n, k, false, 0, acc.v[0][0], acc.v[0][1]);  // chunks - 1, even
  if (full < a.k) {
    auto& last = acc.v[chunks % 2];
    step<R, C>(a, r0, n, full, true, a.k - full, last[0], last[1]);
  }
  __m256 sum[R * C];
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) {
    const int r = i / C, c = i % C;
    sum[i] = _mm256_add_ps(_mm256_add_ps(acc.v[0][0][r][c], acc.v[0][1][r][c]),
                           _mm256_add_ps(acc.v[1][0][r][c], acc.v[1][1][r][c]));
  }
  finish<R, C>(a, r0, n, sum);
}

// One chain set of an R x C tile: chunks u, u + 2, ... (and the K tail when its index is ≡ u),
// in increasing order, exactly the FMAs `tile` does into chains [u][0] (e) and [u][1] (o).
template <int R, int C>
inline void chain_pass(const GemvArgs& a, int64_t r0, int64_t n, int u, __m256 (&e)[R][C],
                       __m256 (&o)[R][C]) {
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) e[i / C][i % C] = o[i / C][i % C] = _mm256_setzero_ps();
  const int64_t chunks = a.k / kChunk2, full = chunks * kChunk2;
  for (int64_t k = u * kChunk2; k < full; k += 2 * kChunk2) {
    step<R, C>(a, r0, n, k, false, 0, e, o);
  }
  if (full < a.k && chunks % 2 == u) step<R, C>(a, r0, n, full, true, a.k - full, e, o);
}

// y[r0 : r0 + R, n : n + C] as `tile` computes it, bit for bit, in two passes over K (chain set
// 0, then 1), so that only half the accumulators are live: R = C = 2 fits 16 registers where
// `tile` fits 3 outputs. Each pass reads every other 32 bytes of the tile's weight rows, which
// stay in L1 in between; more outputs per widened weight and per x load is what pays at m >= 12.
template <int R, int C>
void tile_two_pass(const GemvArgs& a, int64_t r0, int64_t n) {
  __m256 e[R][C], o[R][C], sum[R * C];
  chain_pass<R, C>(a, r0, n, 0, e, o);
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) sum[i] = _mm256_add_ps(e[i / C][i % C], o[i / C][i % C]);
  chain_pass<R, C>(a, r0, n, 1, e, o);
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) {
    sum[i] = _mm256_add_ps(sum[i], _mm256_add_ps(e[i / C][i % C], o[i / C][i % C]));
  }
  finish<R, C>(a, r0, n, sum);
}

using TileFn = void (*)(const GemvArgs&, int64_t, int64_t);

struct RowKernel {
  int64_t rows, cols;
  TileFn wide;    // rows x cols
  TileFn narrow;  // rows x 1, for a column remainder
};

// Streaming (x fits in L1): one weight row at a time against every row chunk of x, so the
// weights stream in address order (4 R accumulators + 2 widened weights + x <= 16 registers).
constexpr RowKernel kStreaming[3] = {
    {3, 1, tile<3, 1>, tile<3, 1>},
    {2, 1, tile<2, 1>, tile<2, 1>},
    {1, 1, tile<1, 1>, tile<1, 1>},
};

// Blocked (x spills out of L1): two weight rows share each x load, halving x traffic.
constexpr RowKernel kBlocked[1] = {
    {1, 2, tile<1, 2>, tile<1, 1>},
};

// Paired (from kPairedMinRows rows): 2 x 2 two-pass tiles, then a last odd row as 1 x 2.
constexpr RowKernel kPaired[2] = {
    {2, 2, tile_two_pass<2, 2>, tile_two_pass<2, 1>},
    {1, 2, tile_two_pass<1, 2>, tile_two_pass<1, 1>},
};
// Paired tiles pay once the FMAs, not the weight stream, bound the call: decode streams every
// layer's weights from DRAM, and below 12 rows the streaming and blocked tiles keep more of its
// bandwidth. A slice over kDramSliceBytes (an LM head: 56 MB for SmolLM2) waits for 16 rows.
// `benchmarks/dense.py --threads 2` (weights cycled past L3), AMD Zen 3, bf16 x, paired over the
// old tiles: SmolLM2's layer shapes 0.62-1.2x at 4 rows, 0.85-1.23x at 8, 0.99-1.33x at 12,
// 1.04-1.58x at 16 and 24; the 49152-column head 0.76x at 12 rows, 1.46-1.97x at 16 and 24.
constexpr int64_t kPairedMinRows = 12;
constexpr int64_t kPairedMinRowsFromDram = 16;
constexpr int64_t kDramSliceBytes = int64_t{8} << 20;

// x bytes (as the kernel reads it) above which the blocked tiles are used; L1d is 32 KiB.
constexpr int64_t kStreamingMaxXBytes = int64_t{20} << 10;

// Columns [b0, b0 + width) at a time: every row chunk passes over them while they are in L1.
// width divides kGroup, so a thread split (at kGroup multiples) never changes the tiles.
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

}  // namespace

void reorder_x_avx2(const float* xf, const uint16_t* xb, int64_t m, int64_t k, int64_t kpad,
                    float* out) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k0 = 0; k0 < kpad; k0 += kChunk2) {
      const int64_t left = k - k0 < kChunk2 ? k - k0 : kChunk2;
      float* dst = out + r * kpad + k0;
      if (xf != nullptr) {
        alignas(32) float buf[kChunk2] = {};
        const float* src = xf + r * k + k0;
        if (left < kChunk2) {
          std::memcpy(buf, src, static_cast<size_t>(left) * sizeof(float));
          src = buf;
        }
        const __m256 lo = _mm256_loadu_ps(src), up = _mm256_loadu_ps(src + 8);
        // shuffle: [lo0 lo2 up0 up2 | lo4 lo6 up4 up6]; the 64-bit permute puts lo before up.
        const __m256 ev = _mm256_shuffle_ps(lo, up, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 od = _mm256_shuffle_ps(lo, up, _MM_SHUFFLE(3, 1, 3, 1));
        _mm256_storeu_ps(dst, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev),
                                                                     _MM_SHUFFLE(3, 1, 2, 0))));
        _mm256_storeu_ps(dst + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(
                                      _mm256_castps_pd(od), _MM_SHUFFLE(3, 1, 2, 0))));
      } else {
        const __m256i v = load_w(xb + r * k + k0, left < kChunk2, left);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_slli_epi32(v, 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), _mm256_and_si256(v, hi));
      }
    }
  }
}

void gemv_fma_avx2(const GemvArgs& a, int64_t n0, int64_t n1) {
  const int64_t x_bytes = a.m * a.kpad * 4;
  const bool from_dram = (n1 - n0) * a.ldw * 2 > kDramSliceBytes;
  if (a.m >= (from_dram ? kPairedMinRowsFromDram : kPairedMinRows)) {
    run_table(a, n0, n1, kPaired, 8);
  } else if (a.m >= 2 && x_bytes > kStreamingMaxXBytes) {
    run_table(a, n0, n1, kBlocked, 8);
  } else {  // one column at a time, in two streams (dense.h)
    for (int64_t i = 0; i < n1 - n0; ++i) {
      const int64_t n = stream_column(n0, n1, i);
      run_table(a, n, n + 1, kStreaming, 1);
    }
  }
}

}  // namespace pdmesh_dense

#pragma GCC pop_options
