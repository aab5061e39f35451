// The greedy token of a bf16 LM head without reading all of it (op greedy_head).
//
//   greedy_head(x bf16 [m, k], w bf16 [V, k], q int8 [V, kpad], coef fp32 [3, V], path)
//     -> int64 [m]: argmax over n of bf16(linear(x, w, path))[r, n], the first index on ties,
//        exactly the token torch.argmax picks from the full head's logits; -1 for a row this
//        op does not settle (non-finite x or logits: the caller runs the full head then).
//
// Greedy decoding reads the whole head (SmolLM2: 49,152 x 576 bf16, 57 MB, a fifth of a decode
// step's bytes) to keep one index. Here a step reads an int8 copy q (half the bytes) and then
// only the few head rows that could still win:
//   1. screen: approx[r, n] = s_n * xs_r * (q_n . xq_r), with q_n = round(w_n / s_n) and
//      xq_r = round(x_r / xs_r) int16, summed exactly in int32 (screen_avx512.cpp);
//   2. bound: |logit[r, n] - approx[r, n]| <= a_n * |x_r| + b_n * |ex_r| =: bound[r, n], where
//      ex_r = x_r - xs_r * xq_r. From w.x = s q.(xs xq) + s q.ex + ew.x (ew = w - s q):
//      Cauchy-Schwarz gives |ew_n| |x| + |s q_n| |ex|; coef holds a_n = |ew_n| plus the slack of
//      fp32 rounding in the exact kernel and here, b_n = |s q_n| with the same slack
//      (kernels/dense/greedy_head.py computes them once from the weight);
//   3. candidates: rows with approx + bound >= L_r - |L_r| / 32, L_r = max_n (approx - bound).
//      The true maximum is at least L_r, and bf16 rounding (the full head's output) can only
//      tie values within one bf16 ulp (< |v| / 128) of each other, so every row whose rounded
//      logit can equal the rounded maximum is a candidate;
//   4. exact: each candidate's logit through the very GEMV kernel `linear` runs (its summation
//      order does not depend on the columns or rows asked for: gemv_avx512.cpp), rounded to
//      bf16 as that op rounds; the first index of the maximum wins.
// SmolLM2 at 2 threads: 5 candidates per row on average (max 162 of 49,152) on decode states.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "dense.h"

namespace pdmesh_dense {

at::Tensor linear_columns(const at::Tensor& x, const at::Tensor& w, int64_t path,
                          const std::vector<std::pair<int64_t, int64_t>>& cells);  // ops.cpp

namespace {

constexpr int64_t kMaxRows = 32;  // the GEMV kernels' row limit (MAX_ROWS)
constexpr int64_t kMinChunkBytes = int64_t{48} << 10;  // as ops.cpp's split

struct XRows {
  std::vector<int16_t> xq;    // [m, kpad]
  std::vector<float> scale;   // xs_r
  std::vector<float> norm;    // |x_r|, rounded up
  std::vector<float> resid;   // |ex_r|, rounded up
  std::vector<bool> finite;
};

// Round x to int16 with the largest scale that keeps every partial dot inside int32:
// |q| <= 127 and kpad terms, so |xq| <= (2^31 - 1) / (127 kpad) (and <= 32767).
XRows quantize_x(const uint16_t* x, int64_t m, int64_t k, int64_t kpad) {
  const int64_t limit = std::min<int64_t>(32767, (int64_t{1} << 31) / (127 * kpad) - 1);
  XRows out{std::vector<int16_t>(m * kpad, 0), std::vector<float>(m), std::vector<float>(m),
            std::vector<float>(m), std::vector<bool>(m)};
  for (int64_t r = 0; r < m; ++r) {
    double amax = 0.0, sq = 0.0;
    bool ok = true;
    for (int64_t j = 0; j < k; ++j) {
      const double v = bits_to_f32(uint32_t{x[r * k + j]} << 16);
      ok = ok && std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
      sq += v * v;
    }
    out.finite[r] = ok && std::isfinite(sq);
    if (!out.finite[r]) continue;
    const float xs = amax > 0.0 ? static_cast<float>(amax / static_cast<double>(limit)) : 1.0f;
    double resid = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const double v = bits_to_f32(uint32_t{x[r * k + j]} << 16);
      const double qv = std::clamp(std::nearbyint(v / xs), -static_cast<double>(limit),
                                   static_cast<double>(limit));
      out.xq[r * kpad + j] = static_cast<int16_t>(qv);
      const double e = v - qv * static_cast<double>(xs);
      resid += e * e;
    }
    out.scale[r] = xs;
    out.norm[r] = static_cast<float>(std::sqrt(sq) * (1.0 + 1e-6));
    out.resid[r] = static_cast<float>(std::sqrt(resid) * (1.0 + 1e-6));
  }
  return out;
}

void check(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, const at::Tensor& coef) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && q.device().is_cpu() &&
                  coef.device().is_cpu(), "greedy_head: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "greedy_head: x must be contiguous bf16 [m, k]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "greedy_head: 1..", kMaxRows, " rows");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) == x.size(1) &&
                  w.stride(1) == 1 && w.stride(0) >= w.size(1),
              "greedy_head: w must be bf16 [V, k] with contiguous rows");
  const int64_t v = w.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() &&
                  q.size(0) == v && q.size(1) >= x.size(1) && q.size(1) % kScreenChunk == 0,
              "greedy_head: q must be contiguous int8 [V, kpad], kpad >= k a multiple of ",
              kScreenChunk);
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.is_contiguous() && coef.dim() == 2 &&
                  coef.size(0) == 3 && coef.size(1) == v,
              "greedy_head: coef must be contiguous fp32 [3, V]");
}

}  // namespace

at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q,
                       const at::Tensor& coef, int64_t path) {
  check(x, w, q, coef);
  const char* why = path_unavailable(path);
  TORCH_CHECK(why == nullptr, "greedy_head: code path ", path, " cannot run: ", why);
  const int64_t m = x.size(0), k = x.size(1), v = w.size(0), kpad = q.size(1);
  const XRows xr = quantize_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, k,
                              kpad);
  // Per-call scratch, kept per thread across calls: fresh [m, V] buffers would be fresh pages
  // (mmap-sized allocations), faulted in on every step.
  thread_local std::vector<int32_t> cand_buf;
  thread_local std::vector<float> upper_buf;
  if (static_cast<int64_t>(cand_buf.size()) < m * v) {
    cand_buf.resize(m * v);
    upper_buf.resize(m * v);
  }
  const float* c = coef.data_ptr<float>();
  const ScreenArgs sa{q.data_ptr<int8_t>(), xr.xq.data(), c, c + v, c + 2 * v,
                      xr.scale.data(), xr.norm.data(), xr.resid.data(), cand_buf.data(),
                      upper_buf.data(), m, v, kpad};

  // 1-3. Screen every head row, keeping each call's survivors and each row's best lower bound.
  struct Part {
    int64_t n0;
    std::array<int64_t, kMaxRows> count;
  };
  std::vector<Part> parts;
  std::vector<float> lower(m, -std::numeric_limits<float>::infinity());
  std::mutex merge;
  const int64_t grain = std::max<int64_t>(1, kMinChunkBytes / (kGroup * kpad));
  const int64_t groups = (v + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * kGroup, n1 = std::min(g1 * kGroup, v);
    Part part{n0, {}};
    std::array<float, kMaxRows> best;
    best.fill(-std::numeric_limits<float>::infinity());
    if (path == kPathAvx2) {
      screen_avx2(sa, n0, n1, best.data(), part.count.data());
    } else {
      screen_avx512(sa, n0, n1, best.data(), part.count.data());
    }
    const std::lock_guard<std::mutex> hold(merge);
    for (int64_t r = 0; r < m; ++r) lower[r] = std::max(lower[r], best[r]);
    parts.push_back(part);
  });
  std::vector<std::pair<int64_t, int64_t>> cand;  // (row, column) past the global cut
  for (int64_t r = 0; r < m; ++r) {
    const float cut = screen_cut(lower[r]);
    if (!xr.finite[r] || !std::isfinite(cut)) continue;
    for (const Part& p : parts) {
      for (int64_t j = 0; j < p.count[r]; ++j) {
        const int64_t slot = r * v + p.n0 + j;
        if (upper_buf[slot] >= cut) cand.emplace_back(r, cand_buf[slot]);
      }
    }
  }

  // 4. Exact logits of the candidates, one column at a time, through linear's kernel.
  const at::Tensor logits = linear_columns(x, w, path, cand);
  at::Tensor out = at::full({m}, -1, x.options().dtype(at::kLong));
  auto* tok = out.data_ptr<int64_t>();
  std::vector<float> top(m, -std::numeric_limits<float>::infinity());
  std::vector<bool> bad(m, false);
  const auto* y = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>());
  for (const auto& [r, n] : cand) {
    const float val = bits_to_f32(uint32_t{y[r * v + n]} << 16);
    if (!std::isfinite(val)) bad[r] = true;
    if (val > top[r] || (val == top[r] && (tok[r] < 0 || n < tok[r]))) {
      top[r] = val;
      tok[r] = n;
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    if (bad[r] || !xr.finite[r]) tok[r] = -1;
  }
  return out;
}

}  // namespace pdmesh_dense

TORCH_LIBRARY_FRAGMENT(pdmesh_dense, m) {
  m.def("greedy_head(Tensor x, Tensor w, Tensor q, Tensor coef, int path) -> Tensor",
        &pdmesh_dense::greedy_head);
}
