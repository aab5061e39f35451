// AVX-512 MXFP4 kernels. Only the code between the target pragmas is compiled for AVX-512, so
// the build needs no -mavx512* flag and the library still loads on any x86-64 CPU;
// avx512_table() / avx512_bf16_table() check the CPU at run time before handing these kernels
// out. No std:: template is used inside the AVX-512 region (its instantiation could be merged
// with a baseline copy).
#include <immintrin.h>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace pdmesh_mxfp4 {
namespace {

inline __m512i set1(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }

inline __m512 scale_ps(uint32_t s) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kScaleTable.bits[s])));
}

// Magnitudes in [0, 8) -> E2M1 magnitude codes, round to nearest even, saturating at 6 (code 7):
// the vector form of e2m1_magnitude_rne in scalar.cpp (step 0.5 / 1 / 2 on [0,2) / [2,4) / [4,8)).
inline __m512i e2m1_magnitude_rne(__m512 a) {
  const __mmask16 lt2 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_LT_OQ);
  const __mmask16 lt4 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_LT_OQ);
  __m512 mult = _mm512_mask_mov_ps(_mm512_set1_ps(0.5f), lt4, _mm512_set1_ps(1.0f));
  mult = _mm512_mask_mov_ps(mult, lt2, _mm512_set1_ps(2.0f));
  __m512i offset = _mm512_mask_mov_epi32(set1(4), lt4, set1(2));
  offset = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~lt2), offset);
  const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, mult),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_min_epu32(_mm512_add_epi32(q, offset), set1(7));
}

// 16 codes (elements 2i in the low, 2i+1 in the high half of each 64-bit lane) -> 8 bytes.
inline __m128i pack_nibbles(__m512i codes) {
  return _mm512_cvtepi64_epi8(_mm512_or_si512(codes, _mm512_srli_epi64(codes, 28)));
}

void quantize_avx512(const float* w, int64_t nblocks, uint8_t* blocks, uint8_t* scales) {
  const __m512i abs_mask = set1(0x7FFFFFFFu);
  for (int64_t b = 0; b < nblocks; ++b) {
    const __m512i x0 = _mm512_loadu_si512(w + b * kBlock);
    const __m512i x1 = _mm512_loadu_si512(w + b * kBlock + 16);
    const __m512i a0 = _mm512_and_si512(x0, abs_mask);
    const __m512i a1 = _mm512_and_si512(x1, abs_mask);
    // |x| bit patterns order like the values, with Inf and NaN above every finite value.
    const uint32_t exp = _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1)) >> 23;
    __m128i packed = _mm_setzero_si128();
    uint32_t s = kNanScale;  // Inf or NaN in the block: NaN scale, codes zero
    if (exp != 0xFFu) {
      s = exp > 2u ? exp - 2u : 0u;  // floor(log2(amax)) - 2, clamped to 2^-127
      const __m512 inv_scale = _mm512_castsi512_ps(set1((254u - s) << 23));
      const __m512i sign0 = _mm512_and_si512(_mm512_srli_epi32(x0, 28), set1(8));
      const __m512i sign1 = _mm512_and_si512(_mm512_srli_epi32(x1, 28), set1(8));
      const __m512i c0 = _mm512_or_si512(
          e2m1_magnitude_rne(_mm512_mul_ps(_mm512_castsi512_ps(a0), inv_scale)), sign0);
      const __m512i c1 = _mm512_or_si512(
          e2m1_magnitude_rne(_mm512_mul_ps(_mm512_castsi512_ps(a1), inv_scale)), sign1);
      packed = _mm_unpacklo_epi64(pack_nibbles(c0), pack_nibbles(c1));
    }
    scales[b] = static_cast<uint8_t>(s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(blocks + b * kBlockBytes), packed);
  }
}

// Dequantisation works on the 32 elements of a block at once in 16-bit lanes: every MXFP4 value
// has <= 2 significant bits, so its fp32 pattern is zero below bit 16 and its high half is
// exactly its bf16 pattern.

// The block's 32 codes in element order, one per 16-bit lane in bits 3..0 (bits above: junk).
// Element e is nibble e % 4 of 16-bit word e / 4 of the packed bytes: vpermw, then vpsrlvw.
inline __m512i block_codes(const uint8_t* src) {
  const __m512i word_of = _mm512_set_epi16(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4,
                                           3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i shift = _mm512_set_epi16(12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0,
                                         12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0);
  const __m512i bytes = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm512_srlv_epi16(_mm512_permutexvar_epi16(word_of, bytes), shift);
}

// 32 codes -> bf16 patterns of code * 2^(s-127), valid for kMinFastScale <= s <= kMaxFastScale
// (no result overflows or is subnormal). The 16 unscaled values (kBf16Table, built by the bit
// converter e2m1_to_f32_bits) get the block scale folded into their exponent field by one
// masked add of (s - 127) << 7: the mask is the 14 non-zero codes, so +0 and -0 stay exactly
// +0 and -0 (the zero trap), and no code can carry into the sign. vpermw then looks the block's
// 32 codes up: three instructions per block where the per-lane conversion took nine.
constexpr uint32_t kMinFastScale = 2;    // 0.5 * 2^(2-127) = 2^-126, the smallest fp32 normal
constexpr uint32_t kMaxFastScale = 252;  // 6 * 2^(252-127) < 2^128; s = 253 overflows
constexpr __mmask32 kNonzeroCodes = 0xFEFEFEFEu;  // table word w holds code w & 15: +-0 at 0, 8
inline __m512i e2m1_to_bf16(__m512i code, uint32_t s) {
  const __m512i table = _mm512_load_si512(kBf16Table.bits);
  const __m512i bias = _mm512_set1_epi16(static_cast<short>((static_cast<int>(s) - 127) * 128));
  return _mm512_permutexvar_epi16(code, _mm512_mask_add_epi16(table, kNonzeroCodes, table, bias));
}

// High halves (32 words) -> fp32 words: elements 0..15 (lo) and 16..31 (hi), low halves zero.
inline void widen(__m512i halves, __m512i* lo, __m512i* hi) {
  const __m512i lo_idx = _mm512_set_epi16(47, 0, 46, 0, 45, 0, 44, 0, 43, 0, 42, 0, 41, 0, 40, 0,
                                          39, 0, 38, 0, 37, 0, 36, 0, 35, 0, 34, 0, 33, 0, 32, 0);
  const __m512i hi_idx = _mm512_set_epi16(63, 0, 62, 0, 61, 0, 60, 0, 59, 0, 58, 0, 57, 0, 56, 0,
                                          55, 0, 54, 0, 53, 0, 52, 0, 51, 0, 50, 0, 49, 0, 48, 0);
  const __m512i zero = _mm512_setzero_si512();
  *lo = _mm512_permutex2var_epi16(zero, lo_idx, halves);
  *hi = _mm512_permutex2var_epi16(zero, hi_idx, halves);
}

// The scales outside the fast range (0, 1, 253, 254, 255: subnormal, overflowing or NaN results)
// multiply the unscaled values (bias of s = 127) by the fp32 scale, as the scalar path does.
inline void block_f32_slow(__m512i codes, uint32_t s, __m512i* lo, __m512i* hi) {
  widen(e2m1_to_bf16(codes, 127), lo, hi);
  const __m512 scale = scale_ps(s);
  *lo = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(*lo), scale));
  *hi = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(*hi), scale));
}

inline bool fast_scale(uint32_t s) { return s - kMinFastScale <= kMaxFastScale - kMinFastScale; }

inline void store(void* dst, __m512i v, bool stream) {
  if (stream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  } else {
    _mm512_storeu_si512(dst, v);
  }
}

void dequantize_f32_avx512(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                           float* out, bool stream) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const __m512i codes = block_codes(blocks + b * kBlockBytes);
    const uint32_t s = scales[b];
    __m512i lo, hi;
    if (fast_scale(s)) {
      widen(e2m1_to_bf16(codes, s), &lo, &hi);
    } else {
      block_f32_slow(codes, s, &lo, &hi);
    }
    store(out + b * kBlock, lo, stream);
    store(out + b * kBlock + 16, hi, stream);
  }
  if (stream) _mm_sfence();
}

void dequantize_bf16_avx512(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                            uint16_t* out, bool stream) {
  const __m512i high_halves = _mm512_set_epi16(
      63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
      31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t b = 0; b < nblocks; ++b) {
    const __m512i codes = block_codes(blocks + b * kBlockBytes);
    const uint32_t s = scales[b];
    __m512i v;
    if (fast_scale(s)) {
      v = e2m1_to_bf16(codes, s);
    } else {  // exact fp32 products, so their high halves are the bf16 values
      __m512i lo, hi;
      block_f32_slow(codes, s, &lo, &hi);
      v = _mm512_permutex2var_epi16(lo, high_halves, hi);
    }
    store(out + b * kBlock, v, stream);
  }
  if (stream) _mm_sfence();
}

}  // namespace
}  // namespace pdmesh_mxfp4

#pragma GCC pop_options

namespace pdmesh_mxfp4 {

namespace {
const KernelTable kAvx512Table = {
    quantize_avx512, dequantize_f32_avx512, dequantize_bf16_avx512, linear_f32_avx512, nullptr,
    nullptr, nullptr, linear_a8_avx2,
};
const KernelTable kAvx512Bf16Table = {
    quantize_avx512, dequantize_f32_avx512, dequantize_bf16_avx512, linear_f32_avx512,
    linear_bf16_avx512, pair_x_bf16_avx512, nullptr, linear_a8_avx2,
};
}  // namespace

// Int8 activations run avx2_a8.cpp's kernel on these paths too: every AVX-512 CPU has AVX2.
// Path 1 never uses vdpbf16ps, even on a CPU that has it (bf16 x is widened to fp32 there).
const KernelTable* avx512_table() { return cpu_features().avx512 ? &kAvx512Table : nullptr; }

const KernelTable* avx512_bf16_table() {
  const CpuFeatures& cpu = cpu_features();
  return cpu.avx512 && cpu.avx512_bf16 ? &kAvx512Bf16Table : nullptr;
}

}  // namespace pdmesh_mxfp4
