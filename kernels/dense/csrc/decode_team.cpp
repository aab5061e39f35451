// A decode step's whole decoder stack in one parallel region: the CPU analogue of a CUDA graph.
//
// The per-op driver (layer_ops.cpp run_block) opens a parallel region for every projection,
// norm and attention of every layer: ~5 forks and joins per layer, 150 per step for a 30-layer
// model, each one a wake-up of the other threads and a wait for the slowest. Here the team is
// formed once per step and every layer's phases are separated by a barrier only where data
// crosses threads:
//
//   norm1 (each thread, all rows, private)  -> qkv GEMV (columns split)        | barrier
//   RoPE + cache write (rows split)                                             | barrier
//   attention ((row, kv head) items split)                                      | barrier
//   o GEMV (columns split), residual add of the same columns                    | barrier
//   norm2 (private) -> gate/up GEMV (columns split)                             | barrier
//   SiLU * up (private, all rows) -> down GEMV (columns split), residual add    | barrier
//
// The norms and the activation are recomputed by every thread instead of shared: they are a
// few thousand elements, cheaper than another barrier. Every kernel is the one run_block
// calls, on the same inputs, and column slices are whole kGroup groups as ops.cpp's split uses,
// so the result is bit-identical to run_block (tests/kernels/test_decode_team.py); only the
// scheduling differs. Before waiting at a barrier a thread prefetches the start of its slice of
// the next projection (its weight rows stream from DRAM; the barrier wait hides the first
// misses).
//
// At most kGemvMaxRows rows come here (decoder_layers checks). A projection is dense bf16 (this
// library's GEMV) or MXFP4: then each thread converts x to the MXFP4 kernel's layout itself
// and runs that library's fused kernel on its column slice through the plain functions of
// native.h's Mxfp4Columns, bit-identical to the op pdmesh_mxfp4::linear that run_block calls
// (whose own parallel region per projection is what the team saves). Every shape was validated
// before the region opens, so nothing in it throws.
#include <ATen/Parallel.h>
#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <thread>
#include <vector>

#include "dense.h"
#include "layer_ops.h"

namespace pdmesh_dense {
namespace {

constexpr int64_t kPrefetchLines = 32;  // cache lines of the next slice to request at a barrier

// [first, end) of part `tid` of `team` over n, in whole groups of `unit`.
struct Slice {
  int64_t first, end;
};

Slice split(int64_t n, int64_t unit, int tid, int team) {
  const int64_t units = (n + unit - 1) / unit;
  const int64_t u0 = units * tid / team, u1 = units * (tid + 1) / team;
  return {std::min(u0 * unit, n), std::min(u1 * unit, n)};
}

// One dense projection as ops.cpp's linear() runs it: x bf16 [m, k] -> y bf16 [m, n].
struct Gemv {
  GemvKernel kernel;
  bool reorder;  // the FMA kernels read x as reordered fp32 (see GemvArgs::x)
  bool avx2;
  int64_t chunk;

  explicit Gemv(int64_t path)
      : kernel(path == kPathAvx512Bf16 ? gemv_dpbf16_avx512
               : path == kPathAvx2     ? gemv_fma_avx2
                                       : gemv_fma_avx512),
        reorder(path != kPathAvx512Bf16),
        avx2(path == kPathAvx2),
        chunk(path == kPathAvx2 ? kChunk2 : kChunk) {}

  int64_t kpad(int64_t k) const { return (k + chunk - 1) / chunk * chunk; }

  // y[:, cols] = x @ p.w[cols].T (+ bias); xr is this thread's fp32 scratch (reorder only).
  void run(const Proj& p, const uint16_t* x, int64_t m, float* xr, uint16_t* y, Slice cols) const {
    if (cols.first >= cols.end) return;
    assert(!p.scales);  // MXFP4 projections take Plan::project's other branch
    const int64_t k = p.w.size(1), kp = kpad(k);
    if (reorder) {
      if (avx2) {
        reorder_x_avx2(nullptr, x, m, k, kp, xr);
      } else {
        reorder_x_avx512(nullptr, x, m, k, kp, xr);
      }
    }
    GemvArgs a{};
    a.w = reinterpret_cast<const uint16_t*>(p.w.const_data_ptr());
    a.x = reorder ? xr : nullptr;
    a.x_bf16 = reorder ? nullptr : x;
    a.bias = p.bias ? p.bias->const_data_ptr() : nullptr;
    a.bias_bf16 = p.bias && p.bias->scalar_type() == at::kBFloat16;
    a.y = y;
    a.y_bf16 = true;
    a.m = m;
    a.k = k;
    a.n = p.w.size(0);
    a.ldw = p.w.stride(0);
    a.kpad = kp;
    kernel(a, cols.first, cols.end);
  }
};

// Ask for the first lines of rows [cols) of p's weight (the start of this thread's next stream).
void prefetch(const Proj& p, Slice cols) {
  if (cols.first >= cols.end) return;
  const char* start = static_cast<const char*>(p.w.const_data_ptr()) +
                      cols.first * p.w.stride(0) * static_cast<int64_t>(p.w.element_size());
  for (int64_t i = 0; i < kPrefetchLines; ++i) _mm_prefetch(start + 64 * i, _MM_HINT_T1);
}

// An MXFP4 projection as pdmesh_mxfp4::linear's checks would take it (blocks uint8
// [n, k/32, 16], scales uint8 [n, k/32], bias fp32 [n]; all contiguous).
void check_packed_proj(const Proj& p) {
  const at::Tensor& s = *p.scales;
  TORCH_CHECK(p.w.scalar_type() == at::kByte && s.scalar_type() == at::kByte &&
                  p.w.dim() == 3 && p.w.size(2) == 16 && s.dim() == 2 &&
                  s.size(0) == p.w.size(0) && s.size(1) == p.w.size(1) &&
                  p.w.is_contiguous() && s.is_contiguous(),
              "dense layer: an MXFP4 projection needs contiguous uint8 blocks [n, k/32, 16] "
              "and scales [n, k/32]");
  if (p.bias) {
    TORCH_CHECK(p.bias->scalar_type() == at::kFloat && p.bias->is_contiguous() &&
                    p.bias->numel() == p.w.size(0),
                "dense layer: an MXFP4 projection's bias must be a contiguous fp32 [n] tensor");
  }
}

void check_team_block(const Block& w, int64_t hidden, const at::Tensor& kv,
                      const at::Tensor& cos_sin, const Heads& g) {
  check_block(w, hidden, kv, g);
  const int64_t d = kv.size(4);
  TORCH_CHECK(g.kv_heads > 0 && g.heads % g.kv_heads == 0 && g.heads / g.kv_heads <= 16 &&
                  kv.size(0) == 2 && kv.size(3) == g.kv_heads && d % 2 == 0 &&
                  cos_sin.size(1) % 2 == 0 && 0 < cos_sin.size(1) && cos_sin.size(1) <= d &&
                  w.qkv.out_features() == (g.heads + 2 * g.kv_heads) * d,
              "dense layer: qkv / cos_sin widths do not match the head geometry");
  for (const Proj* p : {&w.qkv, &w.o, &w.gate_up, &w.down}) {
    if (p->scales) {
      check_packed_proj(*p);
      continue;
    }
    TORCH_CHECK(p->w.stride(1) == 1 && p->w.stride(0) >= p->w.size(1),
                "dense: w rows must be contiguous");
    if (p->bias) {
      TORCH_CHECK((p->bias->scalar_type() == at::kFloat ||
                   p->bias->scalar_type() == at::kBFloat16) &&
                      p->bias->is_contiguous() && p->bias->numel() == p->w.size(0),
                  "dense: bias must be a contiguous fp32 or bf16 [n] tensor");
    }
  }
}

// The team's barrier. Not `#pragma omp barrier`: libgomp spins only ~100 times at a barrier
// once the process has more OpenMP threads than CPUs in all (any second thread that ever ran a
// parallel torch op, e.g. a loader or KV-transfer thread, leaves its pool behind), and then
// every waiter sleeps on a futex and is woken by the last arrival. A decode step crosses ~180
// barriers: measured on 2 Zen 4 cores, a serving engine thread decoded at 62 steps/s against
// 94 for the same engine on the process's only OpenMP thread. This one spins (a pause per
// turn), and yields the core only after ~kSpinsBeforeYield turns, in case the machine is
// oversubscribed. Every member calls wait(team) with the same team size.
class TeamBarrier {
 public:
  void wait(int team) {
    // One word, one cache line: arrivals in the low 8 bits, the generation above them. The
    // last arrival turns `team` arrivals into the next generation with no arrival.
    const uint32_t arrived = state_.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (static_cast<int>(arrived & kArrivalMask) == team) {
      state_.fetch_add(kGeneration - static_cast<uint32_t>(team), std::memory_order_release);
      return;
    }
    const uint32_t generation = arrived >> kArrivalBits;
    for (int64_t turn = 0; (state_.load(std::memory_order_acquire) >> kArrivalBits) == generation;
         ++turn) {
      if (turn < kSpinsBeforeYield) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kArrivalBits = 8;  // teams of up to 255 threads
  static constexpr uint32_t kArrivalMask = (1u << kArrivalBits) - 1;
  static constexpr uint32_t kGeneration = 1u << kArrivalBits;
  static constexpr int64_t kSpinsBeforeYield = 1 << 16;
  alignas(64) std::atomic<uint32_t> state_{0};
};

// Buffers the team shares (written by slices, read whole after a barrier), and its barrier.
struct Shared {
  std::vector<uint16_t> qkv, q, attn, gu, y;
  TeamBarrier barrier;
};

// One thread's private buffers.
struct Private {
  std::vector<uint16_t> xn, act;
  std::vector<float> xr, scratch;
  std::vector<int64_t> offsets;
  std::vector<uint64_t> mx_x;  // MXFP4: x in the kernel's layout (8-byte words, aligned)
  std::vector<float> mx_y;     // MXFP4: the fp32 sums of this thread's column slice
};

// The team's view of one step: everything the phases read, validated and sized.
struct Plan {
  const Step& s;
  const std::vector<Block>& blocks;
  const Heads& g;
  const LayerKernels& k;
  Gemv gemv;
  uint16_t* h;
  const uint16_t* cos_sin;
  const std::vector<CacheArgs>& caches;  // layer i's K and V planes of the paged cache
  const pdmesh_native::Mxfp4Columns* mx;  // MXFP4 projections' kernel; nullptr if none
  int64_t rows, hidden, inter, d, qkv_n;

  // y[:, cols] = x @ p[cols].T (+ bias), dense or MXFP4.
  void project(const Proj& p, const uint16_t* x, Private& pv, uint16_t* y, Slice cols) const {
    if (!p.scales) {
      gemv.run(p, x, rows, pv.xr.data(), y, cols);
      return;
    }
    if (cols.first >= cols.end) return;
    const int64_t k = p.in_features();
    mx->prepare(x, rows, k, pv.mx_x.data());
    mx->run(x, pv.mx_x.data(), static_cast<const uint8_t*>(p.w.const_data_ptr()),
            static_cast<const uint8_t*>(p.scales->const_data_ptr()),
            p.bias ? p.bias->const_data_ptr<float>() : nullptr, rows, k, p.out_features(),
            cols.first, cols.end, y, pv.mx_y.data());
  }
};

// Layer i's six phases on thread tid of team (see the file comment).
void run_layer(const Plan& p, int64_t i, Shared& sh, Private& pv, int tid, int team) {
  const Block& w = p.blocks[i];
  const int64_t m = p.rows, hidden = p.hidden, inter = p.inter;
  const Slice qkv_cols = split(p.qkv_n, kGroup, tid, team);
  const Slice o_cols = split(hidden, kGroup, tid, team);
  const Slice gu_cols = split(2 * inter, kGroup, tid, team);
  const CacheArgs& c = p.caches[i];

  p.k.rms_norm(p.h, bits(w.ln1), hidden, p.g.eps, pv.xn.data(), 0, m);
  p.project(w.qkv, pv.xn.data(), pv, sh.qkv.data(), qkv_cols);
  prefetch(w.o, o_cols);
  sh.barrier.wait(team);
  const Slice rows = split(m, 1, tid, team);
  if (rows.first < rows.end) {
    p.k.rope_store(sh.qkv.data(), p.cos_sin, p.s.args, c, sh.q.data(), rows.first, rows.end);
  }
  sh.barrier.wait(team);
  const Slice items = split(m * p.g.kv_heads, 1, tid, team);
  if (items.first < items.end) {
    p.k.attend(sh.q.data(), p.s.args, c, static_cast<float>(p.g.scale), sh.attn.data(),
               pv.scratch.data(), pv.offsets.data(), items.first, items.end);
  }
  sh.barrier.wait(team);
  p.project(w.o, sh.attn.data(), pv, sh.y.data(), o_cols);
  for (int64_t r = 0; r < m && o_cols.first < o_cols.end; ++r) {
    p.k.add_inplace(p.h + r * hidden + o_cols.first, sh.y.data() + r * hidden + o_cols.first,
                    o_cols.end - o_cols.first);
  }
  prefetch(w.gate_up, gu_cols);
  sh.barrier.wait(team);
  p.k.rms_norm(p.h, bits(w.ln2), hidden, p.g.eps, pv.xn.data(), 0, m);
  p.project(w.gate_up, pv.xn.data(), pv, sh.gu.data(), gu_cols);
  prefetch(w.down, o_cols);
  sh.barrier.wait(team);
  p.k.silu_mul(sh.gu.data(), inter, pv.act.data(), 0, m);
  p.project(w.down, pv.act.data(), pv, sh.y.data(), o_cols);
  for (int64_t r = 0; r < m && o_cols.first < o_cols.end; ++r) {
    p.k.add_inplace(p.h + r * hidden + o_cols.first, sh.y.data() + r * hidden + o_cols.first,
                    o_cols.end - o_cols.first);
  }
  if (i + 1 < static_cast<int64_t>(p.blocks.size())) {
    prefetch(p.blocks[i + 1].qkv, split(p.qkv_n, kGroup, tid, team));
  }
  sh.barrier.wait(team);
}

}  // namespace

void decode_team(at::Tensor& h, at::Tensor& kv_cache, const at::Tensor& cos_sin, const Step& s,
                 const std::vector<Block>& blocks, const Heads& g,
                 const std::vector<int64_t>& windows, const pdmesh_native::Mxfp4Columns* mx) {
  const int64_t m = h.size(0), hidden = h.size(1);
  TORCH_CHECK(m <= kGemvMaxRows, "dense layer: the decode team takes at most ", kGemvMaxRows,
              " rows");
  const int64_t inter = blocks.front().down.in_features(), d = kv_cache.size(5);
  std::vector<CacheArgs> caches;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor kv = kv_cache[static_cast<int64_t>(i)];
    check_team_block(blocks[i], hidden, kv, cos_sin, g);
    TORCH_CHECK(blocks[i].down.in_features() == inter,
                "dense layer: layers differ in intermediate size");
    caches.push_back(CacheArgs{bits(kv[0]), bits(kv[1]), g.heads, g.kv_heads, d,
                               cos_sin.size(1), windows[i]});
  }
  const Plan plan{s, blocks, g, *g.kernels, Gemv(g.path), bits(h), bits(cos_sin), caches, mx,
                  m, hidden, inter, d, (g.heads + 2 * g.kv_heads) * d};
  const int64_t hd = g.heads * d;
  Shared sh{std::vector<uint16_t>(m * plan.qkv_n), std::vector<uint16_t>(m * hd),
            std::vector<uint16_t>(m * hd), std::vector<uint16_t>(m * 2 * inter),
            std::vector<uint16_t>(m * hidden)};
  const int64_t kpad_max = plan.gemv.kpad(std::max({hidden, inter, hd}));
  const int64_t group = g.heads / g.kv_heads;
  const int threads = at::get_num_threads();
  // MXFP4 scratch per thread: x for the widest k, fp32 sums for a column slice.
  int64_t mx_x_bytes = 0, mx_y = 0;
  for (const Block& b : blocks) {
    for (const Proj* p : {&b.qkv, &b.o, &b.gate_up, &b.down}) {
      if (!p->scales) continue;
      TORCH_CHECK(mx != nullptr, "dense layer: MXFP4 projections need the MXFP4 column kernel");
      mx_x_bytes = std::max(mx_x_bytes, mx->x_scratch_bytes(m, p->in_features()));
      mx_y = std::max(mx_y, m * p->out_features());  // any team size: a slice is at most n
    }
  }
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    Private pv{std::vector<uint16_t>(m * hidden), std::vector<uint16_t>(m * inter),
               std::vector<float>(plan.gemv.reorder ? m * kpad_max : 0),
               std::vector<float>(group * (s.max_context + d)),
               std::vector<int64_t>(s.max_context),
               std::vector<uint64_t>((mx_x_bytes + 7) / 8), std::vector<float>(mx_y)};
    for (int64_t i = 0; i < static_cast<int64_t>(blocks.size()); ++i) {
      run_layer(plan, i, sh, pv, tid, team);
    }
  }
}

}  // namespace pdmesh_dense
