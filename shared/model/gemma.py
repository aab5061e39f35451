"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's few differences, declared here.

What differs from `shared.model.llama` (HF transformers' modeling_gemma2 / modeling_gemma3):
- embeddings are scaled by sqrt(hidden_size), rounded to the model dtype first, as HF does;
- RMSNorm multiplies by (1 + weight), in float32, before casting back (`GemmaRMSNorm`);
- the MLP is GeGLU: gelu (tanh approximation) on the gate instead of SiLU;
- "sandwich" norms: the attention and MLP outputs are normalised again before each residual
  add (post_attention_layernorm, pre/post_feedforward_layernorm);
- attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5,
  soft-capped (Gemma 2: tanh(s / cap) * cap) and, on sliding layers, limited to a window;
- Gemma 3 RMS-normalises every query and key head (QK-norm, Gemma-style) and gives sliding
  layers their own RoPE base (`rope_local_base_freq`, 10,000 by default);
- Gemma 2 soft-caps the final logits too.

Layers alternate between sliding and full attention (`layer_types`; Gemma 2: every other layer,
Gemma 3: five sliding for every full one). The native fused kernels do not implement soft-capping,
sandwich norms or GeGLU, so Gemma runs the plain-torch path (`use_native` declines).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.attention import AttentionMetadata
from shared.model.config import ModelConfig
from shared.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from shared.model.rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalise and scale by (1 + weight) in float32, then cast back (HF
    multiplies before the cast, unlike Llama)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's inner product: gelu_tanh(gate) * up, for gate_up [T, 2 * intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def scaled_embedding(embed: nn.Embedding, ids: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """embed(ids) * sqrt(hidden), the scale rounded to the embedding dtype first (HF: 55.5,
    not 55.43, for hidden 3072 in bf16)."""
    weight = embed.weight
    scale = torch.tensor(hidden_size ** 0.5, dtype=torch.float32).to(weight.dtype)
    return embed(ids) * scale


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap, or x unchanged when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaAttention(Attention):
    """Llama's fused-qkv attention with Gemma's score scale, soft-cap and window, and
    Gemma-style QK-norm (Gemma 3)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__(config, dtype, layer)
        spec = config.gemma
        assert spec is not None
        self.scale = spec.query_pre_attn_scalar ** -0.5
        self.softcap = spec.attn_softcap
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)


class GemmaMLP(MLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), Llama's fused layout with another activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block: x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.self_attn = GemmaAttention(config, dtype, layer)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.mlp = GemmaMLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.sliding = self.self_attn.window is not None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


_EXTRA_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


class GemmaForCausalLM(LlamaForCausalLM):
    """A Gemma 2 / Gemma 3 text model, or one pipeline stage of it: LlamaForCausalLM with
    Gemma layers and final norm, the embedding scale, the sliding layers' own RoPE table, and
    final-logit soft-capping. Runs the plain-torch path only (see the module docstring)."""

    logits_are_head_output = False  # soft-capped: tanh can tie logits the head kept apart

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int] | None = None,
                 **kw: Any) -> None:
        super().__init__(config, layer_range, **kw)
        assert config.gemma is not None
        self.spec = config.gemma
        self.local_rotary = RotaryEmbedding(self.spec.local_rope, config.head_dim,
                                            config.max_position_embeddings, self.dtype)

    @staticmethod
    def make_layer(config: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return GemmaDecoderLayer(config, dtype, index)

    @staticmethod
    def make_norm(config: ModelConfig, dtype: torch.dtype) -> RMSNorm:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def layer_params(self) -> dict[str, tuple[str, int | None]]:
        return {**super().layer_params(), **{n: (n, None) for n in _EXTRA_NORMS}}

    def use_native(self, native: Any) -> int:
        return 0  # no soft-cap, sandwich-norm or GeGLU kernels: the plain path serves Gemma

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """ids [T] (or hidden [T, hidden] past stage 0) -> hidden [T, hidden], normed if last."""
        if self.embed_tokens is not None:
            h = scaled_embedding(self.embed_tokens, input_ids, self.config.hidden_size)
        else:
            h = input_ids
        full = self.rotary.lookup(positions)  # once per step and RoPE kind
        local = self.local_rotary.lookup(positions) if self.spec.version == 3 else full
        for i, layer in enumerate(self.layers):
            cos, sin = local if layer.sliding else full
            h = layer(h, cos, sin, kv_cache[i], meta)
        return self.norm(h) if self.norm is not None else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(super().compute_logits(hidden), self.spec.final_softcap)
