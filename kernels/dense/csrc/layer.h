// Fused decoder-layer pieces for CPU decode: the plain-C++ interface between the binding TU
// (layer_ops.cpp, which owns threading and tensors) and the kernel TUs, one set per tier
// (layer_avx512.cpp + attend_avx512.cpp, layer_avx2.cpp + attend_avx2.cpp; LayerKernels below).
// No torch here (see dense.h for why the kernel TUs stay free of ATen headers).
//
// Every bf16 value is its raw 16-bit pattern (uint16_t). Numerics follow HF transformers in
// bf16: each elementwise op computes in fp32 and rounds to bf16 (round to nearest even), so
// the fused layer reproduces the plain-torch layer (shared/model/llama.py) to within the
// order of fp32 summations.
#pragma once

#include <cstdint>

namespace pdmesh_dense {

// One step's batch: B sequences, each with q_len new tokens packed sequence-major into T rows,
// on top of (context_len - q_len) tokens already in the paged cache. Token i of sequence b is
// at position context_len[b] - q_len + i and lives in cache slot
// block_tables[b, pos / block_size] * block_size + pos % block_size.
struct StepArgs {
  const int32_t* block_tables;  // [B, max_blocks]
  const int32_t* context_lens;  // [B] tokens after this step (computed + new)
  const int32_t* query_start;   // [B + 1] row of each sequence's first new token; [B] = T
  const int32_t* token_seq;     // [T] sequence of each row
  int64_t num_seqs, max_blocks, block_size;
};

// Paged-cache geometry of one layer: k/v [num_blocks, block_size, kv_heads, head_dim] bf16.
// RoPE rotates the first rotary_dim (even, <= head_dim) channels of each q / k head and
// passes the rest through (partial rotary, HF Phi3); rotary_dim == head_dim rotates it all.
// window > 0: a sliding-window layer, whose query at position p attends to keys
// p - window < j <= p only (HF semantics); 0: full causal attention (keys 0..p).
struct CacheArgs {
  uint16_t* k;
  uint16_t* v;
  int64_t num_heads, num_kv_heads, head_dim, rotary_dim;
  int64_t window = 0;
};

// The first key the query at position pos attends to in a layer of cache c.
static inline int64_t first_key(const CacheArgs& c, int64_t pos) {
  return c.window > 0 && pos + 1 > c.window ? pos + 1 - c.window : 0;
}

// out[t, :] = bf16(bf16(x[t] * rsqrt(mean(x[t]^2) + eps)) * w) for rows [t0, t1).
void rms_norm_avx512(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* out,
                     int64_t t0, int64_t t1);

// h[i] = bf16(h[i] + y[i]) for i in [0, n): the residual add.
void add_inplace_avx512(uint16_t* h, const uint16_t* y, int64_t n);

// act[t, i] = bf16(bf16(silu(gu[t, i])) * gu[t, inter + i]) for rows [t0, t1); gu is
// [T, 2 * inter] (gate then up), act [T, inter].
void silu_mul_avx512(const uint16_t* gu, int64_t inter, uint16_t* act, int64_t t0, int64_t t1);

// RoPE (HF rotate-half over each head's first R = rotary_dim channels, bf16 rounding per op,
// cos_sin [P, R] = cos | sin halves; channels R..D-1 copied as they are) of rows [t0, t1) of
// qkv [T, (H + 2 KVH) D]: rotated q -> q_out [T, H D]; rotated k and v -> cache.
void rope_store_avx512(const uint16_t* qkv, const uint16_t* cos_sin, const StepArgs& s,
                       const CacheArgs& c, uint16_t* q_out, int64_t t0, int64_t t1);

// Causal attention over the paged cache for work items [i0, i1), item = row * KVH + kv head:
// the H / KVH query heads of that kv head attend to positions first_key(c, pos)..pos of their
// sequence (keys before that are never read: their blocks may have been reused).
// q [T, H D] bf16 -> out [T, H D] bf16; fp32 math (scores, softmax, weighted sum).
// scratch: (H / KVH) * (max context + D) floats and offsets: (max context) int64, both owned
// by the calling thread. (attend_avx512.cpp, attend_avx2.cpp)
void attend_avx512(const uint16_t* q, const StepArgs& s, const CacheArgs& c, float scale,
                   uint16_t* out, float* scratch, int64_t* offsets, int64_t i0, int64_t i1);

// The AVX2 versions of the above, same contracts (layer_avx2.cpp, attend_avx2.cpp). The
// elementwise ones are bit-identical to the AVX-512 ones; attention agrees within fp32
// summation error (its dot products sum 8 lanes, not 16).
void rms_norm_avx2(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* out,
                   int64_t t0, int64_t t1);
void add_inplace_avx2(uint16_t* h, const uint16_t* y, int64_t n);
void silu_mul_avx2(const uint16_t* gu, int64_t inter, uint16_t* act, int64_t t0, int64_t t1);
void rope_store_avx2(const uint16_t* qkv, const uint16_t* cos_sin, const StepArgs& s,
                     const CacheArgs& c, uint16_t* q_out, int64_t t0, int64_t t1);
void attend_avx2(const uint16_t* q, const StepArgs& s, const CacheArgs& c, float scale,
                 uint16_t* out, float* scratch, int64_t* offsets, int64_t i0, int64_t i1);

// Causal attention of one sequence's q_len new rows over its whole context (ctx keys, the last
// q_len of them the new rows': row t sits at position ctx - q_len + t), as a flash kernel:
// bf16 dot products (flash_avx512bf16.cpp; call only with avx512_bf16) or fp32 FMA
// (flash_avx2.cpp; call only with AVX2 and FMA). The caller packs the context's K / V once
// (flash_pack_*, items [0, KVH * flash_padded_keys(ctx) / 16)) into buffers of
// flash_packed_elems(a) elements of LayerKernels::flash_packed_bytes each, then runs every
// work item (flash_item_*, [0, flash_items(a)), any order, any thread) with its own scratch of
// flash_scratch_floats(a) floats. q / out [q_len, H, D] bf16; D a multiple of 32, at most
// kFlashMaxHeadDim; H / KVH at most kFlashMaxGroup.
constexpr int64_t kFlashKeys = 128;       // keys per softmax block
constexpr int64_t kFlashTokens = 16;      // query tokens per work item of the bf16 kernel
constexpr int64_t kFlashMaxTokens = 32;   // ... and at most, of any kernel (FlashArgs::tokens)
constexpr int64_t kFlashMaxHeadDim = 256;
constexpr int64_t kFlashMaxGroup = 16;
struct FlashArgs {
  const uint16_t* q;
  uint16_t* out;
  const uint16_t* k_cache;      // this layer's K [num_blocks, block_size, KVH, D]
  const uint16_t* v_cache;      // and V
  const int32_t* block_table;   // the sequence's blocks
  int64_t block_size, q_len, ctx, heads, kv_heads, d;
  float scale;
  int64_t tokens;  // query tokens per work item (LayerKernels::flash_item_rows)
  void* k_packed;  // the kernel's own layout (its file's header): bf16 pairs or fp32
  void* v_packed;
};
static inline int64_t flash_padded_keys(int64_t ctx) {
  return (ctx + kFlashKeys - 1) / kFlashKeys * kFlashKeys;
}
static inline int64_t flash_packed_elems(const FlashArgs& a) {  // each of K and V
  return a.kv_heads * flash_padded_keys(a.ctx) * a.d;
}
static inline int64_t flash_query_blocks(const FlashArgs& a) {
  return (a.q_len + a.tokens - 1) / a.tokens;
}
static inline int64_t flash_items(const FlashArgs& a) { return a.kv_heads * flash_query_blocks(a); }
// Enough for either kernel: rows padded to a multiple of 24 (the bf16 kernel pads to 8, the
// fp32 one to 6) x (scores, probabilities, Q, O, m, l).
static inline int64_t flash_scratch_floats(const FlashArgs& a) {
  const int64_t rows = (a.tokens * (a.heads / a.kv_heads) + 23) / 24 * 24;
  return rows * (2 * kFlashKeys + 2 * a.d + 2);
}
void flash_pack_avx512bf16(const FlashArgs& a, int64_t i0, int64_t i1);
void flash_item_avx512bf16(const FlashArgs& a, int64_t item, float* scratch);
void flash_pack_avx2(const FlashArgs& a, int64_t i0, int64_t i1);
void flash_item_avx2(const FlashArgs& a, int64_t item, float* scratch);

// One tier's kernels, chosen once per op call from its `path` (layer_ops.cpp).
struct LayerKernels {
  void (*rms_norm)(const uint16_t*, const uint16_t*, int64_t, float, uint16_t*, int64_t,
                   int64_t);
  void (*add_inplace)(uint16_t*, const uint16_t*, int64_t);
  void (*silu_mul)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
  void (*rope_store)(const uint16_t*, const uint16_t*, const StepArgs&, const CacheArgs&,
                     uint16_t*, int64_t, int64_t);
  void (*attend)(const uint16_t*, const StepArgs&, const CacheArgs&, float, uint16_t*, float*,
                 int64_t*, int64_t, int64_t);
  // Prefill chunks' attention (FlashArgs), or nullptr: torch's CPU flash kernel runs them.
  void (*flash_pack)(const FlashArgs&, int64_t, int64_t) = nullptr;
  void (*flash_item)(const FlashArgs&, int64_t, float*) = nullptr;
  int64_t flash_packed_bytes = 0;  // per packed K / V element
  int64_t flash_min_rows = 0;      // new rows from which a sequence takes the flash kernel
  int64_t flash_item_rows = 0;     // query rows per work item, about; 0: kFlashTokens tokens
  const char* flash_name = nullptr;  // what `pdmesh doctor` prints
};

}  // namespace pdmesh_dense
