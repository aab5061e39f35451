// AVX2 (+FMA, F16C) MXFP4 quantisation and dequantisation, bit for bit the scalar path's results.
// Only the code between the target pragmas is compiled for AVX2, so the build needs no -mavx2
// flag and the library still loads on any x86-64 CPU; avx2_table() checks the CPU at run time
// before handing these kernels out. No std:: template is used inside the AVX2 region.
#include <immintrin.h>

#include "kernels.h"
#include "avx2.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace pdmesh_mxfp4 {
namespace {

using avx2::Decoder;

inline __m256i set1(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

// Magnitudes in [0, 8) -> E2M1 magnitude codes, round to nearest even, saturating at 6 (code 7):
// the vector form of e2m1_magnitude_rne in scalar.cpp (step 0.5 / 1 / 2 on [0,2) / [2,4) / [4,8)).
// a * mult is exact (a power of two), so rounding it to an integer is the only rounding.
inline __m256i e2m1_magnitude_rne(__m256 a) {
  const __m256 lt2 = _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_LT_OQ);
  const __m256 lt4 = _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_LT_OQ);
  __m256 mult = _mm256_blendv_ps(_mm256_set1_ps(0.5f), _mm256_set1_ps(1.0f), lt4);
  mult = _mm256_blendv_ps(mult, _mm256_set1_ps(2.0f), lt2);
  const __m256 four_or_two = _mm256_blendv_ps(_mm256_castsi256_ps(set1(4)),
                                              _mm256_castsi256_ps(set1(2)), lt4);
  const __m256i offset = _mm256_castps_si256(_mm256_andnot_ps(lt2, four_or_two));  // 4, 2 or 0
  const __m256 t = _mm256_round_ps(_mm256_mul_ps(a, mult),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_min_epu32(_mm256_add_epi32(_mm256_cvttps_epi32(t), offset), set1(7));
}

// 32 codes, elements 8i .. 8i + 7 in c[i] (one per 32-bit lane) -> the block's 16 packed bytes.
inline __m128i pack_codes(const __m256i (&c)[4]) {
  // Per lane: bytes of elements 0-3, 8-11, 16-19, 24-27 (lane 0) and 4-7, 12-15, ... (lane 1).
  const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(c[0], c[1]),
                                            _mm256_packs_epi32(c[2], c[3]));
  const __m256i ordered =
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  // Word i = code 2i + 16 * code 2i+1 (bytes times 1 and 16, summed in pairs), then bytes.
  const __m256i pairs = _mm256_maddubs_epi16(ordered, _mm256_set1_epi16(0x1001));
  return _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
}

void quantize_avx2(const float* w, int64_t nblocks, uint8_t* blocks, uint8_t* scales) {
  const __m256i abs_mask = set1(0x7FFFFFFFu);
  for (int64_t b = 0; b < nblocks; ++b) {
    __m256i x[4], a[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock + 8 * i));
      a[i] = _mm256_and_si256(x[i], abs_mask);
    }
    // |x| bit patterns order like the values, with Inf and NaN above every finite value.
    const __m256i m8 = _mm256_max_epu32(_mm256_max_epu32(a[0], a[1]), _mm256_max_epu32(a[2], a[3]));
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
    const uint32_t exp = static_cast<uint32_t>(_mm_cvtsi128_si32(m4)) >> 23;
    __m128i packed = _mm_setzero_si128();
    uint32_t s = kNanScale;  // Inf or NaN in the block: NaN scale, codes zero
    if (exp != 0xFFu) {
      s = exp > 2u ? exp - 2u : 0u;  // floor(log2(amax)) - 2, clamped to 2^-127
      const __m256 inv_scale = _mm256_castsi256_ps(set1((254u - s) << 23));
      __m256i codes[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(x[i], 28), set1(8));
        const __m256 mag = _mm256_mul_ps(_mm256_castsi256_ps(a[i]), inv_scale);
        codes[i] = _mm256_or_si256(e2m1_magnitude_rne(mag), sign);
      }
      packed = pack_codes(codes);
    }
    scales[b] = static_cast<uint8_t>(s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(blocks + b * kBlockBytes), packed);
  }
}

// The 32 packed bytes of blocks b and b + 1 (lane 0: block b, lane 1: block b + 1); with
// second == false only block b exists and lane 1 is zeros (codes +0).
inline __m256i load_pair(const uint8_t* src, bool second) {
  if (second) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_set_m128i(_mm_setzero_si128(), first);
}

// 2^(s0-127) in lanes 0..3 and 2^(s1-127) in lanes 4..7 (kScaleTable: NaN for 255).
inline __m256 scale_pair(uint8_t s0, uint8_t s1) {
  const float* t = reinterpret_cast<const float*>(kScaleTable.bits);
  return _mm256_blend_ps(_mm256_broadcast_ss(t + s0), _mm256_broadcast_ss(t + s1), 0xF0);
}

inline void store(void* dst, __m128i v, bool stream) {
  if (stream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v);
  }
}

// Both lanes of v: lane 0 to dst (block b), lane 1 to dst + block_stride (block b + 1) if second.
template <typename T>
inline void store_lanes(T* dst, int64_t block_stride, __m256i v, bool second, bool stream) {
  store(dst, _mm256_castsi256_si128(v), stream);
  if (second) store(dst + block_stride, _mm256_extracti128_si256(v, 1), stream);
}

// Dequantisation takes two blocks at a time, one per 128-bit lane. The codes are first put in
// element order (per lane: e0 = elements 0..15, e1 = 16..31), so that the in-lane table lookups
// and unpacks leave each 128-bit piece of the results holding consecutive elements of one block.
// The block scale is applied by an fp32 multiplication of the exact unscaled values: the very
// product the scalar path computes, so every scale (subnormal, overflowing, NaN) is exact
// without a slow path.
struct PairCodes {
  __m256i e[2];  // per lane: elements 0..15 and 16..31 of the lane's block, one code per byte
  __m256 scale;
};

inline PairCodes pair_codes(const Decoder& dec, const uint8_t* blocks, const uint8_t* scales,
                            bool second) {
  __m256i lo, hi;
  dec.nibbles(load_pair(blocks, second), &lo, &hi);
  return {{_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)},
          scale_pair(scales[0], second ? scales[1] : uint8_t{127})};
}

inline void dequantize_pair_f32(const Decoder& dec, const uint8_t* blocks, const uint8_t* scales,
                                float* out, bool second, bool stream) {
  const PairCodes pc = pair_codes(dec, blocks, scales, second);
  const __m256i zero = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m256i words[2];  // elements 16 * half + 0..7 and + 8..15
    dec.words(pc.e[half], &words[0], &words[1]);
#pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) {
      float* dst = out + 16 * half + 8 * k;
      const __m256 v0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, words[k]));
      const __m256 v1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, words[k]));
      const __m256i f0 = _mm256_castps_si256(_mm256_mul_ps(v0, pc.scale));  // elements +0..3
      const __m256i f1 = _mm256_castps_si256(_mm256_mul_ps(v1, pc.scale));  // elements +4..7
      store_lanes(dst, kBlock, f0, second, stream);
      store_lanes(dst + 4, kBlock, f1, second, stream);
    }
  }
}

// The products are exact (<= 2 significant bits), so their high halves are the bf16 values:
// the even words are scaled in the top halves of 32-bit lanes and shifted back down, the odd
// ones scaled in place (their low halves stay zero).
inline void dequantize_pair_bf16(const Decoder& dec, const uint8_t* blocks, const uint8_t* scales,
                                 uint16_t* out, bool second, bool stream) {
  const PairCodes pc = pair_codes(dec, blocks, scales, second);
  const __m256i high = set1(0xFFFF0000u);
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m256i words[2];
    dec.words(pc.e[half], &words[0], &words[1]);
#pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) {
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words[k], 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words[k], high));
      const __m256i v = _mm256_or_si256(
          _mm256_castps_si256(_mm256_mul_ps(odd, pc.scale)),
          _mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(even, pc.scale)), 16));
      store_lanes(out + 16 * half + 8 * k, kBlock, v, second, stream);
    }
  }
}

// Blocks two at a time, then the odd one left (T: float or uint16_t output).
template <typename T, void (*kPair)(const Decoder&, const uint8_t*, const uint8_t*, T*, bool, bool)>
void dequantize_blocks(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks, T* out,
                       bool stream) {
  const Decoder dec = Decoder::make();
  for (int64_t b = 0; b < nblocks; b += 2) {
    kPair(dec, blocks + b * kBlockBytes, scales + b, out + b * kBlock, b + 1 < nblocks, stream);
  }
  if (stream) _mm_sfence();
}

void dequantize_f32_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                         float* out, bool stream) {
  dequantize_blocks<float, dequantize_pair_f32>(blocks, scales, nblocks, out, stream);
}

void dequantize_bf16_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t nblocks,
                          uint16_t* out, bool stream) {
  dequantize_blocks<uint16_t, dequantize_pair_bf16>(blocks, scales, nblocks, out, stream);
}

}  // namespace
}  // namespace pdmesh_mxfp4

#pragma GCC pop_options

namespace pdmesh_mxfp4 {

namespace {
const KernelTable kAvx2Table = {
    quantize_avx2, dequantize_f32_avx2, dequantize_bf16_avx2, linear_f32_avx2, nullptr, nullptr,
    avx2::kXOrder.at, linear_a8_avx2,
};
}  // namespace

const KernelTable* avx2_table() {
  const CpuFeatures& cpu = cpu_features();
  return cpu.avx2_tier() ? &kAvx2Table : nullptr;
}

}  // namespace pdmesh_mxfp4
