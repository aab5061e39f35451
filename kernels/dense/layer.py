"""The fused decoder layer and native paged attention: one C++ call per decode step.

    native = native_decoder(path)      # None for the reference path (no compiled tier)
    out = native.rope_attention(qkv, kv_layer, cos_sin, tables, geometry)   # [T, H D]
    native.decoder_layer(h, kv_layer, cos_sin, tables, weights, geometry)   # h updated in place
    native.decoder_layers(h, kv_cache, cos_sin, tables, stack, geometry)    # every layer at once

Each takes an optional sliding window per layer (HF semantics: the query at position p attends to
keys p - W < k <= p; 0 or None is full causal attention). Keys before a window are never read,
so their block-table entries may name any valid block (the engine drops those blocks).

rope_attention does RoPE on q and k (over the first R channels of each head, R the cos/sin
table's width: partial rotary when R < head_dim), writes K/V into the paged cache and runs
causal attention over each sequence's context straight from its block table (no gather, no
padding; prefill chunks and decode rows in one batch). decoder_layer runs a whole pre-norm Llama block on the
bf16 residual stream h [T, hidden]: RMSNorm, fused-qkv projection, RoPE + cache write +
attention, o projection + residual, RMSNorm, gate/up projection, SiLU * up, down projection +
residual. A dense projection of up to 32 rows runs the dense GEMV, a larger one (prefill) torch's
bf16 GEMM, as DenseLinear does; an MXFP4 projection runs kernels.mxfp4's fused kernel on the
packed bytes (its code path of the same tier), as MXFP4Linear does for decode rows. Every op
runs the kernels of path's tier (avx512_bf16, avx512 or avx2). Numerics follow HF in bf16
(fp32 math, bf16 rounding after each op, attention in fp32), so the plain-torch layer in
shared/model/llama.py is the oracle (tests/kernels/test_dense_layer.py). The elementwise ops
(rms_norm, add_rms_norm, silu_mul, add_) serve callers that run the projections themselves (an
MXFP4 prefill).
Everything here is bf16-only: the model, the cache and the cos/sin table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.dense.backend import Backend, KernelPath
from kernels.huge_pages import huge_page_bytes, huge_page_empty

log = logging.getLogger(__name__)

# The kernels.mxfp4 code path (its ops' `path`) that MXFP4 projections run inside the fused
# layer, per dense backend: the same tier (mxfp4: 1 avx512, 2 avx2, 3 avx512_bf16, which uses
# vdpbf16ps for bf16 x like the dense AVX512_BF16 GEMV).
MXFP4_PATHS = {Backend.AVX512_BF16: 3, Backend.AVX512: 1, Backend.AVX2: 2}
MXFP4_ACT_INT8 = 16  # ORed onto an MXFP4 path: int8 activations (kernels.mxfp4.backend.ACT_INT8)


@dataclass(frozen=True)
class LayerGeometry:
    """Head layout and constants shared by every layer of a model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    scale: float  # softmax scale, head_dim ** -0.5


@dataclass(frozen=True)
class Projection:
    """One linear's tensors (the model's own, not copies): dense, weight bf16 [n, k] with an
    optional bf16 or fp32 bias; or MXFP4, weight = blocks uint8 [n, k/32, 16] with scales uint8
    [n, k/32] and an optional fp32 bias (kernels/README.md has the format)."""

    weight: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        dense = self.scales is None
        want = ((torch.bfloat16, 2) if dense else (torch.uint8, 3))
        if (self.weight.dtype, self.weight.dim()) != want or not self.weight.is_contiguous():
            raise ValueError(f"Projection.weight must be a contiguous {want[0]} {want[1]}-D tensor")
        if self.scales is not None and (self.scales.dtype != torch.uint8
                                        or not self.scales.is_contiguous()):
            raise ValueError("Projection.scales must be a contiguous uint8 tensor")
        bias_dtypes = (torch.bfloat16, torch.float32) if dense else (torch.float32,)
        if self.bias is not None and (self.bias.dtype not in bias_dtypes
                                      or not self.bias.is_contiguous()):
            raise ValueError(f"Projection.bias must be a contiguous {bias_dtypes} tensor")

    @property
    def packed(self) -> bool:
        return self.scales is not None


@dataclass(frozen=True)
class LayerWeights:
    """One layer's parameters: bf16 norm weights ln1 / ln2 [hidden] and four projections,
    qkv [(H + 2 KVH) D, hidden], o [hidden, H D], gate_up [2 I, hidden] (gate rows then up
    rows) and down [hidden, I], each dense bf16 or MXFP4."""

    ln1: torch.Tensor
    qkv: Projection
    o: Projection
    ln2: torch.Tensor
    gate_up: Projection
    down: Projection

    def __post_init__(self) -> None:
        for name in ("ln1", "ln2"):
            t = getattr(self, name)
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError(f"LayerWeights.{name} must be a contiguous bf16 tensor")

    @property
    def packed(self) -> bool:
        """Some projection is MXFP4."""
        return any(p.packed for p in (self.qkv, self.o, self.gate_up, self.down))

    def as_list(self) -> list[torch.Tensor | None]:
        """The 14 entries decoder_layers takes per layer: ln1, ln2, then (weight, scales,
        bias) of qkv, o, gate_up and down."""
        out: list[torch.Tensor | None] = [self.ln1, self.ln2]
        for p in (self.qkv, self.o, self.gate_up, self.down):
            out += [p.weight, p.scales, p.bias]
        return out


@dataclass(frozen=True)
class StepTables:
    """The batch as the native attention reads it (int32; see AttentionMetadata)."""

    block_tables: torch.Tensor  # [B, max_blocks]
    context_lens: torch.Tensor  # [B], computed + new tokens
    query_start: torch.Tensor  # [B + 1], row of each sequence's first new token; [B] = T


class NativeDecoder:
    """The fused-layer and paged-attention ops of the loaded dense library.

    Holds the KernelPath whose library registered the ops; every op runs that path's tier, the
    GEMVs inside decoder_layer the same code path that the path's DenseLinear would, and MXFP4
    projections kernels.mxfp4's full library on mxfp4_path (the same tier), which must be
    loaded. Inputs are validated in C++ (a bad block table raises instead of reading out of
    bounds; a tier this CPU cannot run raises).
    """

    def __init__(self, path: KernelPath, mxfp4_int8: bool = False) -> None:
        if path.library is None or path.backend is Backend.REFERENCE:
            raise ValueError("NativeDecoder needs a compiled backend of the dense library")
        self.path = path
        self._ops = path.library.ops
        self._path_id = path.backend.path_id
        # What MXFP4 projections run when fused; mxfp4_int8: with int8 activations (W4A8).
        self.mxfp4_path = MXFP4_PATHS[path.backend] | (MXFP4_ACT_INT8 if mxfp4_int8 else 0)
        self._layers = self._ops.decoder_layers.default  # resolved once: the per-step call

    @property
    def prefill_attention_kernel(self) -> str:
        """Which kernel runs this tier's prefill attention (sequences of 16 or 64+ new rows):
        the bf16 flash kernel on avx512_bf16 without AMX, the fp32 one on avx2, else torch's
        CPU flash kernel."""
        return str(self._ops.prefill_attention_kernel(self._path_id))

    @staticmethod
    def supports(g: LayerGeometry) -> bool:
        """Whether the kernels take this head layout (up to 16 query heads per kv head)."""
        return (g.num_kv_heads > 0 and g.num_heads % g.num_kv_heads == 0
                and g.num_heads // g.num_kv_heads <= 16 and g.head_dim % 2 == 0)

    def decoder_layers(self, h: torch.Tensor, kv_cache: torch.Tensor, cos_sin: torch.Tensor,
                       tables: StepTables, stack: list[torch.Tensor | None], g: LayerGeometry,
                       team: bool = True, windows: list[int] | None = None) -> None:
        """decoder_layer over every layer of kv_cache [L, 2, ...] in one call (one dispatch
        per step); stack = the layers' LayerWeights.as_list() concatenated, layer 0 first;
        windows = each layer's sliding window (0: full), or None when no layer slides.

        With `team` (the default), a decode-sized step (T <= 32) of dense layers runs in one
        parallel region for the whole stack (csrc/decode_team.cpp) instead of one per op; the
        result is bit-identical, so team=False is the per-op oracle the tests compare with."""
        self._layers(h, kv_cache, cos_sin, tables.block_tables, tables.context_lens,
                     tables.query_start, stack, g.num_heads, g.num_kv_heads, g.rms_norm_eps,
                     g.scale, self._path_id, self.mxfp4_path, team, windows or [])

    def rope_attention(self, qkv: torch.Tensor, kv_layer: torch.Tensor, cos_sin: torch.Tensor,
                       tables: StepTables, g: LayerGeometry, window: int | None = None
                       ) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) D] -> attention output [T, H D]; writes K/V of the new rows."""
        return self._ops.rope_attention(
            qkv, kv_layer, cos_sin, tables.block_tables, tables.context_lens,
            tables.query_start, g.num_heads, g.num_kv_heads, g.scale, self._path_id, window or 0)

    def decoder_layer(self, h: torch.Tensor, kv_layer: torch.Tensor, cos_sin: torch.Tensor,
                      tables: StepTables, w: LayerWeights, g: LayerGeometry,
                      window: int | None = None) -> None:
        """h [T, hidden] bf16 (contiguous) -> h after the whole block, in place."""
        self.decoder_layers(h, kv_layer.unsqueeze(0), cos_sin, tables, w.as_list(), g,
                            windows=[window or 0])

    # The block's elementwise steps alone (bf16 [T, n] contiguous), for callers that run the
    # projections themselves (an MXFP4 prefill): same numerics as inside decoder_layer.
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, n] -> bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w)."""
        return self._ops.rms_norm(x, w, eps, self._path_id)

    def add_rms_norm(self, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> torch.Tensor:
        """h += y (in place, bf16), then returns rms_norm(h, w, eps)."""
        return self._ops.add_rms_norm(h, y, w, eps, self._path_id)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2 I] (gate | up) -> silu(gate) * up [T, I]."""
        return self._ops.silu_mul(gu, self._path_id)

    def add_(self, h: torch.Tensor, y: torch.Tensor) -> None:
        """h += y in place (bf16 rounding)."""
        self._ops.add_(h, y, self._path_id)


def native_decoder(path: KernelPath, mxfp4_int8: bool = False) -> NativeDecoder | None:
    """A NativeDecoder on path's library, or None for the reference path (no C++ here)."""
    if path.backend is Backend.REFERENCE or path.library is None:
        return None
    return NativeDecoder(path, mxfp4_int8)


def pack_contiguous(tensors: list[torch.Tensor | None], align: int = 64) -> int:
    """Move every tensor (contiguous, distinct) into one buffer, in list order; returns its size.

    Each tensor keeps its identity, dtype and shape and takes the new storage (`t.data = ...`),
    so a module whose Parameter is in the list reads the same numbers from the new place and
    nothing is held twice. Why: a decode step streams the fused stack in exactly this order,
    and the GEMV's software prefetch runs a few KiB ahead of each matrix; when the next
    matrix starts where this one ends, that prefetch (and the hardware's) already fetches it.
    Measured on SmolLM2-135M, 30 layers, m = 1, 2 threads: ~8% less time than the same
    weights in their separate allocations. The buffer is on huge pages where the kernel grants
    them (kernels/huge_pages.py): another ~10%.
    """
    live = [t for t in tensors if t is not None]
    if len({t.data_ptr() for t in live}) != len(live):
        raise ValueError("pack_contiguous: a tensor appears twice (or two share storage)")
    if not all(t.is_contiguous() for t in live):
        raise ValueError("pack_contiguous: tensors must be contiguous")
    sizes = [(t.numel() * t.element_size() + align - 1) // align * align for t in live]
    arena = huge_page_empty(sum(sizes))
    assert arena.data_ptr() % align == 0, "huge_page_empty starts on a 2 MiB boundary"
    offset = 0
    for t, size in zip(live, sizes, strict=True):
        nbytes = t.numel() * t.element_size()
        view = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        t.data = view
        offset += size
    log.info("packed %d weight tensor(s) into %.1f MiB, %.1f MiB of it on huge pages", len(live),
             arena.numel() / 2**20, huge_page_bytes(arena) / 2**20)
    return int(arena.numel())
