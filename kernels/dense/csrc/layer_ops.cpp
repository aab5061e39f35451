// Torch bindings of the fused decoder layer (kernels in layer_<tier>.cpp / attend_<tier>.cpp,
// GEMVs in ops.cpp). Every op takes the code path `path` of dense.h (1 avx512, 2 avx2,
// 3 avx512_bf16; 1 and 3 share the elementwise and per-row attention kernels, and differ in
// the GEMV and the prefill attention) and raises if this CPU cannot run it.
//   rope_attention(qkv, kv_layer!, cos_sin, block_tables, context_lens, query_start,
//                  num_heads, num_kv_heads, scale, path, window=0) -> Tensor [T, H D]
//       RoPE on q and k, K/V written to the paged cache, causal attention over each sequence's
//       context read straight from its block table (any T: prefill chunks and decode rows; a
//       sequence of 16 or 64+ new rows runs a blocked flash kernel instead:
//       flash_avx512bf16.cpp on path 3 without AMX, flash_avx2.cpp on path 2, else torch's);
//       window > 0: a sliding window, the query at position p reads keys p - window < j <= p.
//   prefill_attention(q, kv_layer, block_table, context_len, num_heads, num_kv_heads, scale,
//                     kernel) -> Tensor [T, H D]
//       One sequence's blocked attention alone, on a named flash kernel or torch's (tests,
//       benchmarks).
//   prefill_attention_kernel(path) -> str: which one `path` runs (pdmesh doctor).
//   decoder_layers(h!, kv_cache!, cos_sin, block_tables, context_lens, query_start,
//                  Tensor?[] weights, num_heads, num_kv_heads, eps, scale, path, mxfp4_path,
//                  team=True, windows=[]) -> ()
//       Whole pre-norm Llama blocks on the bf16 residual stream h [T, hidden], in place, one per
//       layer of kv_cache [L, 2, ...], so a decode step costs one dispatch. weights holds
//       kWeightsPerLayer entries per layer: ln1, ln2, then (weight, scales, bias) for each of
//       the qkv, o, gate_up and down projections. A projection with scales is MXFP4 (weight =
//       blocks uint8 [n, k/32, 16], scales uint8 [n, k/32], bias fp32) and runs the MXFP4
//       library's fused kernel (op pdmesh_mxfp4::linear, code path mxfp4_path); without, it is
//       dense bf16 [n, k] and runs this library's GEMV (code path `path`). windows: each
//       layer's sliding window (0: full), or empty for none.
//   rms_norm(x, w, eps, path) -> Tensor;  add_rms_norm(h!, y, w, eps, path) -> Tensor
//       (h += y, then norm);  silu_mul(gu [T, 2 I], path) -> Tensor [T, I];  add_(h!, y, path)
//       The block's elementwise steps alone, for callers that run the projections themselves
//       (an MXFP4 prefill, whose projections dequantise for torch's GEMM).
// Shapes: qkv [T, (H + 2 KVH) D], kv_layer [2, num_blocks, block_size, KVH, D], cos_sin [P, R]
// (R = rotary dim, even, <= D: RoPE rotates each head's first R channels), block_tables int32
// [B, max_blocks], context_lens int32 [B], query_start int32 [B + 1].
// Every input is validated here (the kernels trust their indices), so a bad table raises.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/maximum.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "dense.h"
#include "layer.h"
#include "layer_ops.h"

namespace pdmesh_dense {

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias, int64_t path);  // ops.cpp

namespace {

constexpr int64_t kRowGrain = 8;      // rows per parallel chunk of the elementwise kernels
constexpr int64_t kMinKeysPerChunk = 4096;  // attention: (row, kv head, key) triples per chunk
// A sequence with at least this many new rows (a prefill chunk) and full causal attention runs
// a blocked (flash) attention: the per-row kernel reads every key once per query row, which is
// quadratic traffic and GEMV-speed math; the blocked one reuses each key tile across a tile of
// queries. Measured per layer on 2 cores (SmolLM2 heads), torch's kernel: 5.2x faster for a
// 2,000-token prompt, 1.7x at 200; at 64 new rows 0.87x with no cached context, 2x over 512.
// The bf16 one (flash_avx512bf16.cpp; AMD Zen 4) against the per-row kernel with RoPE, over
// 0 / 200 / 1,000 / 4,000 cached tokens: 1.35x / 1.8x / 2.1x / 2.2x at 16 rows; at 8 rows
// 1.1x / 1.5x / 1.8x / 2.0x, and at 4 rows slower without cached context.
constexpr int64_t kTorchFlashMinRows = 64;

constexpr LayerKernels kAvx512{rms_norm_avx512, add_inplace_avx512, silu_mul_avx512,
                               rope_store_avx512, attend_avx512};
// The avx2 tier runs prefill attention on its fp32 FMA kernel (flash_avx2.cpp): torch's kernel
// reaches a quarter to half of the FMA peak there (README, "Prefill attention on AVX2").
constexpr LayerKernels kAvx2{rms_norm_avx2, add_inplace_avx2, silu_mul_avx2, rope_store_avx2,
                             attend_avx2, flash_pack_avx2, flash_item_avx2, 4, 16, 96,
                             "fp32 flash kernel (AVX2 FMA)"};
// Path 3 also runs prefill attention on vdpbf16ps (flash_avx512bf16.cpp), except with AMX:
// there torch's flash kernel multiplies on AMX tiles, which no vdpbf16ps loop matches. Without
// AMX, torch's kernel runs bf16 at fp32 FMA speed and ours is faster (README, "Prefill
// attention on bf16 dot products").
constexpr LayerKernels kAvx512Bf16{rms_norm_avx512, add_inplace_avx512, silu_mul_avx512,
                                   rope_store_avx512, attend_avx512, flash_pack_avx512bf16,
                                   flash_item_avx512bf16, 2, 16, 0,
                                   "bf16 flash kernel (vdpbf16ps)"};

}  // namespace

// The kernels of code path `path`; raises if this CPU cannot run them.
const LayerKernels& kernels_for(int64_t path) {
  const char* why = path_unavailable(path);
  TORCH_CHECK(why == nullptr, "dense layer: code path ", path, " cannot run: ", why);
  if (path == kPathAvx2) return kAvx2;
  return path == kPathAvx512Bf16 && !cpu_features().amx_bf16 ? kAvx512Bf16 : kAvx512;
}

uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
                  t.dim() == dim,
              "dense layer: ", name, " must be a contiguous CPU ", c10::toString(dtype),
              " tensor with ", dim, " dims");
}

Step make_step(const at::Tensor& tables, const at::Tensor& ctx, const at::Tensor& qs,
               int64_t rows, const at::Tensor& kv, int64_t table_positions) {
  check_tensor(tables, "block_tables", at::kInt, 2);
  check_tensor(ctx, "context_lens", at::kInt, 1);
  check_tensor(qs, "query_start", at::kInt, 1);
  const int64_t b = ctx.size(0), nb = tables.size(1), bs = kv.size(2);
  TORCH_CHECK(b > 0 && tables.size(0) == b && qs.size(0) == b + 1,
              "dense layer: block_tables [B, n], context_lens [B], query_start [B + 1]");
  const int32_t* t = tables.data_ptr<int32_t>();
  const int32_t* c = ctx.data_ptr<int32_t>();
  const int32_t* q = qs.data_ptr<int32_t>();
  TORCH_CHECK(q[0] == 0 && q[b] == rows, "dense layer: query_start must run from 0 to T");
  Step s;
  s.token_seq.resize(rows);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t q_len = q[i + 1] - q[i];
    TORCH_CHECK(q_len >= 1 && q_len <= c[i], "dense layer: bad query_start / context_lens");
    TORCH_CHECK(c[i] <= nb * bs && c[i] <= table_positions,
                "dense layer: context longer than its block table or the RoPE table");
    for (int64_t j = 0; j < (c[i] + bs - 1) / bs; ++j) {
      TORCH_CHECK(t[i * nb + j] >= 0 && t[i * nb + j] < kv.size(1),
                  "dense layer: block id out of range");
    }
    std::fill(s.token_seq.begin() + q[i], s.token_seq.begin() + q[i + 1], int32_t(i));
    s.max_context = std::max<int64_t>(s.max_context, c[i]);
  }
  s.args = StepArgs{t, c, q, s.token_seq.data(), b, nb, bs};
  s.rows = rows;
  return s;
}

namespace {

// One sequence's prefill rows: q / out [T, H D] rows [r0, r0 + q_len), the new rows at
// positions ctx - q_len .. ctx - 1 of the sequence whose blocks `table` lists; kv [2,
// num_blocks, block_size, KVH, D] with this step's keys already written.
struct Prefill {
  const at::Tensor& q;
  const at::Tensor& kv;
  const int32_t* table;
  int64_t ctx, r0, q_len, heads, kv_heads;
  double scale;
};

// Full causal attention through torch's CPU flash-attention kernel (bf16 in, fp32 softmax and
// accumulation, bf16 out; grouped kv heads natively), into out's rows. The context's K / V
// blocks are gathered once ([KVH, ctx, D] each: small next to the attention's ctx^2 work).
// A whole prompt is one causal call. With cached context before the rows (a later prefill
// chunk, a prefix hit) the keys split in two: the cached ones, which every row sees (no
// mask), and the new ones (causal); the two partial results merge by their log-sum-exp. An
// explicit [q_len, ctx] mask is read once per head: 1.7x the attention time of the split at
// 8,000 tokens (1.4x the whole prefill).
void torch_flash_attention(const Prefill& p, at::Tensor& out) {
  const int64_t bs = p.kv.size(2), d = p.kv.size(4), q_len = p.q_len, ctx = p.ctx;
  const int64_t cached = ctx - q_len, nblk = (ctx + bs - 1) / bs;
  const at::Tensor table = at::from_blob(const_cast<int32_t*>(p.table), {nblk},
                                         at::TensorOptions().dtype(at::kInt));
  auto gather = [&](int64_t which) {  // [1, KVH, ctx, D]
    return p.kv[which].index_select(0, table).view({nblk * bs, p.kv_heads, d}).narrow(0, 0, ctx)
        .permute({1, 0, 2}).unsqueeze(0);
  };
  const at::Tensor qs = p.q.narrow(0, p.r0, q_len).view({q_len, p.heads, d}).permute({1, 0, 2})
                            .unsqueeze(0);  // [1, H, q_len, D]
  const at::Tensor keys = gather(0), values = gather(1);
  auto flash = [&](int64_t k0, int64_t n, bool causal) {  // keys [k0, k0 + n)
    return at::_scaled_dot_product_flash_attention_for_cpu(
        qs, keys.narrow(2, k0, n), values.narrow(2, k0, n), 0.0, causal, std::nullopt, p.scale);
  };
  at::Tensor o;  // [1, H, q_len, D]
  if (cached == 0) {
    o = std::get<0>(flash(0, ctx, true));
  } else {
    const auto [o_old, lse_old] = flash(0, cached, false);  // lse [1, H, q_len] fp32
    const auto [o_new, lse_new] = flash(cached, q_len, true);
    const at::Tensor top = at::maximum(lse_old, lse_new);
    const at::Tensor w_old = lse_old.sub(top).exp_().unsqueeze(-1);  // [1, H, q_len, 1]
    const at::Tensor w_new = lse_new.sub(top).exp_().unsqueeze(-1);
    o = o_old.to(at::kFloat).mul_(w_old).add_(o_new.to(at::kFloat).mul_(w_new))
            .div_(w_old.add(w_new)).to(at::kBFloat16);
  }
  out.narrow(0, p.r0, q_len).view({q_len, p.heads, d}).copy_(o.squeeze(0).permute({1, 0, 2}));
}

// Whether k has a flash kernel and it runs this geometry (layer.h: FlashArgs).
bool flash_fits(const LayerKernels& k, int64_t heads, int64_t kv_heads, int64_t d) {
  return k.flash_item != nullptr && d % 32 == 0 && d <= kFlashMaxHeadDim &&
         heads / kv_heads <= kFlashMaxGroup;
}

// Query tokens per work item of k's flash kernel for a sequence of q_len new rows: about
// k.flash_item_rows rows (tokens x group). More rows reuse each K / V block, which comes from L3
// or DRAM at long contexts, for more queries; fewer keep the item's scratch in L2
// (flash_avx2.cpp). A short chunk takes fewer, so that every thread gets two items: 16 new
// rows over a long cached context make 3 items of SmolLM2's 3 kv heads, and two threads then
// take two rounds with one of them idle in the second.
int64_t item_tokens(const LayerKernels& k, int64_t q_len, int64_t heads, int64_t kv_heads) {
  if (k.flash_item_rows == 0) return kFlashTokens;
  const int64_t by_rows = k.flash_item_rows / (heads / kv_heads);
  const int64_t items = 2 * at::get_num_threads();
  const int64_t by_threads = (q_len * kv_heads + items - 1) / items;
  return std::clamp<int64_t>(std::min(by_rows, by_threads), 1, kFlashMaxTokens);
}

// The same attention on k's flash kernel (flash_avx512bf16.cpp, flash_avx2.cpp): K / V packed
// once, then the work items. Items differ in cost (a later query block sees more keys), so each
// thread takes them from a shared counter, longest first, rather than from a static split.
void kernel_flash_attention(const LayerKernels& k, const Prefill& p, at::Tensor& out) {
  const int64_t d = p.kv.size(4), padded = flash_padded_keys(p.ctx);
  FlashArgs a{bits(p.q) + p.r0 * p.heads * d, bits(out) + p.r0 * p.heads * d, bits(p.kv[0]),
              bits(p.kv[1]), p.table, p.kv.size(2), p.q_len, p.ctx, p.heads, p.kv_heads, d,
              static_cast<float>(p.scale), item_tokens(k, p.q_len, p.heads, p.kv_heads), nullptr,
              nullptr};
  const int64_t bytes = flash_packed_elems(a) * k.flash_packed_bytes;
  at::Tensor packed = at::empty({2, bytes}, p.q.options().dtype(at::kByte));
  a.k_packed = packed[0].data_ptr();
  a.v_packed = packed[1].data_ptr();
  at::parallel_for(0, p.kv_heads * padded / 16, 16, [&](int64_t i0, int64_t i1) {
    k.flash_pack(a, i0, i1);
  });
  const int64_t items = flash_items(a);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(flash_scratch_floats(a));
    for (int64_t i = next++; i < items; i = next++) k.flash_item(a, i, scratch.data());
  });
}

void blocked_attention(const LayerKernels& k, const Prefill& p, at::Tensor& out) {
  if (flash_fits(k, p.heads, p.kv_heads, p.kv.size(4))) {
    kernel_flash_attention(k, p, out);
  } else {
    torch_flash_attention(p, out);
  }
}

// RoPE + cache write, then attention: qkv [T, (H + 2 KVH) D] -> [T, H D].
at::Tensor attention_core(const LayerKernels& k, const at::Tensor& qkv, at::Tensor& kv,
                          const at::Tensor& cos_sin, const Step& s, int64_t heads,
                          int64_t kv_heads, double scale, int64_t window) {
  const int64_t d = kv.size(4), rows = s.rows;
  const CacheArgs c{bits(kv[0]), bits(kv[1]), heads, kv_heads, d, cos_sin.size(1), window};
  at::Tensor q = at::empty({rows, heads * d}, qkv.options());
  at::Tensor out = at::empty({rows, heads * d}, qkv.options());
  at::parallel_for(0, rows, 16, [&](int64_t t0, int64_t t1) {
    k.rope_store(bits(qkv), bits(cos_sin), s.args, c, bits(q), t0, t1);
  });
  const int64_t group = heads / kv_heads;
  // Work items of at least kMinKeysPerChunk keys per chunk: a decode step's few short items run
  // inline rather than paying a parallel region's fork and barrier.
  const int64_t keys = window > 0 ? std::min(window, s.max_context) : s.max_context;
  const int64_t grain = std::max<int64_t>(1, kMinKeysPerChunk / std::max<int64_t>(1, keys));
  auto per_row = [&](int64_t r0, int64_t r1) {  // rows [r0, r1) with the per-row kernel
    if (r0 >= r1) return;
    at::parallel_for(r0 * kv_heads, r1 * kv_heads, grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> scratch(group * (s.max_context + d));
      std::vector<int64_t> offsets(s.max_context);
      k.attend(bits(q), s.args, c, static_cast<float>(scale), bits(out), scratch.data(),
               offsets.data(), i0, i1);
    });
  };
  // Rows are sequence-major: long prefill chunks go to blocked_attention, the runs of rows
  // between them to the per-row kernel.
  const int64_t min_rows =
      flash_fits(k, heads, kv_heads, d) ? k.flash_min_rows : kTorchFlashMinRows;
  int64_t pending = 0;
  for (int64_t b = 0; b < s.args.num_seqs; ++b) {
    const int64_t r0 = s.args.query_start[b], r1 = s.args.query_start[b + 1];
    if (window > 0 || r1 - r0 < min_rows) continue;
    per_row(pending, r0);
    blocked_attention(k, Prefill{q, kv, s.args.block_tables + b * s.args.max_blocks,
                                 s.args.context_lens[b], r0, r1 - r0, heads, kv_heads, scale},
                      out);
    pending = r1;
  }
  per_row(pending, rows);
  return out;
}

}  // namespace

void check_geometry(const at::Tensor& qkv, const at::Tensor& kv, const at::Tensor& cos_sin,
                    int64_t heads, int64_t kv_heads) {
  check_tensor(qkv, "qkv", at::kBFloat16, 2);
  check_tensor(kv, "kv_layer", at::kBFloat16, 5);
  check_tensor(cos_sin, "cos_sin", at::kBFloat16, 2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 16 &&
                  kv.size(0) == 2 && kv.size(3) == kv_heads,
              "dense layer: heads must be a multiple (<= 16x) of the cache's kv heads");
  const int64_t d = kv.size(4);
  const int64_t r = cos_sin.size(1);  // rotary_dim: < d for partial rotary
  TORCH_CHECK(d % 2 == 0 && r % 2 == 0 && 0 < r && r <= d &&
                  qkv.size(1) == (heads + 2 * kv_heads) * d,
              "dense layer: qkv / cos_sin widths do not match the head geometry");
}

namespace {

at::Tensor rope_attention(const at::Tensor& qkv, at::Tensor kv, const at::Tensor& cos_sin,
                          const at::Tensor& tables, const at::Tensor& ctx, const at::Tensor& qs,
                          int64_t heads, int64_t kv_heads, double scale, int64_t path,
                          int64_t window) {
  const LayerKernels& k = kernels_for(path);
  check_geometry(qkv, kv, cos_sin, heads, kv_heads);
  TORCH_CHECK(window >= 0, "dense layer: window must be >= 0 (0: full attention)");
  const Step s = make_step(tables, ctx, qs, qkv.size(0), kv, cos_sin.size(0));
  return attention_core(k, qkv, kv, cos_sin, s, heads, kv_heads, scale, window);
}

// One sequence's prefill attention alone, on one named implementation, for tests and
// benchmarks to compare: q [q_len, H D] rotated, kv_layer holding the context's K / V (ctx
// keys, the last q_len the rows' own) in the blocks block_table [n] int32 lists. kernel:
// "torch" (torch's flash kernel), "avx512_bf16" (the vdpbf16ps kernel) or "avx2" (the fp32 FMA
// kernel); the last two raise on a CPU that cannot run them, or a geometry they do not run.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table,
                             int64_t ctx, int64_t heads, int64_t kv_heads, double scale,
                             const std::string& kernel) {
  check_tensor(q, "q", at::kBFloat16, 2);
  check_tensor(kv, "kv_layer", at::kBFloat16, 5);
  check_tensor(table, "block_table", at::kInt, 1);
  const int64_t d = kv.size(4), bs = kv.size(2), q_len = q.size(0);
  TORCH_CHECK(kernel == "torch" || kernel == "avx512_bf16" || kernel == "avx2",
              "dense layer: kernel must be 'torch', 'avx512_bf16' or 'avx2', not '", kernel, "'");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && kv.size(0) == 2 &&
                  kv.size(3) == kv_heads && q.size(1) == heads * d,
              "dense layer: q [T, H D] and kv_layer [2, n, bs, KVH, D] do not match the heads");
  TORCH_CHECK(q_len >= 1 && q_len <= ctx && ctx <= table.size(0) * bs,
              "dense layer: need 1 <= q_len <= context_len <= the block table's capacity");
  const int32_t* t = table.data_ptr<int32_t>();
  for (int64_t j = 0; j < (ctx + bs - 1) / bs; ++j) {
    TORCH_CHECK(t[j] >= 0 && t[j] < kv.size(1), "dense layer: block id out of range");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const Prefill p{q, kv, t, ctx, 0, q_len, heads, kv_heads, scale};
  if (kernel == "torch") {
    torch_flash_attention(p, out);
    return out;
  }
  const bool bf16 = kernel == "avx512_bf16";
  const char* why = path_unavailable(bf16 ? kPathAvx512Bf16 : kPathAvx2);
  TORCH_CHECK(why == nullptr, "dense layer: the ", kernel, " flash kernel cannot run: ", why);
  const LayerKernels& k = bf16 ? kAvx512Bf16 : kAvx2;
  TORCH_CHECK(flash_fits(k, heads, kv_heads, d), "dense layer: the ", kernel,
              " flash kernel needs head_dim a multiple of 32 up to ", kFlashMaxHeadDim,
              " and at most ", kFlashMaxGroup, " query heads per kv head");
  kernel_flash_attention(k, p, out);
  return out;
}

// Which kernel runs code path `path`'s prefill attention (a geometry permitting): what
// `pdmesh doctor` prints, and what the routing test checks.
std::string prefill_attention_kernel(int64_t path) {
  const LayerKernels& k = kernels_for(path);
  if (k.flash_item != nullptr) return k.flash_name;
  if (path == kPathAvx512Bf16) return "torch's flash kernel (AMX)";
  return "torch's flash kernel (fp32 FMA)";
}

// The MXFP4 library's fused linear, found through the dispatcher: that library is built and
// loaded on its own (kernels/mxfp4), and is loaded whenever a model holds MXFP4 weights.
at::Tensor mxfp4_linear(const at::Tensor& x, const Proj& p, int64_t path) {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, int64_t);
  static const c10::TypedOperatorHandle<Fn> op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pdmesh_mxfp4::linear", "").typed<Fn>();
  return op.call(x, p.w, *p.scales, p.bias, path);
}

// The same library's column-slice kernel for the decode team (native.h: Mxfp4Columns). The op
// raises for a path this CPU cannot run, as pdmesh_mxfp4::linear would.
const pdmesh_native::Mxfp4Columns* mxfp4_columns(int64_t path) {
  static const c10::TypedOperatorHandle<int64_t(int64_t)> op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pdmesh_mxfp4::column_kernel", "")
          .typed<int64_t(int64_t)>();
  return reinterpret_cast<const pdmesh_native::Mxfp4Columns*>(
      static_cast<intptr_t>(op.call(path)));
}

// Prefill rows (more than kGemvMaxRows) through torch's GEMM. torch's bf16 GEMM is fast only
// where the CPU has bf16 dot products; on the other tiers (avx2, avx512) it is ~6x slower than
// its fp32 GEMM (AMD Zen 3, 200 rows, 1 thread: 4.3 s against 0.7 s for SmolLM2's prompt), so
// they widen x and w to fp32 and round the product to bf16 once, as the bf16 GEMM also does
// (fp32 accumulation); the two differ only in the order of the fp32 sums. Same rule as
// kernels/dense/backend.py's prefill_linear.
//
// The bf16 GEMM gets its rows padded (zero rows, sliced off) to padded_rows(T): oneDNN builds
// and caches one primitive, with its own scratch, per shape, so a worker prefilling prompts of
// every length grew by megabytes per new length. Same rule as kernels/dense/backend.py's
// padded_rows, whose docstring has the figures.
int64_t padded_rows(int64_t rows) {
  if (rows <= kGemvMaxRows) return rows;
  const int bit_length = 64 - __builtin_clzll(static_cast<uint64_t>(rows - 1));
  const int64_t step = int64_t{1} << (bit_length - 4);  // eight steps per power of two
  return (rows + step - 1) / step * step;
}

at::Tensor prefill_linear(const at::Tensor& x, const Proj& p, int64_t path) {
  if (x.scalar_type() != at::kBFloat16) return at::linear(x, p.w, p.bias);
  if (path == kPathAvx512Bf16) {
    const int64_t rows = x.size(0), padded = padded_rows(rows);
    if (padded == rows) return at::linear(x, p.w, p.bias);
    return at::linear(at::constant_pad_nd(x, {0, 0, 0, padded - rows}), p.w, p.bias)
        .narrow(0, 0, rows);
  }
  std::optional<at::Tensor> bias;
  if (p.bias) bias = p.bias->to(at::kFloat);
  return at::linear(x.to(at::kFloat), p.w.to(at::kFloat), bias).to(at::kBFloat16);
}

// x [T, K] @ w.T (+ bias). Dense: the GEMV for decode-sized T, torch's GEMM above it (the same
// split as kernels/dense/backend.py, so the fused layer matches the unfused one bit for bit).
// MXFP4: the fused kernel on the packed bytes, as MXFP4Linear runs it for decode rows.
at::Tensor project(const at::Tensor& x, const Proj& p, const Heads& g) {
  if (p.scales) return mxfp4_linear(x, p, g.mxfp4_path);
  return x.size(0) <= kGemvMaxRows ? linear(x, p.w, p.bias, g.path) : prefill_linear(x, p, g.path);
}

void rms_norm_rows(const LayerKernels& k, const at::Tensor& h, const at::Tensor& w, float eps,
                   at::Tensor& out) {
  at::parallel_for(0, h.size(0), kRowGrain, [&](int64_t t0, int64_t t1) {
    k.rms_norm(bits(h), bits(w), h.size(1), eps, bits(out), t0, t1);
  });
}

void add_rows(const LayerKernels& k, at::Tensor& h, const at::Tensor& y) {
  const int64_t n = h.size(1);
  at::parallel_for(0, h.size(0), kRowGrain, [&](int64_t t0, int64_t t1) {
    k.add_inplace(bits(h) + t0 * n, bits(y) + t0 * n, (t1 - t0) * n);
  });
}

at::Tensor silu_mul_rows(const LayerKernels& k, const at::Tensor& gu) {
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  at::Tensor act = at::empty({rows, inter}, gu.options());
  at::parallel_for(0, rows, kRowGrain, [&](int64_t t0, int64_t t1) {
    k.silu_mul(bits(gu), inter, bits(act), t0, t1);
  });
  return act;
}

}  // namespace

void check_block(const Block& w, int64_t hidden, const at::Tensor& kv, const Heads& g) {
  check_tensor(w.ln1, "ln1", at::kBFloat16, 1);
  check_tensor(w.ln2, "ln2", at::kBFloat16, 1);
  const int64_t inter = w.down.in_features();
  TORCH_CHECK(w.ln1.size(0) == hidden && w.ln2.size(0) == hidden &&
                  w.qkv.in_features() == hidden && w.o.out_features() == hidden &&
                  w.gate_up.in_features() == hidden && w.gate_up.out_features() == 2 * inter &&
                  w.down.out_features() == hidden && w.o.in_features() == g.heads * kv.size(4),
              "dense layer: weight shapes do not match hidden / intermediate sizes");
}

namespace {

// h [T, hidden] <- the whole pre-norm block, in place; s was validated against this cache.
void run_block(at::Tensor& h, at::Tensor kv, const at::Tensor& cos_sin, const Step& s,
               const Block& w, const Heads& g, int64_t window) {
  const int64_t rows = h.size(0), hidden = h.size(1);
  check_block(w, hidden, kv, g);
  const LayerKernels& k = *g.kernels;
  at::Tensor xn = at::empty({rows, hidden}, h.options());
  rms_norm_rows(k, h, w.ln1, g.eps, xn);
  const at::Tensor qkv = project(xn, w.qkv, g);
  check_geometry(qkv, kv, cos_sin, g.heads, g.kv_heads);
  const at::Tensor attn =
      attention_core(k, qkv, kv, cos_sin, s, g.heads, g.kv_heads, g.scale, window);
  add_rows(k, h, project(attn, w.o, g));
  rms_norm_rows(k, h, w.ln2, g.eps, xn);
  const at::Tensor gu = project(xn, w.gate_up, g);
  add_rows(k, h, project(silu_mul_rows(k, gu), w.down, g));
}

}  // namespace

// Layer i's entries of the flat weights list, in decoder_layers' order.
Block layer_block(const c10::List<std::optional<at::Tensor>>& weights, int64_t i) {
  auto opt = [&](int64_t j) -> std::optional<at::Tensor> {
    return weights.get(kWeightsPerLayer * i + j);
  };
  auto need = [&](int64_t j) {
    const std::optional<at::Tensor> t = opt(j);
    TORCH_CHECK(t.has_value(), "dense layer: only scales and biases may be None");
    return *t;
  };
  auto proj = [&](int64_t j) {
    Proj p{need(j), opt(j + 1), opt(j + 2)};
    if (p.scales) {
      TORCH_CHECK(p.w.scalar_type() == at::kByte && p.w.dim() == 3,
                  "dense layer: an MXFP4 projection's weight must be uint8 blocks [n, k/32, 16]");
    } else {
      TORCH_CHECK(p.w.scalar_type() == at::kBFloat16 && p.w.dim() == 2,
                  "dense layer: a dense projection's weight must be bf16 [n, k]");
    }
    return p;
  };
  return Block{need(0), need(1), proj(2), proj(5), proj(8), proj(11)};
}

namespace {

// Every layer of the cache in turn (see the header comment for the weights layout).
void decoder_layers(at::Tensor h, at::Tensor kv_cache, const at::Tensor& cos_sin,
                    const at::Tensor& tables, const at::Tensor& ctx, const at::Tensor& qs,
                    const c10::List<std::optional<at::Tensor>>& weights, int64_t heads,
                    int64_t kv_heads, double eps, double scale, int64_t path,
                    int64_t mxfp4_path, bool team, at::IntArrayRef windows_in) {
  check_tensor(h, "h", at::kBFloat16, 2);
  check_tensor(kv_cache, "kv_cache", at::kBFloat16, 6);
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers,
              "dense layer: weights must hold ", kWeightsPerLayer, " entries per cache layer");
  TORCH_CHECK(windows_in.empty() || static_cast<int64_t>(windows_in.size()) == layers,
              "dense layer: windows must be empty or hold one entry per cache layer");
  std::vector<int64_t> windows(layers, 0);  // 0: full causal attention
  for (int64_t i = 0; i < static_cast<int64_t>(windows_in.size()); ++i) {
    TORCH_CHECK(windows_in[i] >= 0, "dense layer: windows must be >= 0 (0: full attention)");
    windows[i] = windows_in[i];
  }
  const Step s = make_step(tables, ctx, qs, h.size(0), kv_cache[0], cos_sin.size(0));
  const Heads g{heads, kv_heads, static_cast<float>(eps), scale, path, mxfp4_path,
                &kernels_for(path)};
  std::vector<Block> blocks;
  blocks.reserve(layers);
  for (int64_t i = 0; i < layers; ++i) blocks.push_back(layer_block(weights, i));
  const bool dense = std::none_of(blocks.begin(), blocks.end(), [](const Block& b) {
    return b.qkv.scales || b.o.scales || b.gate_up.scales || b.down.scales;
  });
  if (team && h.size(0) <= kGemvMaxRows) {  // one region for every layer
    decode_team(h, kv_cache, cos_sin, s, blocks, g, windows,
                dense ? nullptr : mxfp4_columns(g.mxfp4_path));
    return;
  }
  for (int64_t i = 0; i < layers; ++i) {
    run_block(h, kv_cache[i], cos_sin, s, blocks[i], g, windows[i]);
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& y) {
  check_tensor(x, "x", at::kBFloat16, 2);
  check_tensor(y, "y", at::kBFloat16, 2);
  TORCH_CHECK(x.sizes() == y.sizes(), "dense layer: residual and update shapes differ");
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps, int64_t path) {
  const LayerKernels& k = kernels_for(path);
  check_tensor(x, "x", at::kBFloat16, 2);
  check_tensor(w, "w", at::kBFloat16, 1);
  TORCH_CHECK(w.size(0) == x.size(1), "dense layer: norm weight does not match x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_rows(k, x, w, static_cast<float>(eps), out);
  return out;
}

void add_op(at::Tensor h, const at::Tensor& y, int64_t path) {
  const LayerKernels& k = kernels_for(path);
  check_rows(h, y);
  add_rows(k, h, y);
}

at::Tensor add_rms_norm_op(at::Tensor h, const at::Tensor& y, const at::Tensor& w, double eps,
                           int64_t path) {
  add_op(h, y, path);
  return rms_norm_op(h, w, eps, path);
}

at::Tensor silu_mul_op(const at::Tensor& gu, int64_t path) {
  const LayerKernels& k = kernels_for(path);
  check_tensor(gu, "gu", at::kBFloat16, 2);
  TORCH_CHECK(gu.size(1) % 2 == 0, "dense layer: gate/up width must be even");
  return silu_mul_rows(k, gu);
}

}  // namespace
}  // namespace pdmesh_dense

TORCH_LIBRARY_FRAGMENT(pdmesh_dense, m) {
  m.def(
      "rope_attention(Tensor qkv, Tensor(a!) kv_layer, Tensor cos_sin, Tensor block_tables, "
      "Tensor context_lens, Tensor query_start, int num_heads, int num_kv_heads, float scale, "
      "int path, int window=0) -> Tensor",
      &pdmesh_dense::rope_attention);
  m.def(
      "prefill_attention(Tensor q, Tensor kv_layer, Tensor block_table, int context_len, "
      "int num_heads, int num_kv_heads, float scale, str kernel) -> Tensor",
      &pdmesh_dense::prefill_attention);
  m.def("prefill_attention_kernel(int path) -> str", &pdmesh_dense::prefill_attention_kernel);
  m.def(
      "decoder_layers(Tensor(a!) h, Tensor(b!) kv_cache, Tensor cos_sin, Tensor block_tables, "
      "Tensor context_lens, Tensor query_start, Tensor?[] weights, int num_heads, "
      "int num_kv_heads, float eps, float scale, int path, int mxfp4_path, bool team=True, "
      "int[] windows=[]) -> ()",
      &pdmesh_dense::decoder_layers);
  m.def("rms_norm(Tensor x, Tensor w, float eps, int path) -> Tensor",
        &pdmesh_dense::rms_norm_op);
  m.def("add_rms_norm(Tensor(a!) h, Tensor y, Tensor w, float eps, int path) -> Tensor",
        &pdmesh_dense::add_rms_norm_op);
  m.def("silu_mul(Tensor gu, int path) -> Tensor", &pdmesh_dense::silu_mul_op);
  m.def("add_(Tensor(a!) h, Tensor y, int path) -> ()", &pdmesh_dense::add_op);
}
