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

// Not static: layer_ops.cpp's fused decoder layer calls it for its four projections.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w,
                  const std::optional<at::Tensor>& bias, int64_t path) {
  check_inputs(x_in, w, bias);
  const char* why = path_unavailable(path);
  TORCH_CHECK(why == nullptr, "dense: code path ", path, " cannot run: ", why);
  const at::Tensor x = x_in.contiguous();  // a no-op (no copy) on the decode path
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const bool dp = path == kPathAvx512Bf16 && x_bf16;  // vdpbf16ps takes bf16 x only
  const bool avx2 = path == kPathAvx2;
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t chunk = avx2 ? kChunk2 : kChunk;
  const int64_t kpad = (k + chunk - 1) / chunk * chunk;
  at::Tensor xr;  // the FMA kernel's reordered fp32 copy of x
  if (!dp) {
    xr = at::empty({m, kpad}, x.options().dtype(at::kFloat));
    const auto* xb =
        x_bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
    const float* xf = x_bf16 ? nullptr : x.data_ptr<float>();
    if (avx2) {
      reorder_x_avx2(xf, xb, m, k, kpad, xr.data_ptr<float>());
    } else {
      reorder_x_avx512(xf, xb, m, k, kpad, xr.data_ptr<float>());
    }
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
  const GemvKernel kernel = dp ? gemv_dpbf16_avx512 : avx2 ? gemv_fma_avx2 : gemv_fma_avx512;
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
