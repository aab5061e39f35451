// AVX2 helpers shared by avx2.cpp (quantise, dequantise), avx2_linear.cpp and avx2_a8.cpp (the
// fused linears, fp32 and int8 activations).
// Include after <immintrin.h> and kernels.h. Everything here has internal linkage (static, or an
// unnamed namespace) and is compiled for AVX2 through its own target region, like the TUs that
// include it: see kernels.h for why no AVX2 function may have external (COMDAT) linkage.
//
// Decoding. AVX2 has no 16-bit permute, but vpshufb looks 32 byte indices up in a 16-byte table
// (per 128-bit lane). Every E2M1 value is exact in bf16, so two vpshufb of the same codes, one
// into the low and one into the high bytes of the 16 bf16 patterns, and one byte interleave
// give 16 bf16 weights; a bf16 pattern shifted to the top of a 32-bit lane is the fp32 value.
// The tables are unscaled: the block's power-of-two scale is applied afterwards by one fp32
// multiplication, on the values (dequantise) or on the block's partial dot product (linear).
#pragma once

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_mxfp4 {
namespace avx2 {
namespace {

// Low and high bytes of the bf16 pattern of every code (built by the bit converter
// e2m1_to_f32_bits), repeated in both 128-bit lanes for vpshufb.
struct ByteTables {
  alignas(32) uint8_t lo[32];
  alignas(32) uint8_t hi[32];
};
constexpr ByteTables make_byte_tables() {
  ByteTables t{};
  for (uint32_t c = 0; c < 32; ++c) {
    const uint32_t bf16 = e2m1_to_f32_bits(c & 15u) >> 16;
    t.lo[c] = static_cast<uint8_t>(bf16 & 0xFFu);
    t.hi[c] = static_cast<uint8_t>(bf16 >> 8);
  }
  return t;
}
constexpr ByteTables kByteTables = make_byte_tables();

// The two tables and the nibble mask, loaded once per kernel call (they stay in registers).
struct Decoder {
  __m256i lo_table, hi_table;
  __m256i nibble;  // 0x0F in every byte

  static Decoder make() {
    return {_mm256_load_si256(reinterpret_cast<const __m256i*>(kByteTables.lo)),
            _mm256_load_si256(reinterpret_cast<const __m256i*>(kByteTables.hi)),
            _mm256_set1_epi8(0x0F)};
  }

  // Packed bytes -> the codes of their low nibbles (element 2i at byte i) and high nibbles
  // (element 2i + 1), one code per byte.
  inline void nibbles(__m256i bytes, __m256i* lo, __m256i* hi) const {
    *lo = _mm256_and_si256(bytes, nibble);
    // The 16-bit shift pulls the next byte's low bits into bits 7..4; the mask drops them.
    *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
  }

  // 32 codes (one per byte, bits 7..4 zero) -> their unscaled bf16 patterns: per 128-bit lane,
  // `first` holds the words of codes 0..7 of the lane and `second` those of codes 8..15.
  inline void words(__m256i codes, __m256i* first, __m256i* second) const {
    const __m256i lo = _mm256_shuffle_epi8(lo_table, codes);
    const __m256i hi = _mm256_shuffle_epi8(hi_table, codes);
    *first = _mm256_unpacklo_epi8(lo, hi);
    *second = _mm256_unpackhi_epi8(lo, hi);
  }
};

// The order the fused linear decodes a block's 32 weights in, which x is laid out in
// (KernelTable::x_order). One block is broadcast to both 128-bit lanes; lane 0 keeps the low
// nibbles (element 2i at byte i) and lane 1 the high nibbles (element 2i + 1). `words` then
// gives, per lane, the bf16 patterns of bytes 0..7 (h = 0) and 8..15 (h = 1); shifting each
// 32-bit lane's low word to the top gives the even words (p = 0), masking the low word away
// the odd ones (p = 1). So vector v = 2h + p holds in lane 4o + q (o: 0 low, 1 high nibble)
// the element of byte 8h + 2q + p, nibble o: element 16h + 4q + 2p + o.
struct XOrder {
  uint8_t at[32];
};
constexpr XOrder make_x_order() {
  XOrder t{};
  for (int i = 0; i < 32; ++i) {
    const int v = i / 8, lane = i % 8;
    const int h = v >> 1, p = v & 1, o = lane >> 2, q = lane & 3;
    t.at[i] = static_cast<uint8_t>(16 * h + 4 * q + 2 * p + o);
  }
  return t;
}
constexpr XOrder kXOrder = make_x_order();

// The 8 lanes' sum, in one fixed order (the linears' horizontal tree).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[r0 + r, n + c] = sum of acc[c][r]'s lanes (+ bias).
template <int R, int C>
inline void store_tile(const LinearArgs& a, int64_t r0, int64_t n, const __m256 (&acc)[C][R]) {
  float* y = static_cast<float*>(a.y);
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) {
    const int c = i / R, r = i % R;
    y[a.y_at(r0 + r, n + c)] = hsum(acc[c][r]) + (a.bias ? a.bias[n + c] : 0.0f);
  }
}

// The column driver of both fused linears (avx2_linear.cpp: fp32 x; avx2_a8.cpp: int8 x).
// Tiles::tile<R, C>(a, r0, n) computes y[r0 .. r0 + R, n .. n + C]. Columns go in groups whose
// packed bytes stay in L1 while every row chunk passes over them: 4-row tiles of one column,
// then 3, 2 or 1 rows; a lone row takes kSingleRowColumns columns side by side so that their
// independent FMA chains overlap.
constexpr int64_t kColumnGroup = 16;
constexpr int kMaxRows = 4;
constexpr int kSingleRowColumns = 4;

template <class Tiles, int R, int C>
void columns(const LinearArgs& a, int64_t r0, int64_t g0, int64_t g1) {
  int64_t n = g0;
  for (; n + C <= g1; n += C) Tiles::template tile<R, C>(a, r0, n);
  for (; n < g1; ++n) Tiles::template tile<R, 1>(a, r0, n);
}

template <class Tiles>
void drive_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  for (int64_t g0 = n0; g0 < n1; g0 += kColumnGroup) {
    const int64_t g1 = g0 + kColumnGroup < n1 ? g0 + kColumnGroup : n1;
    int64_t r = 0;
    for (; a.m - r >= kMaxRows; r += kMaxRows) columns<Tiles, kMaxRows, 1>(a, r, g0, g1);
    switch (a.m - r) {
      case 3: columns<Tiles, 3, 1>(a, r, g0, g1); break;
      case 2: columns<Tiles, 2, 1>(a, r, g0, g1); break;
      case 1: columns<Tiles, 1, kSingleRowColumns>(a, r, g0, g1); break;
      default: break;
    }
  }
}

}  // namespace
}  // namespace avx2
}  // namespace pdmesh_mxfp4

#pragma GCC pop_options
