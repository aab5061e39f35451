// Fused MXFP4 GEMV/GEMM with int8 activations (W4A8), AVX2: y[m, n] = x[m, k] @ W[n, k].T
// (+ bias), where x has been quantised once per call to int8 per 32-block (a8.h: quantize_x_a8,
// the same bits on every path). Per (column, block) the products are exact integers:
//
//   codes  = the block's 16 bytes broadcast to both 128-bit lanes, lane 0 shifted by 0 and lane 1
//            by 4, masked: lane 0 holds the low nibbles (even elements), lane 1 the high ones
//   w      = vpshufb of the codes into 2 * E2M1 (0, 1, 2, 3, 4, 6, 8, 12 and negatives): int8
//   dot    = vpmaddubsw(|w|, sign(xq, w)) then vpmaddwd by ones: 8 int32 partial sums
//
// |w| <= 12 and |xq| <= 127, so a pair sums to at most 3048: vpmaddubsw never saturates. The 8
// partial sums become fp32 (exact: < 2^24) and take one FMA into the column's accumulator with
// the factor d_x * 2^(s - 128) (the 2 of the table folded into the scale). 9 instructions per 32
// weights against 14 for the fp32 kernel (avx2_linear.cpp), and x is read as 32 bytes per block
// rather than 128: on AMD Zen 3, where the fp32 kernel is bound by its decode instructions, not
// by DRAM, this is what llama.cpp's Q4 kernels do too.
//
// Every row runs the same instruction sequence whatever the tile, the batch or the column range,
// so results depend neither on the thread count nor on the other rows of the batch.
#include <immintrin.h>

#include "kernels.h"
#include "avx2.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_mxfp4 {
namespace {

// 2 * E2M1 value of every code, as int8, repeated in both 128-bit lanes for vpshufb.
struct Int8Table {
  alignas(32) int8_t v[32];
};
constexpr Int8Table make_int8_table() {
  Int8Table t{};
  constexpr int8_t kTwice[8] = {0, 1, 2, 3, 4, 6, 8, 12};
  for (int c = 0; c < 32; ++c) {
    const int mag = kTwice[c & 7];
    t.v[c] = static_cast<int8_t>((c & 8) ? -mag : mag);
  }
  return t;
}
constexpr Int8Table kInt8Table = make_int8_table();

// y[r0 .. r0 + R, n .. n + C] (+ bias).
template <int R, int C>
void a8_tile(const LinearArgs& a, int64_t r0, int64_t n) {
  const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kInt8Table.v));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i nibble_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i ones = _mm256_set1_epi16(1);
  const float* half_scale = reinterpret_cast<const float*>(kHalfScaleTable.bits);
  const int64_t nb = a.k / kBlock;
  const int8_t* q0 = a.xq + r0 * a.k;
  const float* d0 = a.xd + r0 * nb;
  const char* next = reinterpret_cast<const char*>(a.blocks + (n + C) * nb * kBlockBytes);
  __m256 acc[C][R];
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) acc[i / R][i % R] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    _mm_prefetch(next + j * C * kBlockBytes, _MM_HINT_T0);
    __m256i xq[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      xq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + r * a.k + j * kBlock));
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const int64_t at = (n + c) * nb + j;
      const __m256i bytes = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.blocks + at * kBlockBytes)));
      const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(bytes, nibble_shift), nibble);
      const __m256i w = _mm256_shuffle_epi8(table, codes);
      const __m256i w_abs = _mm256_sign_epi8(w, w);
      const float sw = half_scale[a.scales[at]];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xq[r], w));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[c][r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sw * d0[r * nb + j]), acc[c][r]);
      }
    }
  }
  avx2::store_tile<R, C>(a, r0, n, acc);
}

struct Tiles {
  template <int R, int C>
  static void tile(const LinearArgs& a, int64_t r0, int64_t n) { a8_tile<R, C>(a, r0, n); }
};

}  // namespace

void linear_a8_avx2(const LinearArgs& a, int64_t n0, int64_t n1) {
  avx2::drive_columns<Tiles>(a, n0, n1);
}

}  // namespace pdmesh_mxfp4

#pragma GCC pop_options
