"""gpt-oss: the Llama decoder with routed, biased experts and attention sinks.

What differs from `shared.model.llama` (HF transformers' modeling_gpt_oss):
- every layer's MLP is a mixture of experts: a biased router, top-k of its logits softmaxed,
  and experts with biases whose gate_up rows interleave gate and up (row 2i gate, 2i+1 up) and
  whose activation is a clamped SwiGLU: (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g) with
  g = clamp(gate, max=limit);
- attention has q/k/v/o biases, one learnt sink logit per head (it joins the softmax's
  denominator and attends to nothing), and every other layer a 128-token sliding window;
- RMSNorm multiplies by its weight in float32 before casting back;
- RoPE is YaRN (shared.model.rope).

Experts are one nn.Linear pair each, as in `shared.model.moe`, so a decode step reads only the
routed experts and MXFP4 swaps them for MXFP4Linear. HF stores them stacked: dense
`mlp.experts.gate_up_proj` [E, hidden, 2I] (transposed) and `down_proj` [E, I, hidden], or, in
OpenAI's checkpoints, MXFP4 `*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32] in
exactly the layout of kernels/README.md, which load into MXFP4Linear as they are (no
dequantisation). `load_weights` unstacks both per expert. The native fused kernels have no
sinks or expert layers, so gpt-oss runs the plain-torch path (`use_native` declines).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.attention import AttentionMetadata
from shared.model.config import ModelConfig
from shared.model.gpt_oss_config import GptOssSpec
from shared.model.llama import _LAYER_PARAMS, Attention, LlamaForCausalLM, RMSNorm
from shared.model.moe import Router, SparseMoeBlock

# HF's stacked expert tensors: (layer, what, suffix); suffix "" is the dense weight.
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                      r"(_bias|_blocks|_scales|)$")
_ATTENTION = {k: v for k, v in _LAYER_PARAMS.items() if not k.startswith("mlp.")}


class GptOssRMSNorm(RMSNorm):
    """RMSNorm that scales in float32 before the cast (HF GptOssRMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.shape, None, self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class SinkAttention(Attention):
    """Biased fused-qkv attention with per-head sink logits and the layer's window."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__(config, dtype, layer)
        self.sinks = nn.Parameter(torch.empty(config.num_heads, dtype=dtype))


class ClampedExpert(nn.Module):
    """One expert: down((clamp(up) + 1) * glu(clamp(gate))), gate/up interleaved by row."""

    def __init__(self, spec: GptOssSpec, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * spec.intermediate_size, bias=True, dtype=dtype)
        self.down_proj = nn.Linear(spec.intermediate_size, hidden, bias=True, dtype=dtype)
        self.alpha, self.limit = spec.swiglu_alpha, spec.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [n, 2I]: gate, up, gate, up...
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class BiasedRouter(Router):
    """Router logits W x + b; the top-k logits are softmaxed (in their dtype) into weights."""

    def __init__(self, spec: GptOssSpec, hidden: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # Router's own parameters are not built
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(spec.num_experts, dtype=dtype))
        self.top_k = spec.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k] long)."""
        top, ids = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), ids


class GptOssMoE(SparseMoeBlock):
    """SparseMoeBlock's routed dispatch (only routed experts run) over gpt-oss's router and
    experts."""

    def __init__(self, spec: GptOssSpec, hidden: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # SparseMoeBlock's own router and experts are not built
        self.num_experts = spec.num_experts
        self.gate = BiasedRouter(spec, hidden, dtype)
        self.experts = nn.ModuleList(ClampedExpert(spec, hidden, dtype)
                                     for _ in range(spec.num_experts))


class GptOssDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        assert config.gpt_oss is not None
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GptOssRMSNorm(size, eps, dtype)
        self.self_attn = SinkAttention(config, dtype, layer)
        self.post_attention_layernorm = GptOssRMSNorm(size, eps, dtype)
        self.mlp = GptOssMoE(config.gpt_oss, size, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(LlamaForCausalLM):
    """A gpt-oss model, or one pipeline stage of it: LlamaForCausalLM with gpt-oss layers and
    final norm, loading HF's stacked expert tensors (dense or MXFP4) expert by expert."""

    @staticmethod
    def make_layer(config: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return GptOssDecoderLayer(config, dtype, index)

    @staticmethod
    def make_norm(config: ModelConfig, dtype: torch.dtype) -> RMSNorm:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def layer_params(self) -> dict[str, tuple[str, int | None]]:
        spec = self.config.gpt_oss
        assert spec is not None
        out: dict[str, tuple[str, int | None]] = {
            **_ATTENTION, "self_attn.sinks": ("self_attn.sinks", None),
            "mlp.router.weight": ("mlp.gate.weight", None),
            "mlp.router.bias": ("mlp.gate.bias", None)}
        for e in range(spec.num_experts):
            for proj in ("gate_up_proj", "down_proj"):
                for kind in ("weight", "bias"):
                    name = f"mlp.experts.{e}.{proj}.{kind}"
                    out[name] = (name, None)
        return out

    def use_native(self, native: Any) -> int:
        return 0  # no sink or expert kernels: the plain path serves gpt-oss

    def wants_weight(self, name: str) -> bool:
        m = _STACKED.fullmatch(name)
        if m is not None:
            return self.start <= int(m.group(1)) < self.end
        return super().wants_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_unstacked(weights))


def _unstacked(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's stacked expert tensors as per-expert ones, in our names (others pass through).

    Dense weights are stored transposed ([E, in, out]); MXFP4 blocks and scales are stored
    [E, out, ...], each expert's slice being exactly an MXFP4Linear's weight_blocks /
    weight_scales."""
    for name, tensor in weights:
        m = _STACKED.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        layer, proj, suffix = m.groups()
        target = {"": "weight", "_bias": "bias", "_blocks": "weight_blocks",
                  "_scales": "weight_scales"}[suffix]
        for e in range(tensor.shape[0]):
            piece = tensor[e].t() if suffix == "" else tensor[e]
            yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.{target}", piece
