// Torch operator bindings for the dense CPU kernels (TORCH_LIBRARY, no pybind: this TU compiles
// in seconds, where <torch/extension.h> alone takes half a minute on two cores).
//   features() -> int
//   linear(Tensor x, Tensor w, Tensor? bias, int path) -> Tensor
// path (dense.h): 1 AVX-512 FMA kernel, 2 AVX2 FMA kernel, 3 the dpbf16 kernel for bf16 x (the
// AVX-512 FMA kernel for fp32 x). A path this CPU cannot run raises. Python
// (kernels/dense/backend.py) routes what these kernels cannot take to torch; the checks here
// guard memory safety. A non-contiguous x is copied; w needs contiguous rows (any row stride).
// This TU is compiled for baseline x86-64: it only detects the CPU and calls into the kernel TUs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "dense.h"

namespace pdmesh_dense {
namespace {

// Below this many weight bytes per parallel chunk, a second thread costs more than it saves.
constexpr int64_t kMinChunkBytes = int64_t{48} << 10;

// Every tier's code is compiled in (the kernel TUs hold it in target regions).
int64_t features() { return pdmesh_native::feature_bits(true, true); }

void check_inputs(const at::Tensor& x, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "dense: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "dense: x must be [m, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "dense: x must be fp32 or bf16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) == x.size(1),
              "dense: w must be bf16 [n, k] matching x [m, k]");
  TORCH_CHECK(w.stride(1) == 1 && w.stride(0) >= w.size(1), "dense: w rows must be contiguous");
  if (bias) {
    TORCH_CHECK((bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16) &&
                    bias->is_contiguous() && bias->numel() == w.size(0) && bias->device().is_cpu(),
                "dense: bias must be a contiguous fp32 or bf16 [n] tensor");
  }
}

}  // namespace

const char* path_unavailable(int64_t path) {
  const CpuFeatures& s = cpu_features();
  switch (path) {
    case kPathAvx512:
      return s.avx512 ? nullptr : "this CPU lacks avx512f/avx512bw/avx512vl/avx512dq";
    case kPathAvx2:
      return s.avx2_tier() ? nullptr : "this CPU lacks avx2/fma/f16c";
    case kPathAvx512Bf16:
      return s.avx512_bf16 ? nullptr : "this CPU lacks avx512_bf16 (or avx512f/bw/vl/dq)";
    default:
      return "unknown code path (expected 1 avx512, 2 avx2 or 3 avx512_bf16)";
  }
}

namespace {

// One call's kernel and arguments, y allocated: what linear and linear_columns share.
struct Prepared {
  at::Tensor x, xr, y;  // x contiguous; xr the FMA kernel's reordered fp32 copy (else undefined)
  GemvArgs args;
  GemvKernel kernel;
};

Prepared prepare(const at::Tensor& x_in, const at::Tensor& w,
                 const std::optional<at::Tensor>& bias, int64_t path) {
  check_inputs(x_in, w, bias);
  const char* why = path_unavailable(path);
  TORCH_CHECK(why == nullptr, "dense: code path ", path, " cannot run: ", why);
  Prepared p;
  p.x = x_in.contiguous();  // a no-op (no copy) on the decode path
  const bool x_bf16 = p.x.scalar_type() == at::kBFloat16;
  const bool dp = path == kPathAvx512Bf16 && x_bf16;  // vdpbf16ps takes bf16 x only
  const bool avx2 = path == kPathAvx2;
  const int64_t m = p.x.size(0), k = p.x.size(1), n = w.size(0);
  const int64_t chunk = avx2 ? kChunk2 : kChunk;
  const int64_t kpad = (k + chunk - 1) / chunk * chunk;
  if (!dp) {
    p.xr = at::empty({m, kpad}, p.x.options().dtype(at::kFloat));
    const auto* xb =
        x_bf16 ? reinterpret_cast<const uint16_t*>(p.x.data_ptr<at::BFloat16>()) : nullptr;
    const float* xf = x_bf16 ? nullptr : p.x.data_ptr<float>();
    if (avx2) {
      reorder_x_avx2(xf, xb, m, k, kpad, p.xr.data_ptr<float>());
    } else {
      reorder_x_avx512(xf, xb, m, k, kpad, p.xr.data_ptr<float>());
    }
  }
  p.y = at::empty({m, n}, p.x.options());
  GemvArgs& a = p.args;
  a = GemvArgs{};
  a.w = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  a.x = dp ? nullptr : p.xr.data_ptr<float>();
  a.x_bf16 = dp ? reinterpret_cast<const uint16_t*>(p.x.data_ptr<at::BFloat16>()) : nullptr;
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.bias_bf16 = bias && bias->scalar_type() == at::kBFloat16;
  a.y = p.y.data_ptr();
  a.y_bf16 = x_bf16;
  a.m = m;
  a.k = k;
  a.n = n;
  a.ldw = w.stride(0);
  a.kpad = kpad;
  p.kernel = dp ? gemv_dpbf16_avx512 : avx2 ? gemv_fma_avx2 : gemv_fma_avx512;
  return p;
}

}  // namespace

// Not static: layer_ops.cpp's fused decoder layer calls it for its four projections.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias, int64_t path) {
  const Prepared p = prepare(x_in, w, bias, path);
  const int64_t n = w.size(0), k = p.x.size(1);
  const int64_t groups = (n + kGroup - 1) / kGroup;
  const int64_t group_bytes = kGroup * std::max<int64_t>(k, 1) * 2;
  const int64_t grain = std::max<int64_t>(1, kMinChunkBytes / group_bytes);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    p.kernel(p.args, g0 * kGroup, std::min(g1 * kGroup, n));
  });
  return p.y;
}

// y [m, n] in x's dtype with only the listed (row, column) entries written, each exactly as
// linear(x, w, bias, path) computes it: the kernels' summation order does not depend on the
// rows or columns of a call (gemv_avx512.cpp, gemv_avx2.cpp). One thread; for a few columns.
at::Tensor linear_columns(const at::Tensor& x, const at::Tensor& w, int64_t path,
                          const std::vector<std::pair<int64_t, int64_t>>& cells) {
  const Prepared p = prepare(x, w, std::nullopt, path);
  const int64_t m = p.args.m, n = p.args.n;
  const size_t y_size = p.args.y_bf16 ? 2 : 4;
  for (const auto& [r, c] : cells) {
    TORCH_CHECK(r >= 0 && r < m && c >= 0 && c < n, "dense: cell out of range");
    GemvArgs a = p.args;  // row r alone: x and y start at that row
    a.m = 1;
    if (a.x != nullptr) a.x += r * a.kpad;
    if (a.x_bf16 != nullptr) a.x_bf16 += r * a.k;
    a.y = static_cast<char*>(a.y) + r * n * y_size;
    p.kernel(a, c, c + 1);
  }
  return p.y;
}

}  // namespace pdmesh_dense

TORCH_LIBRARY(pdmesh_dense, m) {
  m.def("features() -> int", &pdmesh_dense::features);
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int path) -> Tensor", &pdmesh_dense::linear);
}
