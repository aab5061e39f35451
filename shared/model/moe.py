"""The sparse mixture-of-experts block (Qwen3-MoE): its configuration, HF parsing and forward.

A sparse layer replaces the dense SwiGLU MLP by `num_experts` small SwiGLU experts and a
router (HF `mlp.gate`, a bias-free [num_experts, hidden] matrix). Each token goes to its
`top_k` experts, HF Qwen3MoeTopKRouter semantics exactly: softmax of the router logits in
fp32, top-k, renormalised to sum 1 when `norm_topk_prob`, cast back to the activation dtype;
the block's output is the routing-weighted sum of the chosen experts' outputs, added expert by
expert in ascending expert order (HF's order, so bf16 sums round alike).

Which layers are sparse follows HF: layer i (global index) is sparse iff it is not in
`mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`; the others keep a dense MLP of
`intermediate_size`. Experts are `moe_intermediate_size` wide.

Why per-expert nn.Linear modules (not one [E, 2I, H] tensor): a decode step must read only the
weights of the experts its tokens were routed to, and an nn.Linear per expert is what the rest
of the stack already speeds up or packs (kernels.dense's GEMV swap for bf16, MXFP4Linear under
`--quantization mxfp4`). The router is a bare Parameter, so neither swap touches it: routing
stays in the checkpoint's precision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# HF Qwen3MoeConfig defaults for keys a config.json may omit.
_DEFAULTS: dict[str, Any] = {"num_experts": 128, "num_experts_per_tok": 8,
                             "moe_intermediate_size": 768, "norm_topk_prob": False,
                             "decoder_sparse_step": 1, "mlp_only_layers": ()}


@dataclass(frozen=True)
class MoeConfig:
    """A sparse-MoE model's expert layout: how many experts, how many per token, how wide,
    whether the top-k weights are renormalised, and which layers are sparse (see is_sparse)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ValueError(f"num_experts ({self.num_experts}) and moe_intermediate_size "
                             f"({self.intermediate_size}) must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}),"
                             f" got {self.top_k}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        """Whether global decoder layer `layer` has the MoE block (HF Qwen3MoeDecoderLayer)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @staticmethod
    def from_hf(cfg: Mapping[str, Any]) -> MoeConfig | None:
        """Parse a Qwen3-MoE (text) config; None when it has no experts (every layer dense).

        HF writes `num_experts` under its attribute-map name `num_local_experts` on save;
        either is read, and both must agree when both are set."""
        named, local = cfg.get("num_experts"), cfg.get("num_local_experts")
        if named is not None and local is not None and int(named) != int(local):
            raise ValueError(f"num_experts ({named}) and num_local_experts ({local}) disagree")
        cfg = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        experts = named if named is not None else local if local is not None else cfg["num_experts"]
        if int(experts) == 0:
            return None
        return MoeConfig(num_experts=int(experts), top_k=int(cfg["num_experts_per_tok"]),
                         intermediate_size=int(cfg["moe_intermediate_size"]),
                         norm_topk_prob=bool(cfg["norm_topk_prob"]),
                         decoder_sparse_step=int(cfg["decoder_sparse_step"]),
                         mlp_only_layers=tuple(int(i) for i in cfg["mlp_only_layers"]))


def hf_expert_params(num_experts: int) -> dict[str, tuple[str, int | None]]:
    """HF per-layer tensor name -> (our parameter, fused slice or None) for a sparse layer:
    each expert's gate/up fuse into its gate_up_proj, as in the dense MLP."""
    out: dict[str, tuple[str, int | None]] = {"mlp.gate.weight": ("mlp.gate.weight", None)}
    for e in range(num_experts):
        hf, ours = f"mlp.experts.{e}.", f"mlp.experts.{e}."
        out[hf + "gate_proj.weight"] = (ours + "gate_up_proj.weight", 0)
        out[hf + "up_proj.weight"] = (ours + "gate_up_proj.weight", 1)
        out[hf + "down_proj.weight"] = (ours + "down_proj.weight", None)
    return out


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), gate and up fused into one Linear
    [2 I, hidden] (gate rows, then up rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """The top-k router: a bias-free [num_experts, hidden] projection (HF `mlp.gate.weight`)."""

    def __init__(self, config: MoeConfig, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size, dtype=dtype))
        self.top_k, self.norm_topk_prob = config.top_k, config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k] long)."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class SparseMoeBlock(nn.Module):
    """Routed experts in place of a dense MLP: x [T, hidden] -> [T, hidden].

    Only the experts some token was routed to run, each on the rows routed to it
    (index_select in, weighted index_add_ out), so a decode step reads top_k experts' weights
    per token at most, never the whole layer.
    """

    def __init__(self, config: MoeConfig, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = Router(config, hidden_size, dtype)
        self.experts = nn.ModuleList(Expert(hidden_size, config.intermediate_size, dtype)
                                     for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] each
        t = x.shape[0]
        # Routed pairs slot-major (pair j = token j % T, choice j // T), grouped by expert by a
        # stable sort: each expert's rows come in HF's order, so its matmul rounds alike.
        flat = ids.t().flatten()  # [k T]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weight = weights.t().flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]  # a token appears at most once per expert
            start += count
            rows = pairs % t
            y = self.experts[expert](x.index_select(0, rows))
            out.index_add_(0, rows, y * pair_weight[pairs].unsqueeze(1))
        return out
