// Torch operator bindings for the MXFP4 CPU kernels (TORCH_LIBRARY, no pybind: this TU compiles
// in seconds, where <torch/extension.h> alone takes half a minute on two cores).
// Ops live in the namespace PDMESH_MXFP4_NS (one per build variant) and share one schema:
//   features() -> int
//   quantize(Tensor w, int path) -> (Tensor, Tensor)
//   quantize_mse(Tensor w) -> (Tensor, Tensor)          (the MSE encoder, same on every path)
//   dequantize(Tensor blocks, Tensor scales, ScalarType dtype, int path) -> Tensor
//   dequantize_into(Tensor blocks, Tensor scales, Tensor(a!) out, int path) -> ()
//   linear(Tensor x, Tensor blocks, Tensor scales, Tensor? bias, int path) -> Tensor
//   column_kernel(int path) -> int   (address of path's pdmesh_native::Mxfp4Columns)
// path: 0 scalar, 1 avx512 (no vdpbf16ps), 2 avx2, 3 avx512_bf16; one this CPU cannot run
// raises. linear and column_kernel also take a path ORed with kActInt8 (16, native.h): int8
// activations (W4A8). Python (kernels/mxfp4/backend.py) validates dtypes and shapes and makes inputs
// contiguous; the checks here only guard memory safety.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels.h"

#ifndef PDMESH_MXFP4_NS
#error "PDMESH_MXFP4_NS must name the operator namespace"
#endif

namespace pdmesh_mxfp4 {
namespace {

constexpr int64_t kStreamBytes = int64_t{8} << 20;  // non-temporal stores above this output size

using pdmesh_native::kActInt8;
using pdmesh_native::kPathAvx2;
using pdmesh_native::kPathAvx512;
using pdmesh_native::kPathAvx512Bf16;
using pdmesh_native::kPathScalar;

int64_t features() {
#ifdef PDMESH_MXFP4_SCALAR_ONLY
  return pdmesh_native::feature_bits(false, false);
#else
  return pdmesh_native::feature_bits(true, true);
#endif
}

const KernelTable& table_for(int64_t path) {
  if (path == kPathScalar) return scalar_table();
#ifndef PDMESH_MXFP4_SCALAR_ONLY
  const KernelTable* t = nullptr;
  if (path == kPathAvx512) {
    t = avx512_table();
    TORCH_CHECK(t != nullptr, "mxfp4: code path 1 (avx512) needs avx512f/bw/vl/dq, which this "
                "CPU lacks");
  } else if (path == kPathAvx2) {
    t = avx2_table();
    TORCH_CHECK(t != nullptr, "mxfp4: code path 2 (avx2) needs avx2, fma and f16c, which this "
                "CPU lacks");
  } else if (path == kPathAvx512Bf16) {
    t = avx512_bf16_table();
    TORCH_CHECK(t != nullptr, "mxfp4: code path 3 (avx512_bf16) needs avx512f/bw/vl/dq and "
                "avx512_bf16, which this CPU lacks");
  }
  if (t != nullptr) return *t;
#endif
  TORCH_CHECK(false, "mxfp4: code path ", path, " is not compiled into this library");
}

void check_packed(const at::Tensor& blocks, const at::Tensor& scales) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte,
              "mxfp4: blocks and scales must be uint8");
  TORCH_CHECK(blocks.is_contiguous() && scales.is_contiguous(), "mxfp4: inputs must be contiguous");
  TORCH_CHECK(blocks.device().is_cpu() && scales.device().is_cpu(), "mxfp4: CPU tensors only");
  TORCH_CHECK(blocks.dim() >= 2 && blocks.size(-1) == kBlockBytes, "mxfp4: blocks must be [..., 16]");
  TORCH_CHECK(blocks.numel() == scales.numel() * kBlockBytes, "mxfp4: blocks/scales mismatch");
}

using BlockEncoder = void (*)(const float* w, int64_t nblocks, uint8_t* blocks, uint8_t* scales);

std::tuple<at::Tensor, at::Tensor> encode_blocks(const at::Tensor& w, BlockEncoder encode) {
  TORCH_CHECK(w.device().is_cpu(), "mxfp4: CPU tensors only");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() >= 1,
              "mxfp4: quantize takes a contiguous float32 tensor");
  TORCH_CHECK(w.size(-1) % kBlock == 0, "mxfp4: last dim must be a multiple of 32");
  std::vector<int64_t> shape(w.sizes().begin(), w.sizes().end() - 1);
  shape.push_back(w.size(-1) / kBlock);
  at::Tensor scales = at::empty(shape, w.options().dtype(at::kByte));
  shape.push_back(kBlockBytes);
  at::Tensor blocks = at::empty(shape, w.options().dtype(at::kByte));
  const float* src = w.data_ptr<float>();
  uint8_t* bp = blocks.data_ptr<uint8_t>();
  uint8_t* sp = scales.data_ptr<uint8_t>();
  at::parallel_for(0, scales.numel(), 1024, [&](int64_t b0, int64_t b1) {
    encode(src + b0 * kBlock, b1 - b0, bp + b0 * kBlockBytes, sp + b0);
  });
  return {blocks, scales};
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& w, int64_t path) {
  return encode_blocks(w, table_for(path).quantize);
}

// The MSE encoder is portable code (a load-time search, not a hot loop): one for every path.
std::tuple<at::Tensor, at::Tensor> quantize_mse(const at::Tensor& w) {
  return encode_blocks(w, quantize_mse_blocks);
}

// Writes into out (fp32 or bf16, contiguous, blocks' shape with the last two dims merged).
void dequantize_into(const at::Tensor& blocks, const at::Tensor& scales, const at::Tensor& out,
                     int64_t path) {
  check_packed(blocks, scales);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "mxfp4: dtype must be fp32 or bf16");
  TORCH_CHECK(out.is_contiguous() && out.device().is_cpu() &&
                  out.numel() == scales.numel() * kBlock,
              "mxfp4: out must be a contiguous CPU tensor of blocks.numel() * 2 elements");
  const KernelTable& t = table_for(path);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const bool stream = out.nbytes() >= static_cast<size_t>(kStreamBytes) &&
                      reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0;
  at::parallel_for(0, scales.numel(), 2048, [&](int64_t b0, int64_t b1) {
    if (dtype == at::kFloat) {
      t.dequantize_f32(bp + b0 * kBlockBytes, sp + b0, b1 - b0,
                       out.data_ptr<float>() + b0 * kBlock, stream);
    } else {
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      t.dequantize_bf16(bp + b0 * kBlockBytes, sp + b0, b1 - b0, o + b0 * kBlock, stream);
    }
  });
}

at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype,
                      int64_t path) {
  check_packed(blocks, scales);
  std::vector<int64_t> shape(blocks.sizes().begin(), blocks.sizes().end() - 2);
  shape.push_back(blocks.size(-2) * kBlock);
  at::Tensor out = at::empty(shape, blocks.options().dtype(dtype));
  dequantize_into(blocks, scales, out, path);
  return out;
}

// Position i of a reordered x block holds element order[i]: by default 16 even, then 16 odd
// elements, the order of the low and then high nibbles of a block's bytes.
struct BlockOrder {
  uint8_t at[kBlock];
};
constexpr BlockOrder make_even_odd() {
  BlockOrder o{};
  for (int i = 0; i < kBlock / 2; ++i) {
    o.at[i] = static_cast<uint8_t>(2 * i);
    o.at[kBlock / 2 + i] = static_cast<uint8_t>(2 * i + 1);
  }
  return o;
}
constexpr BlockOrder kEvenOdd = make_even_odd();

template <typename T, typename ToFloat>
void reorder(const T* src, float* dst, int64_t nblocks, const uint8_t* order, ToFloat to_float) {
  for (int64_t b = 0; b < nblocks; ++b, src += kBlock, dst += kBlock) {
    for (int64_t i = 0; i < kBlock; ++i) dst[i] = to_float(src[order[i]]);
  }
}

// x [m, k] (fp32 or bf16) -> fp32 [m, k], each 32-block in the kernel's x order.
at::Tensor reorder_x(const at::Tensor& x, const uint8_t* order) {
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t nblocks = x.numel() / kBlock;
  if (order == nullptr) order = kEvenOdd.at;
  if (x.scalar_type() == at::kBFloat16) {
    const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    reorder(src, out.data_ptr<float>(), nblocks, order,
            [](uint16_t v) { return bits_to_f32(static_cast<uint32_t>(v) << 16); });
  } else {
    reorder(x.data_ptr<float>(), out.data_ptr<float>(), nblocks, order, [](float v) { return v; });
  }
  return out;
}

void check_linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales,
                  const std::optional<at::Tensor>& bias) {
  check_packed(blocks, scales);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "mxfp4: x must be a contiguous CPU [m, k] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "mxfp4: x must be fp32 or bf16");
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(1) * kBlock == x.size(1),
              "mxfp4: blocks must be [n, k/32, 16] matching x [m, k]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == blocks.size(0) && bias->device().is_cpu(),
                "mxfp4: bias must be a contiguous float32 [n] tensor");
  }
}

// Runs kernel over all output columns on torch's intra-op threads, in groups of 4 columns (the
// widest tile). A group costs about 4 * k * (m + 3) units (decoding ~ 3 rows of FMAs); a thread
// gets >= 2^19 units (~10 us), so small matrices stay on one thread rather than pay fork/join.
void run_columns(void (*kernel)(const LinearArgs&, int64_t, int64_t), const LinearArgs& args) {
  const int64_t groups = (args.n + 3) / 4;
  const int64_t cost = std::max<int64_t>(1, 4 * args.k * (args.m + 3));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 19) / cost);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    kernel(args, g0 * 4, std::min(g1 * 4, args.n));
  });
}

// quantize_x_a8 (fp32 or bf16 x) for code path `path`: every path but the scalar one runs on
// an AVX2 CPU (table_for has checked), so they take the AVX2 loop; the bits are the same.
struct A8Quantizers {
  void (*f32)(const float*, int64_t, int8_t*, float*);
  void (*bf16)(const uint16_t*, int64_t, int8_t*, float*);
};

A8Quantizers a8_quantizers(int64_t path) {
#ifndef PDMESH_MXFP4_SCALAR_ONLY
  if (path != kPathScalar) return {quantize_x_a8_avx2, quantize_x_a8_bf16_avx2};
#endif
  (void)path;
  return {quantize_x_a8, quantize_x_a8_bf16};
}

// x [m, k] (fp32 or bf16) -> int8 [m, k] in quantize_x_a8's layout and its scales [m, k/32].
void quantize_x(const at::Tensor& x, int64_t path, int8_t* q, float* d) {
  const int64_t nblocks = x.numel() / kBlock;
  if (x.scalar_type() == at::kBFloat16) {
    a8_quantizers(path).bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                             nblocks, q, d);
  } else {
    a8_quantizers(path).f32(x.data_ptr<float>(), nblocks, q, d);
  }
}

// W4A8: x quantised once, then the int8 kernel over all columns; fp32 y, converted to x's dtype.
at::Tensor linear_a8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t path) {
  const KernelTable& t = table_for(path);
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / kBlock}, x.options().dtype(at::kFloat));
  quantize_x(x, path, q.data_ptr<int8_t>(), d.data_ptr<float>());
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  LinearArgs args{};
  args.xq = q.data_ptr<int8_t>();
  args.xd = d.data_ptr<float>();
  args.blocks = blocks.data_ptr<uint8_t>();
  args.scales = scales.data_ptr<uint8_t>();
  args.bias = bias ? bias->data_ptr<float>() : nullptr;
  args.y = y.data_ptr();
  args.m = m;
  args.k = k;
  args.n = n;
  run_columns(t.linear_a8, args);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// y [m, n] = x [m, k] @ W.T (+ bias), in x's dtype. bf16 x runs the bf16 kernel when the path
// has one (avx512_bf16); otherwise x is widened to fp32 and the fp32 result rounded back.
// path | kActInt8: x quantised to int8 first (linear_a8).
at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales,
                  const std::optional<at::Tensor>& bias, int64_t path) {
  check_linear(x, blocks, scales, bias);
  if (path & kActInt8) return linear_a8(x, blocks, scales, bias, path & ~kActInt8);
  const KernelTable& t = table_for(path);
  const bool bf16_kernel = x.scalar_type() == at::kBFloat16 && t.linear_bf16 != nullptr;
  const int64_t m = x.size(0), n = blocks.size(0);
  at::Tensor xr;  // bf16 kernel: x in pair layout; fp32 kernel: x as fp32 in the kernel's order
  LinearArgs args{};
  if (bf16_kernel) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    xr = at::empty({m, x_pairs(x.size(1)) * 2 * kBlock}, x.options());
    t.pair_x_bf16(xb, m, x.size(1), reinterpret_cast<uint16_t*>(xr.data_ptr<at::BFloat16>()));
    args.x_bf16 = xb;
    args.x_pairs = reinterpret_cast<const uint16_t*>(xr.data_ptr<at::BFloat16>());
  } else {
    xr = reorder_x(x, t.x_order);
    args.x = xr.data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(bf16_kernel ? at::kBFloat16 : at::kFloat));
  args.blocks = blocks.data_ptr<uint8_t>();
  args.scales = scales.data_ptr<uint8_t>();
  args.bias = bias ? bias->data_ptr<float>() : nullptr;
  args.y = y.data_ptr();
  args.m = m;
  args.k = x.size(1);
  args.n = n;
  run_columns(bf16_kernel ? t.linear_bf16 : t.linear_f32, args);
  return x.scalar_type() == at::kBFloat16 && !bf16_kernel ? y.to(at::kBFloat16) : y;
}

// The decode team's column-slice entry points (native.h: Mxfp4Columns) for code path P: the
// same kernels and x layouts as linear() above, one output slice per call, no parallel region.
// P | kActInt8: the scratch holds x's int8 scales [m, k/32] fp32, then x itself int8 [m, k].
template <int64_t P>
int64_t columns_x_scratch_bytes(int64_t m, int64_t k) {
  if (P & kActInt8) return m * (k / kBlock) * int64_t{sizeof(float)} + m * k;
  const KernelTable& t = table_for(P);
  if (t.linear_bf16 != nullptr) return m * x_pairs(k) * 2 * kBlock * int64_t{sizeof(uint16_t)};
  return m * k * int64_t{sizeof(float)};
}

template <int64_t P>
void columns_prepare(const uint16_t* x, int64_t m, int64_t k, void* x_scratch) {
  if (P & kActInt8) {
    float* d = static_cast<float*>(x_scratch);
    a8_quantizers(P & ~kActInt8).bf16(x, m * k / kBlock,
                                      reinterpret_cast<int8_t*>(d + m * (k / kBlock)), d);
    return;
  }
  const KernelTable& t = table_for(P);
  if (t.linear_bf16 != nullptr) {
    t.pair_x_bf16(x, m, k, static_cast<uint16_t*>(x_scratch));
    return;
  }
  reorder(x, static_cast<float*>(x_scratch), m * k / kBlock, t.x_order ? t.x_order : kEvenOdd.at,
          [](uint16_t v) { return bits_to_f32(static_cast<uint32_t>(v) << 16); });
}

template <int64_t P>
void columns_run(const uint16_t* x, const void* x_scratch, const uint8_t* blocks,
                 const uint8_t* scales, const float* bias, int64_t m, int64_t k, int64_t n,
                 int64_t n0, int64_t n1, uint16_t* y, float* y_scratch) {
  const KernelTable& t = table_for(P & ~kActInt8);
  LinearArgs a{};
  a.blocks = blocks;
  a.scales = scales;
  a.bias = bias;
  a.m = m;
  a.k = k;
  a.n = n;
  if (!(P & kActInt8) && t.linear_bf16 != nullptr) {
    a.x_bf16 = x;
    a.x_pairs = static_cast<const uint16_t*>(x_scratch);
    a.y = y;
    t.linear_bf16(a, n0, n1);
    return;
  }
  // fp32 sums into y_scratch [m, n1 - n0], then one RNE rounding, as linear()'s y.to(bf16).
  a.y = y_scratch;
  a.ldy = n1 - n0;
  a.y0 = n0;
  if (P & kActInt8) {
    a.xd = static_cast<const float*>(x_scratch);
    a.xq = reinterpret_cast<const int8_t*>(a.xd + m * (k / kBlock));
    t.linear_a8(a, n0, n1);
  } else {
    a.x = static_cast<const float*>(x_scratch);
    t.linear_f32(a, n0, n1);
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = n0; c < n1; ++c) y[r * n + c] = f32_to_bf16_rne(y_scratch[a.y_at(r, c)]);
  }
}

template <int64_t P>
constexpr pdmesh_native::Mxfp4Columns kColumns{columns_x_scratch_bytes<P>, columns_prepare<P>,
                                               columns_run<P>};

// The address of path's Mxfp4Columns, as an int (a torch op returns no pointers); raises for a
// path this CPU or this build cannot run, so the functions themselves never do.
int64_t column_kernel(int64_t path) {
  const int64_t base = path & ~kActInt8;
  table_for(base);
  const pdmesh_native::Mxfp4Columns* c;
  if (path & kActInt8) {
    c = base == kPathScalar ? &kColumns<kPathScalar | kActInt8>
        : base == kPathAvx512 ? &kColumns<kPathAvx512 | kActInt8>
        : base == kPathAvx2 ? &kColumns<kPathAvx2 | kActInt8>
                            : &kColumns<kPathAvx512Bf16 | kActInt8>;
  } else {
    c = base == kPathScalar ? &kColumns<kPathScalar>
        : base == kPathAvx512 ? &kColumns<kPathAvx512>
        : base == kPathAvx2 ? &kColumns<kPathAvx2>
                            : &kColumns<kPathAvx512Bf16>;
  }
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(c));
}

}  // namespace
}  // namespace pdmesh_mxfp4

#define PDMESH_MXFP4_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

PDMESH_MXFP4_LIBRARY(PDMESH_MXFP4_NS, m) {
  m.def("features() -> int", &pdmesh_mxfp4::features);
  m.def("quantize(Tensor w, int path) -> (Tensor, Tensor)", &pdmesh_mxfp4::quantize);
  m.def("quantize_mse(Tensor w) -> (Tensor, Tensor)", &pdmesh_mxfp4::quantize_mse);
  m.def("dequantize(Tensor blocks, Tensor scales, ScalarType dtype, int path) -> Tensor",
        &pdmesh_mxfp4::dequantize);
  m.def("dequantize_into(Tensor blocks, Tensor scales, Tensor(a!) out, int path) -> ()",
        &pdmesh_mxfp4::dequantize_into);
  m.def("linear(Tensor x, Tensor blocks, Tensor scales, Tensor? bias, int path) -> Tensor",
        &pdmesh_mxfp4::linear);
  m.def("column_kernel(int path) -> int", &pdmesh_mxfp4::column_kernel);
}
