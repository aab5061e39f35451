"""The fused decoder layer and native paged attention: one C++ call per decode step.

    native = native_decoder(path)      # None when the library or AVX-512 is unavailable
    out = native.rope_attention(qkv, kv_layer, cos_sin, tables, geometry)   # [T, H D]
    native.decoder_layer(h, kv_layer, cos_sin, tables, weights, geometry)   # h updated in place
    native.decoder_layers(h, kv_cache, cos_sin, tables, stack, geometry)    # every layer at once

rope_attention does RoPE on q and k, writes K/V into the paged cache and runs causal attention
over each sequence's context straight from its block table (no gather, no padding; prefill
chunks and decode rows in one batch). decoder_layer runs a whole pre-norm Llama block on the
bf16 residual stream h [T, hidden]: RMSNorm, fused-qkv projection, RoPE + cache write +
attention, o projection + residual, RMSNorm, gate/up projection, SiLU * up, down projection +
residual. Projections of up to MAX_ROWS rows run the dense GEMV, larger ones (prefill)
torch's bf16 GEMM, as DenseLinear does. Numerics follow HF in bf16 (fp32 math, bf16 rounding
after each op, attention in fp32), so the plain-torch layer in shared/model/llama.py is the
oracle (tests/kernels/test_dense_layer.py). The elementwise ops (rms_norm, add_rms_norm,
silu_mul, add_) serve layers whose linears are not dense bf16 (MXFP4).
Everything here is bf16-only: the model, the cache and the cos/sin table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.dense.backend import Backend, KernelPath


@dataclass(frozen=True)
class LayerGeometry:
    """Head layout and constants shared by every layer of a model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    scale: float  # softmax scale, head_dim ** -0.5


@dataclass(frozen=True)
class LayerWeights:
    """One layer's bf16 parameters (the model's own tensors, not copies).

    w_qkv [(H + 2 KVH) D, hidden] with optional bias, w_o [hidden, H D] with optional bias,
    w_gu [2 I, hidden] (gate rows then up rows), w_down [hidden, I], ln1 / ln2 [hidden].
    """

    ln1: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln2: torch.Tensor
    w_gu: torch.Tensor
    w_down: torch.Tensor

    def __post_init__(self) -> None:
        for name, t in vars(self).items():
            if t is not None and (t.dtype != torch.bfloat16 or not t.is_contiguous()):
                raise ValueError(f"LayerWeights.{name} must be a contiguous bf16 tensor")

    def as_list(self) -> list[torch.Tensor | None]:
        """The 8 tensors in the order decoder_layers takes them."""
        return [self.ln1, self.w_qkv, self.b_qkv, self.w_o, self.b_o, self.ln2, self.w_gu,
                self.w_down]


@dataclass(frozen=True)
class StepTables:
    """The batch as the native attention reads it (int32; see AttentionMetadata)."""

    block_tables: torch.Tensor  # [B, max_blocks]
    context_lens: torch.Tensor  # [B], computed + new tokens
    query_start: torch.Tensor  # [B + 1], row of each sequence's first new token; [B] = T


class NativeDecoder:
    """The fused-layer and paged-attention ops of the loaded dense library.

    Holds the KernelPath whose library registered the ops; the GEMVs inside decoder_layer take
    the same code path (vdpbf16ps or FMA) that the path's DenseLinear would. Inputs are
    validated in C++ (a bad block table raises instead of reading out of bounds).
    """

    def __init__(self, path: KernelPath) -> None:
        if path.library is None or not path.library.cpu_avx512:
            raise ValueError("NativeDecoder needs the compiled library on an AVX-512 CPU")
        self.path = path
        self._ops = path.library.ops
        self._path_id = path.path_id(torch.bfloat16)
        self._layers = self._ops.decoder_layers.default  # resolved once: the per-step call

    @staticmethod
    def supports(g: LayerGeometry) -> bool:
        """Whether the kernels take this head layout (up to 16 query heads per kv head)."""
        return (g.num_kv_heads > 0 and g.num_heads % g.num_kv_heads == 0
                and g.num_heads // g.num_kv_heads <= 16 and g.head_dim % 2 == 0)

    def decoder_layers(self, h: torch.Tensor, kv_cache: torch.Tensor, cos_sin: torch.Tensor,
                       tables: StepTables, stack: list[torch.Tensor | None], g: LayerGeometry
                       ) -> None:
        """decoder_layer over every layer of kv_cache [L, 2, ...] in one call (one dispatch
        per step); stack = the layers' LayerWeights.as_list() concatenated, layer 0 first."""
        self._layers(h, kv_cache, cos_sin, tables.block_tables, tables.context_lens,
                     tables.query_start, stack, g.num_heads, g.num_kv_heads, g.rms_norm_eps,
                     g.scale, self._path_id)

    def rope_attention(self, qkv: torch.Tensor, kv_layer: torch.Tensor, cos_sin: torch.Tensor,
                       tables: StepTables, g: LayerGeometry) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) D] -> attention output [T, H D]; writes K/V of the new rows."""
        return self._ops.rope_attention(
            qkv, kv_layer, cos_sin, tables.block_tables, tables.context_lens,
            tables.query_start, g.num_heads, g.num_kv_heads, g.scale)

    def decoder_layer(self, h: torch.Tensor, kv_layer: torch.Tensor, cos_sin: torch.Tensor,
                      tables: StepTables, w: LayerWeights, g: LayerGeometry) -> None:
        """h [T, hidden] bf16 (contiguous) -> h after the whole block, in place."""
        self._ops.decoder_layer(
            h, kv_layer, cos_sin, tables.block_tables, tables.context_lens, tables.query_start,
            w.ln1, w.w_qkv, w.b_qkv, w.w_o, w.b_o, w.ln2, w.w_gu, w.w_down,
            g.num_heads, g.num_kv_heads, g.rms_norm_eps, g.scale, self._path_id)

    # The block's elementwise steps alone (bf16 [T, n] contiguous), for layers whose linears
    # the caller runs itself (MXFP4): same numerics as inside decoder_layer.
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, n] -> bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w)."""
        return self._ops.rms_norm(x, w, eps)

    def add_rms_norm(self, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> torch.Tensor:
        """h += y (in place, bf16), then returns rms_norm(h, w, eps)."""
        return self._ops.add_rms_norm(h, y, w, eps)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2 I] (gate | up) -> silu(gate) * up [T, I]."""
        return self._ops.silu_mul(gu)

    def add_(self, h: torch.Tensor, y: torch.Tensor) -> None:
        """h += y in place (bf16 rounding)."""
        self._ops.add_(h, y)


def native_decoder(path: KernelPath) -> NativeDecoder | None:
    """A NativeDecoder on path's library, or None for the reference path (no C++ here)."""
    if path.backend is Backend.REFERENCE or path.library is None or not path.library.cpu_avx512:
        return None
    return NativeDecoder(path)
