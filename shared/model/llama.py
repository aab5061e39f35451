"""The Llama-family decoder (Llama, Qwen2, Mistral, Qwen3, Phi-3, Qwen3-MoE) in plain torch, over
the paged KV cache. A Qwen3-MoE layer swaps its MLP for shared.model.moe's SparseMoeBlock.

Hot-path shape conventions: T = number of new tokens in the batch (all sequences packed,
sequence-major), H / KVH = query / kv heads, D = head_dim. q, k and v come out of one fused
Linear and gate/up out of another, so a decode step is a handful of matmuls per layer.
Parameters are created uninitialised (on the meta device, then `materialise`) and filled by
`load_weights`, which takes HF tensor names and fuses them on the fly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels.dense.layer import (
    LayerGeometry,
    LayerWeights,
    NativeDecoder,
    Projection,
    StepTables,
    pack_contiguous,
)
from kernels.mxfp4.backend import FUSED_MAX_ROWS
from shared.model.attention import AttentionMetadata, paged_attention
from shared.model.config import ModelConfig
from shared.model.materialise import materialise
from shared.model.moe import SparseMoeBlock, hf_expert_params
from shared.model.quant import (
    MXFP4Linear,
    QuantConfig,
    quantize_linears,
)
from shared.model.rope import RotaryEmbedding
from shared.model.weight_loading import HFWeightLoading

# HF per-layer name -> (our parameter, index of the fused slice or None).
_LAYER_PARAMS: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
    "self_attn.o_proj.bias": ("self_attn.o_proj.bias", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "self_attn.q_norm.weight": ("self_attn.q_norm.weight", None),  # Qwen3 (qk_norm)
    "self_attn.k_norm.weight": ("self_attn.k_norm.weight", None),
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
}
# Phi-3 stores q/k/v and gate/up already fused, in our order ([q; k; v], [gate; up]).
_PHI3_PARAMS: dict[str, tuple[str, int | None]] = {
    **{k: v for k, v in _LAYER_PARAMS.items() if v[1] is None},
    "self_attn.qkv_proj.weight": ("self_attn.qkv_proj.weight", None),
    "mlp.gate_up_proj.weight": ("mlp.gate_up_proj.weight", None),
}


class RMSNorm(nn.Module):
    """RMSNorm with HF numerics: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps
        self.shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Fused-qkv self-attention with RoPE, reading and writing one layer of the paged cache.
    With config.qk_norm (Qwen3), each query and key head is RMS-normalised before RoPE.
    `layer` (global index) picks the sliding window, config.window(layer), in every family."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.window = config.window(layer)  # sliding window of this layer, or None
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.qk_size = config.q_size + config.kv_size
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size,
                                  bias=config.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size,
                                bias=config.attention_out_bias, dtype=dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        # Family variants (shared.model.gemma, gpt_oss) set these on the plain path.
        self.softcap: float | None = None  # tanh cap on the scores
        self.sinks: nn.Parameter | None = None  # [H] sink logits

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = paged_attention(q, k, v, kv_layer, meta, self.scale,
                              window=self.window, softcap=self.softcap,
                              sinks=self.sinks)  # [T, H, D]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D]: QK-norm'd and rotated."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        qk = qkv[:, : self.qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # [T, H | KVH, D], over D
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]),
                            self.k_norm(qk[:, self.num_heads:])), dim=1)
        # Rotate q and k together: one RoPE application over H + KVH heads.
        qk = RotaryEmbedding.apply(qk, cos, sin)
        v = qkv[:, self.qk_size:].view(t, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads:], v

    def forward_native(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor,
                       tables: StepTables, native: NativeDecoder, g: LayerGeometry
                       ) -> torch.Tensor:
        """forward, with RoPE, the cache write and attention in one native call (any T)."""
        return self.o_proj(native.rope_attention(self.qkv_proj(x), kv_layer, cos_sin, tables, g,
                                                 self.window))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one Linear."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False,
                                   dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `layer` is the global index:
    it picks the dense MLP or, on a sparse layer of an MoE model, the routed experts."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(config.moe, config.hidden_size, dtype)
            if config.moe is not None and config.moe.is_sparse(layer) else MLP(config, dtype))
        self.fused: LayerWeights | None = None  # set by LlamaForCausalLM.use_native

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_native(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor,
                       tables: StepTables, native: NativeDecoder, g: LayerGeometry
                       ) -> torch.Tensor:
        """forward through native kernels on x [T, hidden] (bf16, contiguous, updated in
        place): the whole block in one call, except for an MXFP4 layer over more than
        FUSED_MAX_ROWS rows (prefill), whose linears then dequantise for torch's GEMM between
        the native norms, attention, SiLU and residual adds."""
        if self.fused is not None and fuses(self.fused.packed, x.shape[0]):
            native.decoder_layer(x, kv_layer, cos_sin, tables, self.fused, g,
                                 self.self_attn.window)
            return x
        attn, mlp = self.self_attn, self.mlp
        assert isinstance(mlp, MLP), "use_native keeps MoE models on plain torch"
        xn = native.rms_norm(x, self.input_layernorm.weight, g.rms_norm_eps)
        xn = native.add_rms_norm(x, attn.forward_native(xn, cos_sin, kv_layer, tables, native, g),
                                 self.post_attention_layernorm.weight, g.rms_norm_eps)
        native.add_(x, mlp.down_proj(native.silu_mul(mlp.gate_up_proj(xn))))
        return x

    def native_weights(self, mxfp4_path: int) -> LayerWeights | None:
        """This layer's tensors for the fused native block, or None when a linear is neither
        dense bf16 nor MXFP4 on the full library's code path mxfp4_path (the one the fused
        block calls), or the model is not bf16."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, MLP):  # routed experts: no fused kernel
            return None
        qkv, o, gate_up, down = (_projection(m, mxfp4_path)
                                 for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                           mlp.down_proj))
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        try:
            return LayerWeights(ln1=self.input_layernorm.weight, qkv=qkv, o=o,
                                ln2=self.post_attention_layernorm.weight, gate_up=gate_up,
                                down=down)
        except ValueError:  # norms not bf16
            return None


def fuses(packed: bool, rows: int) -> bool:
    """Whether a step of `rows` rows runs fused layers. MXFP4 ones only up to FUSED_MAX_ROWS:
    past that, dequantising once for torch's GEMM beats the GEMV kernel (MXFP4Linear's split)."""
    return not packed or rows <= FUSED_MAX_ROWS


def _projection(linear: nn.Module, mxfp4_path: int) -> Projection | None:
    """A linear's tensors for the fused layer, or None if the native kernels cannot run it."""
    try:
        if isinstance(linear, MXFP4Linear):
            if not linear.fusable(mxfp4_path):
                return None
            return Projection(linear.weight_blocks, linear.weight_scales, linear.bias)
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return None
        return Projection(weight, None, getattr(linear, "bias", None))
    except ValueError:  # wrong dtype or layout
        return None


class LlamaForCausalLM(HFWeightLoading):
    """A Llama-family causal LM, or one pipeline stage of it.

    `layer_range=(start, end)` builds only decoder layers start..end-1 (global indices); the
    embedding exists only when start == 0 and the final norm + lm_head only when
    end == num_layers. `forward` takes token ids [T] on the first stage and hidden states
    [T, hidden] on later ones, and `kv_cache` holds this stage's layers only (local index
    0 is layer `start`). With tied embeddings on a single stage, lm_head shares the embedding
    Parameter; a last stage without the embedding loads its own copy from the embedding
    weight. `quantization` swaps the linears for MXFP4Linear (shared.model.quant) before any
    weight is allocated; a quantised tied lm_head is its own packed copy of the embedding.
    Parameters start uninitialised: call `load_weights` before use.
    """

    # compute_logits is lm_head's output widened to fp32, nothing more: the greedy token may
    # come from the screened head (kernels/dense/greedy_head.py) instead. Gemma soft-caps.
    logits_are_head_output: bool = True

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int] | None = None,
                 *, dtype: torch.dtype = torch.float32,
                 quantization: QuantConfig | None = None) -> None:
        super().__init__()
        start, end = layer_range if layer_range is not None else (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer_range {layer_range} is not within 0..{config.num_layers}")
        self.config, self.dtype, self.quantization = config, dtype, quantization
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == config.num_layers
        with torch.device("meta"):
            # _weight skips nn.Embedding's normal_ init, which on meta imports torch._dynamo
            shape = (config.vocab_size, config.hidden_size)
            self.embed_tokens = (nn.Embedding(*shape, _weight=torch.empty(shape, dtype=dtype))
                                 if self.is_first else None)
            self.layers = nn.ModuleList(self.make_layer(config, dtype, i) for i in range(start, end))
            self.norm = self.make_norm(config, dtype) if self.is_last else None
            self.lm_head = (nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
                            if self.is_last else None)
        if quantization is not None:
            quantize_linears(self, quantization)
        materialise(self)  # not to_empty: see shared/model/materialise.py
        if (type(self.lm_head) is nn.Linear and self.embed_tokens is not None
                and config.tie_word_embeddings):
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings,
                                      dtype)
        self.geometry = LayerGeometry(config.num_heads, config.num_kv_heads, config.head_dim,
                                      config.rms_norm_eps, config.head_dim ** -0.5)
        self.native: NativeDecoder | None = None  # see use_native
        self._windows = [config.window(i) or 0 for i in range(start, end)]  # 0: full attention
        self._fused_stack: list[torch.Tensor | None] | None = None
        self._stack_packed = False  # some fused layer is MXFP4 (see fuses)
        self.requires_grad_(False)

    @staticmethod
    def make_layer(config: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        """Decoder layer `index` (global); a family variant overrides it (shared.model.gemma)."""
        return DecoderLayer(config, dtype, index)

    @staticmethod
    def make_norm(config: ModelConfig, dtype: torch.dtype) -> RMSNorm:
        """The final norm; a family variant overrides it."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def layer_params(self) -> dict[str, tuple[str, int | None]]:
        """HF per-layer tensor name -> (our parameter, fused slice or None) for this
        architecture (dense and sparse layers alike: _weight_map keeps the names a layer
        has); a family variant extends it."""
        if self.config.model_type == "phi3":
            return _PHI3_PARAMS
        if self.config.moe is not None:
            return {**_LAYER_PARAMS, **hf_expert_params(self.config.moe.num_experts)}
        return _LAYER_PARAMS

    def use_native(self, native: NativeDecoder) -> int:
        """Route forward through native's kernels (kernels.dense.layer) from now on: paged
        attention reads block tables directly, and layers whose linears are dense bf16 or
        MXFP4 run as fused blocks, the whole stack in one call per decode step. Returns the
        number of fused layers.

        Only for bf16 models over a bf16 KV cache (forward checks the cache each step and
        runs the plain-torch path otherwise, which stays the oracle). A head layout the kernels
        do not take, QK-norm (Qwen3) or routed experts (Qwen3-MoE) leaves the model on plain
        torch (returns 0). Partial rotary (Phi-4-mini) runs natively: the kernels rotate as
        many channels per head as the cos/sin table is wide.
        """
        if self.dtype != torch.bfloat16:
            raise ValueError(f"native decode kernels need a bf16 model, not {self.dtype}")
        moe = self.config.moe is not None  # routed experts have no native block either
        if not native.supports(self.geometry) or self.config.qk_norm or moe:
            return 0
        self.native = native
        for layer in self._decoder_layers:
            layer.fused = layer.native_weights(native.mxfp4_path)
        fused = [layer.fused for layer in self._decoder_layers if layer.fused is not None]
        # Every layer fused: the whole stack runs as one native call per step.
        self._fused_stack = ([t for w in fused for t in w.as_list()]
                             if len(fused) == len(self.layers) else None)
        if self._fused_stack is not None:  # one arena, in the order each step reads it
            pack_contiguous(self._fused_stack)
        head = getattr(self.lm_head, "weight", None)  # a sampled step streams all of it too
        if isinstance(head, torch.Tensor) and head.dtype == torch.bfloat16:
            pack_contiguous([head])  # (its own buffer: tied, it is the embedding as well)
        self._stack_packed = any(w.packed for w in fused)
        return len(fused)

    @property
    def _decoder_layers(self) -> Sequence[DecoderLayer]:
        """self.layers, typed: __init__ fills that ModuleList with DecoderLayers only."""
        return cast("Sequence[DecoderLayer]", self.layers)

    @property
    def num_local_layers(self) -> int:
        return self.end - self.start

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """ids [T] (or hidden [T, hidden] past stage 0) -> hidden [T, hidden], normed if last."""
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        if self.native is not None and kv_cache.dtype == h.dtype == torch.bfloat16:
            return self._forward_native(h, meta, kv_cache, self.native)
        cos, sin = self.rotary.lookup(positions)  # once per step, shared by every layer
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i], meta)
        return self.norm(h) if self.norm is not None else h

    def _forward_native(self, h: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                        native: NativeDecoder) -> torch.Tensor:
        tables = StepTables(meta.block_tables, meta.context_lens, meta.query_start)
        cos_sin = self.rotary.table(int(meta.context_lens.max()))  # positions < max context
        if not self.is_first:  # fused layers update h in place: never the caller's tensor
            h = h.clone(memory_format=torch.contiguous_format)
        if self._fused_stack is not None and fuses(self._stack_packed, h.shape[0]):
            native.decoder_layers(h, kv_cache, cos_sin, tables, self._fused_stack, self.geometry,
                                  windows=self._windows)
        else:
            for i, layer in enumerate(self._decoder_layers):
                h = layer.forward_native(h, cos_sin, kv_cache[i], tables, native, self.geometry)
        if self.norm is None:
            return h
        return native.rms_norm(h, self.norm.weight, self.geometry.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (last stage only)."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits needs the last pipeline stage")
        return self.lm_head(hidden).float()

