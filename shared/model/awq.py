"""Activation-aware channel scales (AWQ) folded into the op before a linear, ahead of GPTQ.

MXFP4 gives every 32 input channels of a weight row one power-of-two scale, so a channel that
carries large activations is rounded as coarsely as its quiet neighbours. Multiplying input
channel j of W by s_j > 1 and dividing the producer of that channel by s_j leaves the dense
model's function unchanged, but lets the rounding spend its precision where |x| is large.

In a pre-norm decoder layer (shared.model.llama.DecoderLayer) each linear's input comes from an
op that absorbs a per-channel factor exactly:

  input_layernorm.weight            -> qkv_proj columns       (x = norm(h) * w)
  post_attention_layernorm.weight   -> gate_up_proj columns
  the v rows of qkv_proj (and bias) -> o_proj columns         (attention is linear in v)
  the up rows of gate_up_proj       -> down_proj columns      (silu(gate) * up)

o_proj's column (head h, channel d) reads kv head h // (H / KVH)'s v channel d, so its scales
are one per kv-head channel, repeated over the group's query heads.
A quantised LM head takes its scales the same way, from the final norm (shared.model.gptq).

The search (AWQ's): s = mean|x|^alpha, normalised to geometric mean 1 of its extremes, with
alpha on a grid over [0, 1]; the alpha that minimises the layer output's squared error
trace(dW H dW^T) of the MSE-encoded weight (dW = Q(W diag(s)) diag(1/s) - W, H = E[x x^T])
wins. alpha = 0 is s = 1, so no linear gets worse by that measure than unscaled. The error is
measured on at most SEARCH_ROWS evenly spaced rows of W: every row is rounded on its own, so
a row sample estimates the same sum, and the search costs the same for a 7B model's 22k-row
gate/up projection as for SmolLM2's 3k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import torch
from torch import nn

from kernels import mxfp4
from shared.model.config import ModelConfig
from shared.model.llama import MLP, DecoderLayer, RMSNorm

SEARCH_ROWS = 4096  # rows of W the search measures (all of SmolLM2-135M's: <= 3,072)

# The four groups, in the order they are searched and folded (AWQ's own): each search sees
# the layer as it stands, so qkv_proj's and gate_up_proj's come before the o_proj and
# down_proj folds rescale their v and up rows. The reverse order measured worse on SmolLM2
# (story / technical perplexity 36.69 / 38.78 against 34.39 / 38.29).
GROUPS = ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class InputStats:
    """One linear's calibration inputs x [T, in]: mean |x| per channel [in] and H = E[x x^T]
    [in, in] (float64)."""

    mean_abs: torch.Tensor
    hessian: torch.Tensor


@dataclass(frozen=True)
class Folded:
    """What `fold_layer` did: the alpha chosen per linear (0: left unscaled), the output error
    it reached relative to unscaled, each linear's input scales s [in] (x' = x / s), and the
    layer's dense parameters it rewrote besides the linears' weights ("input_layernorm.weight",
    "self_attn.qkv_proj.bias"...)."""

    alpha: dict[str, float]
    relative_error: dict[str, float]
    scales: dict[str, torch.Tensor]
    changed: tuple[str, ...]


def foldable(layer: nn.Module) -> TypeGuard[DecoderLayer]:
    """Whether `layer` is the plain pre-norm block whose producers absorb scales exactly (not
    Gemma's sandwich norms or (1 + w) weights, not gpt-oss, not a routed-expert MLP)."""
    return (type(layer) is DecoderLayer and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm and type(layer.mlp) is MLP)


def output_error(w: torch.Tensor, h: torch.Tensor, s: torch.Tensor) -> float:
    """trace(dW H dW^T) for W [out, in] scaled by s [in] and MSE-encoded to MXFP4."""
    blocks, scales = mxfp4.quantize(w * s, encoder=mxfp4.Encoder.MSE)
    dw = mxfp4.dequantize(blocks, scales, torch.float32) / s - w  # [out, in]
    return float(((dw @ h) * dw).sum())


def search_scales(w: torch.Tensor, stats: InputStats, grid: int,
                  tie: Callable[[torch.Tensor], torch.Tensor] = lambda m: m,
                  ) -> tuple[float, float, torch.Tensor]:
    """W [out, in] fp32 -> (alpha, error relative to s = 1, s [in]). `tie` maps mean |x| to
    the mean the scales may follow (o_proj: averaged over each kv head's group, repeated)."""
    h = stats.hessian.to(torch.float32)
    w = w[:: -(-w.shape[0] // SEARCH_ROWS)]  # evenly spaced rows, at most SEARCH_ROWS
    magnitude = tie(stats.mean_abs.to(torch.float32)).clamp(min=1e-5)
    ones = torch.ones_like(magnitude)
    base = output_error(w, h, ones)
    best = (base, 0.0, ones)
    for k in range(1, grid + 1):
        s = magnitude ** (k / grid)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(w, h, s)
        if err < best[0]:
            best = (err, k / grid, s)
    err, alpha, s = best
    return alpha, (err / base if base > 0 else 1.0), s


@torch.no_grad()
def fold_layer(layer: DecoderLayer, config: ModelConfig, stats: dict[str, InputStats],
               grid: int = 20) -> Folded:
    """Search and fold the scales of `layer`'s four linears in place (fp32 weights); stats
    are their inputs as the layer computes them before the fold."""
    attn, mlp = layer.self_attn, layer.mlp
    assert foldable(layer) and isinstance(mlp, MLP), type(layer)
    group = config.num_heads // config.num_kv_heads
    inter = mlp.down_proj.in_features

    def per_kv_channel(m: torch.Tensor) -> torch.Tensor:  # [H * D] -> the same, tied per group
        m = m.view(config.num_kv_heads, group, config.head_dim).mean(1, keepdim=True)
        return m.expand(-1, group, -1).reshape(-1)

    def o_producer(s: torch.Tensor) -> None:  # v rows (and bias) of qkv_proj
        sv = s.view(config.num_kv_heads, group, config.head_dim)[:, 0].reshape(-1)  # [KVH * D]
        lo = config.q_size + config.kv_size
        attn.qkv_proj.weight[lo:].div_(sv[:, None])
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias[lo:].div_(sv)

    def down_producer(s: torch.Tensor) -> None:  # up rows of gate_up_proj
        mlp.gate_up_proj.weight[inter:].div_(s[:, None])
        if mlp.gate_up_proj.bias is not None:
            mlp.gate_up_proj.bias[inter:].div_(s)

    def bias(linear: nn.Linear, name: str) -> tuple[str, ...]:
        return (name,) if linear.bias is not None else ()

    # linear -> (module, its producer's fold, the scales' tie, the dense parameters it rewrites)
    producers: dict[str, tuple[nn.Linear, Callable[[torch.Tensor], object],
                               Callable[[torch.Tensor], torch.Tensor], tuple[str, ...]]] = {
        "self_attn.o_proj": (attn.o_proj, o_producer, per_kv_channel,
                             bias(attn.qkv_proj, "self_attn.qkv_proj.bias")),
        "mlp.down_proj": (mlp.down_proj, down_producer, lambda m: m,
                          bias(mlp.gate_up_proj, "mlp.gate_up_proj.bias")),
        "self_attn.qkv_proj": (attn.qkv_proj, layer.input_layernorm.weight.div_, lambda m: m,
                               ("input_layernorm.weight",)),
        "mlp.gate_up_proj": (mlp.gate_up_proj, layer.post_attention_layernorm.weight.div_,
                             lambda m: m, ("post_attention_layernorm.weight",)),
    }
    alphas, errors, scales = {}, {}, {}
    changed: list[str] = []
    for name in GROUPS:
        linear, producer, tie, params = producers[name]
        alpha, rel, s = search_scales(linear.weight.float(), stats[name], grid, tie)
        alphas[name], errors[name], scales[name] = alpha, rel, s
        if alpha > 0:
            linear.weight.mul_(s.to(linear.weight.dtype))
            producer(s.to(linear.weight.dtype))
            changed += params
    return Folded(alphas, errors, scales, tuple(changed))
