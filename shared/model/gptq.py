"""GPTQ calibration of a whole model: per-layer input Hessians, then kernels.mxfp4.gptq.

`GptqEncoder(model_dir, sequences, config)` loads the dense checkpoint in fp32, runs the
calibration token sequences through it once, and then quantises the decoder layer by layer:

  for layer i: H = mean x^T x of each nn.Linear's input [in, in] (qkv_proj, o_proj,
  gate_up_proj, down_proj), collected by running layer i alone on its stored inputs; with
  config.awq, activation-aware channel scales are searched and folded into the ops before
  those linears (shared.model.awq; H follows: H / (s s^T)); each weight is GPTQ-rounded
  under its H; the layer's outputs become layer i+1's inputs.

With `sequential` (the default) layer i's weights are replaced by their quantised values
before its outputs are recomputed, so layer i+1 is calibrated on the inputs it will see when
served quantised (GPTQ's own order); without it every H comes from the dense model (one
dense pass). The LM head, when quantised, is calibrated on the final norm's outputs.

The encoder then serves packed bytes by HF tensor name (`pack`), cutting a fused module's
rows (q/k/v of qkv_proj, gate/up of gate_up_proj) back out: GPTQ is row-independent given H,
so q, k and v packed separately under their shared input's H are the fused rows. The dense
tensors the fold changed (norm weights, a v or up bias) are served by HF name too (`dense`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.mxfp4 import reference
from kernels.mxfp4.gptq import DEFAULT_DAMP, quantize_gptq
from shared.model import awq
from shared.model.attention import AttentionMetadata
from shared.model.llama import LlamaForCausalLM, RMSNorm
from shared.model.loader import load_model

Packed = tuple[torch.Tensor, torch.Tensor]  # (blocks uint8 [out, in/32, 16], scales [out, in/32])
# One layer call's arguments past the hidden state (cos, sin, kv_layer, meta...) and kwargs.
_LayerArgs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class GptqConfig:
    """How `pdmesh quantize --method gptq` calibrates: damp is the fraction of mean(diag(H))
    added to H's diagonal; sequential calibrates layer i on layer < i already quantised;
    lm_head quantises (and calibrates) the LM head too; awq folds activation-aware channel
    scales (searched over awq_grid exponents) into every layer where they fold exactly."""

    damp: float = DEFAULT_DAMP
    # Layer-sequential by default: it measured better. SmolLM2-135M bf16 perplexity, story /
    # technical text (benchmarks/gptq_mxfp4.py, dense 26.88 / 32.72, MSE 43.23 / 50.25), damp
    # 0.1: generated calibration (4041 tokens) sequential 36.32 / 42.46, dense pass
    # 37.04 / 42.38; README.md calibration (2048 tokens) sequential 42.34 / 45.01, dense
    # pass 43.36 / 47.71 (earlier exponent rule); damp 0.03, generated: 36.93 / 42.78 vs
    # 36.40 / 43.25.
    sequential: bool = True
    lm_head: bool = False
    # On by default: it measured better. SmolLM2-135M bf16, story / technical text, damp 0.1,
    # generated calibration (benchmarks/gptq_mxfp4.py): GPTQ 37.23 / 40.05, AWQ scales then
    # GPTQ 34.39 / 38.29 (dense 26.86 / 32.79); AWQ scales with MSE rounding alone 39.83 /
    # 41.97.
    awq: bool = True
    awq_grid: int = 20

    def __post_init__(self) -> None:
        if not self.damp > 0:
            raise ValueError(f"damp must be > 0 (a fraction of mean(diag(H))), got {self.damp}")
        if self.awq_grid < 1:
            raise ValueError(f"awq_grid must be >= 1, got {self.awq_grid}")


class _Hessians:
    """Forward hooks summing x^T x (float64 [in, in]) and |x| ([in]) of each watched module's
    input rows."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.abs_sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Any:
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], _out: Any) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float64)  # [T, in]
            self.add(name, x)
        return hook

    def add(self, name: str, x: torch.Tensor) -> None:
        """x [T, in] of module `name`'s inputs."""
        total = self.sums.get(name)
        self.sums[name] = x.T @ x if total is None else total.addmm_(x.T, x)
        self.abs_sums[name] = x.abs().sum(0) + self.abs_sums.get(name, 0)
        self.rows[name] = self.rows.get(name, 0) + x.shape[0]

    def mean(self, name: str) -> torch.Tensor:
        if name not in self.sums:
            raise ValueError(f"no calibration input reached {name}")
        return self.sums[name] / self.rows[name]

    def stats(self, name: str) -> awq.InputStats:
        return awq.InputStats(self.abs_sums[name] / self.rows[name], self.mean(name))

    def rescale(self, name: str, s: torch.Tensor) -> None:
        """The inputs became x / s [in] (scales folded into their producer)."""
        inv = 1.0 / s.to(torch.float64)
        self.sums[name].mul_(inv[:, None] * inv[None, :])
        self.abs_sums[name].mul_(inv)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once what it needs is recorded."""


def _layer_inputs(model: LlamaForCausalLM, ids: list[int],
                  ) -> tuple[torch.Tensor, list[_LayerArgs]]:
    """One prefill of ids (a fresh sequence) -> (layer 0's hidden input [T, hidden], each
    layer's other arguments: RoPE tables, its KV-cache slice, the attention metadata)."""
    c, n, block = model.config, len(ids), 16
    blocks = -(-n // block)
    kv = torch.zeros(c.num_layers, 2, blocks, block, c.num_kv_heads, c.head_dim,
                     dtype=model.dtype)
    meta = AttentionMetadata.build([0], [n], [list(range(blocks))], block)
    first: list[torch.Tensor] = []
    rest: list[_LayerArgs] = []

    def record(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first.append(args[0])
        rest.append((args[1:], kwargs))
        if len(rest) == len(model.layers):
            raise _StopForward  # the final norm is not needed

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True)
               for layer in model.layers]
    try:
        model(torch.tensor(ids), torch.arange(n), meta, kv)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    return first[0], rest


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in module.named_modules() if type(m) is nn.Linear}


@dataclass(frozen=True)
class Calibrated:
    """calibrate's result: module name ("layers.3.mlp.down_proj", "lm_head") -> packed GPTQ
    weight, and per layer index what the activation-aware fold did (layers it ran on)."""

    packed: dict[str, Packed]
    folded: dict[int, awq.Folded]
    head_alpha: float = 0.0  # the LM head's fold into the final norm (0: none)

    def changed_params(self) -> set[str]:
        """Our dense parameters the fold rewrote (norm weights; a v or up bias)."""
        head = {"norm.weight"} if self.head_alpha > 0 else set()
        return head | {f"layers.{i}.{name}" for i, fold in self.folded.items()
                       for name in fold.changed}


@torch.inference_mode()
def calibrate(model: LlamaForCausalLM, sequences: Sequence[list[int]],
              config: GptqConfig, progress: bool = False) -> Calibrated:
    """model (dense, fp32; with config.awq its norms and producer rows take the folded scales,
    and its decoder linears are overwritten with their quantised values when
    config.sequential) -> the packed GPTQ weight of every decoder nn.Linear and, with
    config.lm_head, the LM head. progress: a bar over the layers on stderr."""
    from tqdm import tqdm

    if model.config.moe is not None:
        raise ValueError("gptq calibrates dense decoder linears only; routed experts (MoE) "
                         "have no per-expert Hessian here: use --method mse")
    if not sequences or not any(sequences):
        raise ValueError("gptq needs at least one calibration token")
    inputs = [_layer_inputs(model, list(ids)) for ids in sequences if ids]
    hidden = [h for h, _ in inputs]  # [T, hidden] per sequence
    args = [a for _, a in inputs]  # [sequence][layer] -> that call's other arguments

    def run(i: int, layer: nn.Module) -> list[torch.Tensor]:
        return [layer(h, *a[i][0], **a[i][1]) for h, a in zip(hidden, args, strict=True)]

    packed: dict[str, Packed] = {}
    folded: dict[int, awq.Folded] = {}
    layers = tqdm(model.layers, desc="pdmesh: gptq", unit="layer", disable=not progress)
    for i, layer in enumerate(layers):
        linears = _linears(layer)
        hessians = _Hessians(dict(linears))
        try:
            out = run(i, layer)  # unchanged by the fold below: it keeps the layer's function
        finally:
            hessians.close()
        if config.awq and awq.foldable(layer):
            stats = {name: hessians.stats(name) for name in awq.GROUPS}
            folded[i] = awq.fold_layer(layer, model.config, stats, config.awq_grid)
            for name, s in folded[i].scales.items():
                if folded[i].alpha[name] > 0:
                    hessians.rescale(name, s)
        for name, linear in linears.items():
            packed[f"layers.{i}.{name}"] = quantize_gptq(linear.weight, hessians.mean(name),
                                                        config.damp)
            if config.sequential:
                blocks, scales = packed[f"layers.{i}.{name}"]
                linear.weight.copy_(reference.dequantize(blocks, scales, linear.weight.dtype))
        if config.sequential:  # layer i+1's inputs, as the quantised model computes them
            out = run(i, layer)
        hidden = out
    if config.lm_head:
        if model.norm is None or model.lm_head is None:
            raise ValueError("the LM head needs the last pipeline stage")
        head = _Hessians({})
        for h in hidden:
            head.add("lm_head", model.norm(h).to(torch.float64))
        head_alpha = _fold_head(model, head, config) if config.awq else 0.0
        packed["lm_head"] = quantize_gptq(model.lm_head.weight, head.mean("lm_head"), config.damp)
        return Calibrated(packed, folded, head_alpha)
    return Calibrated(packed, folded)


def _fold_head(model: LlamaForCausalLM, head: _Hessians, config: GptqConfig) -> float:
    """Fold the LM head's activation-aware scales into the final norm (a plain RMSNorm only);
    the alpha chosen. A tied head is untied first: the embedding stays as stored, and the
    checkpoint keeps it beside the packed head (shared.model.quant_checkpoint)."""
    assert model.lm_head is not None and model.norm is not None
    if type(model.norm) is not RMSNorm:
        return 0.0
    if model.embed_tokens is not None and model.lm_head.weight is model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(),
                                            requires_grad=False)
    alpha, _, s = awq.search_scales(model.lm_head.weight.float(), head.stats("lm_head"),
                                    config.awq_grid)
    if alpha > 0:
        model.lm_head.weight.mul_(s)
        model.norm.weight.div_(s)
        head.rescale("lm_head", s)
    return alpha


class GptqEncoder:
    """GPTQ-packed MXFP4 weights of one checkpoint, served by HF tensor name.

    Built from a dense checkpoint directory and calibration token sequences (each a separate
    sequence from position 0); holds the fp32 model while calibrating, and the packed bytes
    (~0.53 bytes per weight) plus the dense tensors the fold changed after.
    """

    def __init__(self, model_dir: Path, sequences: Sequence[list[int]],
                 config: GptqConfig, progress: bool = False) -> None:
        model, _ = load_model(model_dir, "float32")
        self.config = config
        self._rows = model.linear_rows()  # HF name -> (module, lo, hi)
        calibrated = calibrate(model, sequences, config, progress)
        self._packed = calibrated.packed
        self.folded = calibrated.folded
        # HF name -> fp32 value, for the dense tensors the fold rewrote
        self._dense = model.hf_tensors(calibrated.changed_params())

    @property
    def dense(self) -> dict[str, torch.Tensor]:
        """HF name -> the value to store instead of the checkpoint's, for every dense tensor
        the activation-aware fold changed (empty without it)."""
        return dict(self._dense)

    @property
    def modules(self) -> dict[str, Packed]:
        """Our module name ("layers.0.self_attn.qkv_proj", "lm_head") -> its packed weight."""
        return dict(self._packed)

    def pack(self, hf_name: str, tensor: torch.Tensor) -> Packed:
        """The packed rows of HF weight hf_name [out, in] (tensor is the stored one; only its
        shape is checked: the bytes were computed from the same checkpoint)."""
        where = (("lm_head", 0, tensor.shape[0]) if hf_name == "lm_head.weight"
                 else self._rows.get(hf_name))
        if where is None or where[0] not in self._packed:
            raise ValueError(f"gptq has no calibrated weight for {hf_name!r}")
        module, lo, hi = where
        blocks, scales = self._packed[module]
        if (hi - lo, scales.shape[1] * 32) != tuple(tensor.shape):
            raise ValueError(f"{hf_name!r} is {tuple(tensor.shape)}, calibrated rows "
                             f"{lo}..{hi} of {module} {tuple(blocks.shape)}")
        return blocks[lo:hi].clone(), scales[lo:hi].clone()
