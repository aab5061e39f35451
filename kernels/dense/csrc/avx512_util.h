// Small AVX-512 helpers shared by the fused-layer kernel TUs (layer_avx512.cpp,
// attend_avx512.cpp). Include ONLY between `#pragma GCC target("avx512f,...")` push/pop, inside
// namespace pdmesh_dense: every helper is `static inline`, so no AVX-512 copy can be merged
// into a baseline TU by the linker (see dense.h).
#pragma once

static inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// 16 bf16 at p (lanes past the mask read as 0) -> fp32.
static inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// fp32 -> fp32 bit pattern rounded to bf16 precision (low 16 bits zero), RNE, NaN quiet.
static inline __m512i round_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x00400000));
  return _mm512_mask_and_epi32(r, nan, quiet, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

static inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(round_bits(v)); }

static inline void store_bf16(uint16_t* p, __m512 v, __mmask16 m) {
  const __m512i hi = _mm512_srli_epi32(round_bits(v), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(hi));
}

// e^x, |relative error| < 2e-7 over the fp32 range (Cody-Waite reduction, degree-6 Taylor).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Position of row t and its flat cache slot.
static inline void locate(const StepArgs& s, int64_t t, int64_t* pos, int64_t* slot) {
  const int64_t b = s.token_seq[t];
  const int64_t q_len = s.query_start[b + 1] - s.query_start[b];
  *pos = s.context_lens[b] - q_len + (t - s.query_start[b]);
  const int64_t blk = s.block_tables[b * s.max_blocks + *pos / s.block_size];
  *slot = blk * s.block_size + *pos % s.block_size;
}

