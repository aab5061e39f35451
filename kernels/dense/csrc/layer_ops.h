// What the fused decoder layer's two drivers share (layer_ops.cpp: one parallel region per op;
// decode_team.cpp: one parallel region for every layer of a decode step). Internal to the
// dense library: every input reaching these has been validated by the ops in layer_ops.cpp.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "layer.h"

namespace pdmesh_dense {

constexpr int64_t kGemvMaxRows = 32;  // more rows (prefill): torch's GEMM (oneDNN) instead
constexpr int64_t kWeightsPerLayer = 14;  // ln1, ln2, 4 x (weight, scales, bias)

// The kernels of code path `path`; raises if this CPU cannot run them.
const LayerKernels& kernels_for(int64_t path);
uint16_t* bits(const at::Tensor& t);
void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim);

// One step's validated metadata; token_seq backs args.token_seq.
struct Step {
  std::vector<int32_t> token_seq;
  StepArgs args{};
  int64_t rows = 0, max_context = 0;
};

Step make_step(const at::Tensor& tables, const at::Tensor& ctx, const at::Tensor& qs,
               int64_t rows, const at::Tensor& kv, int64_t table_positions);

// One projection's parameters: dense bf16 w [n, k] (scales empty), or MXFP4 with w = blocks
// uint8 [n, k/32, 16] and scales uint8 [n, k/32]; bias [n] optional (fp32 for MXFP4).
struct Proj {
  at::Tensor w;
  std::optional<at::Tensor> scales, bias;

  int64_t in_features() const { return scales ? w.size(1) * 32 : w.size(1); }
  int64_t out_features() const { return w.size(0); }
};

// One layer's parameters (contiguous) and the model's head layout.
struct Block {
  at::Tensor ln1, ln2;
  Proj qkv, o, gate_up, down;
};

struct Heads {
  int64_t heads, kv_heads;
  float eps;
  double scale;
  int64_t path;        // dense code path (ops.cpp linear, and `kernels`)
  int64_t mxfp4_path;  // the MXFP4 library's code path for packed projections
  const LayerKernels* kernels;  // path's elementwise and attention kernels
};

// Layer i's entries of the flat weights list, in decoder_layers' order.
Block layer_block(const c10::List<std::optional<at::Tensor>>& weights, int64_t i);
// Raises unless w's shapes fit a residual stream of width `hidden` and the cache layer kv.
void check_block(const Block& w, int64_t hidden, const at::Tensor& kv, const Heads& g);
void check_geometry(const at::Tensor& qkv, const at::Tensor& kv, const at::Tensor& cos_sin,
                    int64_t heads, int64_t kv_heads);

// Every layer of kv_cache [L, 2, ...] on h [T <= kGemvMaxRows, hidden] in one parallel region
// (decode_team.cpp). Bit-identical to run_block over each layer. windows[i]: layer i's sliding
// window (0: full attention). mx: the MXFP4 library's column kernel for g.mxfp4_path, needed
// (non-null) when some projection is MXFP4.
void decode_team(at::Tensor& h, at::Tensor& kv_cache, const at::Tensor& cos_sin, const Step& s,
                 const std::vector<Block>& blocks, const Heads& g,
                 const std::vector<int64_t>& windows, const pdmesh_native::Mxfp4Columns* mx);

}  // namespace pdmesh_dense
