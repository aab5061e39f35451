// Small AVX2 helpers shared by the fused-layer kernel TUs (layer_avx2.cpp, attend_avx2.cpp).
// Include ONLY between `#pragma GCC target("avx2,fma,f16c")` push/pop, inside namespace
// pdmesh_dense: every helper is `static inline`, so no AVX2 copy can be merged into a baseline
// TU by the linker (see dense.h).
//
// They compute exactly what avx512_util.h's helpers compute, 8 lanes at a time instead of 16:
// bf16 widening and RNE rounding are integer ops, exp256 runs exp512's operations in the same
// order (scalef becomes an exponent add, exact for the normal results the clamp guarantees),
// so the elementwise ops built on them are bit-identical across the two tiers.
#pragma once

// Up to 8 bf16 at p (left of them, zeros after) -> fp32.
static inline __m256 load_bf16_8(const uint16_t* p, int64_t left) {
  __m128i v;
  if (left >= 8) {
    v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t buf[8] = {};
    std::memcpy(buf, p, static_cast<size_t>(left) * sizeof(uint16_t));
    v = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// fp32 -> fp32 bit pattern rounded to bf16 precision (low 16 bits zero), RNE, NaN quiet.
static inline __m256i round_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_and_si256(r, top);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_and_si256(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), top);
  return _mm256_blendv_epi8(r, quiet, nan);
}

static inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(round_bits(v)); }

// Round v to bf16 and store its first `left` (up to 8) lanes at p.
static inline void store_bf16_8(uint16_t* p, __m256 v, int64_t left) {
  const __m256i hi = _mm256_srli_epi32(round_bits(v), 16);  // each lane < 65536: packus exact
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  if (left >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    alignas(16) uint16_t buf[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), packed);
    std::memcpy(p, buf, static_cast<size_t>(left) * sizeof(uint16_t));
  }
}

// Up to 8 fp32 at p (left of them, `fill` after) and the matching store.
static inline __m256 load_f32_8(const float* p, int64_t left, float fill) {
  if (left >= 8) return _mm256_loadu_ps(p);
  alignas(32) float buf[8] = {fill, fill, fill, fill, fill, fill, fill, fill};
  std::memcpy(buf, p, static_cast<size_t>(left) * sizeof(float));
  return _mm256_load_ps(buf);
}

static inline void store_f32_8(float* p, __m256 v, int64_t left) {
  if (left >= 8) {
    _mm256_storeu_ps(p, v);
  } else {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    std::memcpy(p, buf, static_cast<size_t>(left) * sizeof(float));
  }
}

// e^x as exp512 (avx512_util.h) computes it, operation for operation. The clamp keeps
// n = round(x / ln 2) in [-126, 128] and p * 2^n a normal float, where scalef(p, n) is exact:
// so is adding n to p's exponent field, which replaces it here.
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// Sum of 16 lanes held as lo (lanes 0..7) and hi (lanes 8..15), in _mm512_reduce_add_ps's
// order (GCC: upper + lower half, then 128-bit halves, then (t0 + t2) + (t1 + t3)).
static inline float reduce16_add(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  alignas(16) float t[4];
  _mm_store_ps(t, t6);
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// Position of row t and its flat cache slot (as avx512_util.h's locate).
static inline void locate(const StepArgs& s, int64_t t, int64_t* pos, int64_t* slot) {
  const int64_t b = s.token_seq[t];
  const int64_t q_len = s.query_start[b + 1] - s.query_start[b];
  *pos = s.context_lens[b] - q_len + (t - s.query_start[b]);
  const int64_t blk = s.block_tables[b * s.max_blocks + *pos / s.block_size];
  *slot = blk * s.block_size + *pos % s.block_size;
}
