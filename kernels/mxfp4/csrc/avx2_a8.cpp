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

// kernels.h quantize_x_a8, the scalar loop's bits: 1 / d and x * inv are the same IEEE fp32
// roundings, and vcvtps2dq rounds half to even under the default MXCSR, as the scalar path's
// 1.5 * 2^23 trick does for |v| <= 127.5. v[i] holds elements 8i .. 8i + 7 of the block.
inline void quantize_block_a8(const __m256 (&v)[4], int8_t* q, float* d) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i m = _mm256_and_si256(_mm256_castps_si256(v[0]), abs_mask);
#pragma GCC unroll 3
  for (int i = 1; i < 4; ++i) {
    m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(v[i]), abs_mask));
  }
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
  const uint32_t amax = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
  if (amax >= 0x7F800000u || amax == 0) {  // Inf / NaN, or all zero: see kernels.h
    *d = amax == 0 ? 0.0f : bits_to_f32(0x7FC00000u);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
    return;
  }
  *d = bits_to_f32(amax) / 127.0f;
  const __m256 inv = _mm256_set1_ps(1.0f / *d);
  __m256i r[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // Per 128-bit lane after the two packs: lane 0 elements 0-3, 8-11, 16-19, 24-27, lane 1 the
  // others; the dword permute restores 0..31, the byte shuffle puts each lane's even elements
  // before its odd ones, and the qword permute gathers all evens, then all odds.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                            _mm256_packs_epi32(r[2], r[3]));
  const __m256i ordered =
      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i split = _mm256_shuffle_epi8(
      ordered, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permute4x64_epi64(split, 0xD8));  // qwords 0, 2, 1, 3
}

}  // namespace

void linear_a8_avx2(const LinearArgs& a, int64_t n0, int64_t n1) {
  avx2::drive_columns<Tiles>(a, n0, n1);
}

void quantize_x_a8_avx2(const float* x, int64_t nblocks, int8_t* q, float* d) {
  for (int64_t b = 0; b < nblocks; ++b) {
    __m256 v[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
    quantize_block_a8(v, q + b * kBlock, d + b);
  }
}

void quantize_x_a8_bf16_avx2(const uint16_t* x, int64_t nblocks, int8_t* q, float* d) {
  for (int64_t b = 0; b < nblocks; ++b) {
    __m256 v[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // bf16 -> fp32: the pattern in the top half of each lane
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + b * kBlock + 8 * i));
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    quantize_block_a8(v, q + b * kBlock, d + b);
  }
}

}  // namespace pdmesh_mxfp4

#pragma GCC pop_options
