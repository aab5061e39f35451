// Torch operator bindings for the dense CPU kernels (TORCH_LIBRARY, no pybind: this TU compiles
// in seconds, where <torch/extension.h> alone takes half a minute on two cores).
//   features() -> int
//   linear(Tensor x, Tensor w, Tensor? bias, int path) -> Tensor
// path: 0 FMA kernel (any x), 1 dpbf16 kernel (bf16 x, avx512_bf16 CPUs). Python
// (kernels/dense/backend.py) routes what these kernels cannot take to torch; the checks here
// guard memory safety. A non-contiguous x is copied; w needs contiguous rows (any row stride).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "dense.h"

namespace pdmesh_dense {
namespace {

// features() bits.
constexpr int64_t kCpuAvx512 = 1;  // the FMA kernel runs here
constexpr int64_t kCpuBf16 = 2;    // ... and so does the dpbf16 kernel
// Below this many weight bytes per parallel chunk, a second thread costs more than it saves.
constexpr int64_t kMinChunkBytes = int64_t{48} << 10;

int64_t features() {
  const CpuSupport s = cpu_support();
  return (s.avx512 ? kCpuAvx512 : 0) | (s.bf16 ? kCpuBf16 : 0);
}

const CpuSupport& cpu() {
  static const CpuSupport support = cpu_support();
  return support;
}

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

// Not static: layer_ops.cpp's fused decoder layer calls it for its four projections.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias, int64_t path) {
  check_inputs(x_in, w, bias);
  TORCH_CHECK(cpu().avx512, "dense: this CPU lacks avx512f/bw/vl/dq");
  const at::Tensor x = x_in.contiguous();  // a no-op (no copy) on the decode path
  TORCH_CHECK(path == 0 || path == 1, "dense: unknown code path ", path);
  const bool dp = path == 1;
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!dp || (x_bf16 && cpu().bf16),
              "dense: the dpbf16 path needs bf16 x and avx512_bf16");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t kpad = (k + kChunk - 1) / kChunk * kChunk;
  at::Tensor xr;  // the FMA kernel's reordered fp32 copy of x
  if (!dp) {
    xr = at::empty({m, kpad}, x.options().dtype(at::kFloat));
    const auto* xb =
        x_bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
    reorder_x_avx512(x_bf16 ? nullptr : x.data_ptr<float>(), xb, m, k, kpad,
                     xr.data_ptr<float>());
  }
  at::Tensor y = at::empty({m, n}, x.options());
  GemvArgs args{};
  args.w = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  args.x = dp ? nullptr : xr.data_ptr<float>();
  args.x_bf16 = dp ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  args.bias = bias ? bias->data_ptr() : nullptr;
  args.bias_bf16 = bias && bias->scalar_type() == at::kBFloat16;
  args.y = y.data_ptr();
  args.y_bf16 = x_bf16;
  args.m = m;
  args.k = k;
  args.n = n;
  args.ldw = w.stride(0);
  args.kpad = kpad;
  const GemvKernel kernel = dp ? gemv_dpbf16_avx512 : gemv_fma_avx512;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  const int64_t group_bytes = kGroup * std::max<int64_t>(k, 1) * 2;
  const int64_t grain = std::max<int64_t>(1, kMinChunkBytes / group_bytes);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    kernel(args, g0 * kGroup, std::min(g1 * kGroup, n));
  });
  return y;
}

}  // namespace pdmesh_dense

TORCH_LIBRARY(pdmesh_dense, m) {
  m.def("features() -> int", &pdmesh_dense::features);
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int path) -> Tensor", &pdmesh_dense::linear);
}
