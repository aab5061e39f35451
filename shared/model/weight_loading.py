"""Loading Hugging Face-named checkpoint tensors into a decoder stage: name mapping, q/k/v and
gate/up fusion, tied and packed (MXFP4) heads, and the names a pipeline stage skips.

`HFWeightLoading` is the base of every decoder family (shared.model.llama and its variants). A
family says which per-layer HF names it takes with `layer_params()`; the mapping from there to
our parameters, including the slices of the fused projections, is the same for all of them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.quant import PACKED_SUFFIXES, MXFP4Linear, QuantConfig, packed_names

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Multimodal checkpoints prefix the language model; these rewrite to the plain layout.
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))
# A packed MXFP4 tensor name, mapped back to its dense weight name for the skip checks.
_PACKED_NAME = re.compile(r"\.(" + "|".join(PACKED_SUFFIXES) + r")$")
_IGNORED = re.compile(r"(.*rotary_emb\.inv_freq$)|(^(model\.)?(vision_tower|visual|vision_model|"
                      r"multi_modal_projector|mm_projector)\.)")


class HFWeightLoading(nn.Module):
    """A decoder stage (layers start..end-1 of config) that fills its parameters from HF-named
    tensors: `wants_weight` tells the loader which tensors to read, `load_weights` copies them
    in. A subclass sets the attributes below in its __init__ and implements `layer_params`."""

    config: ModelConfig
    quantization: QuantConfig | None
    start: int
    end: int
    is_first: bool
    is_last: bool

    def layer_params(self) -> dict[str, tuple[str, int | None]]:
        """HF per-layer tensor name -> (our parameter, fused slice or None)."""
        raise NotImplementedError

    def wants_weight(self, name: str) -> bool:
        """Whether HF tensor `name` is used by this stage (lets the loader skip reading it)."""
        return _canonical(name) in self._weight_map

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (any dtype; converted), fusing q/k/v and gate/up.

        Raises ValueError on an unknown name, a shape mismatch, or a weight left unloaded.
        Names for other pipeline stages, rotary caches and vision towers are skipped.
        """
        wanted = self._weight_map
        missing = set(wanted)
        for raw_name, tensor in weights:
            name = _canonical(raw_name)
            if name not in wanted:
                if self._skippable(name):
                    continue
                raise ValueError(f"unexpected weight {raw_name!r} for {self.config.architecture}"
                                 f" (layers {self.start}..{self.end - 1})")
            for param_name, part in wanted[name]:
                self._copy_into(param_name, part, tensor, raw_name)
            missing.discard(name)
        if missing:
            names = sorted(missing)
            raise ValueError(f"checkpoint is missing weights: {', '.join(names[:8])}"
                             + (f" (+{len(names) - 8} more)" if len(names) > 8 else ""))

    @functools.cached_property
    def _weight_map(self) -> dict[str, list[tuple[str, int | None]]]:
        """HF name -> [(our parameter, fused slice or None)] for every tensor this stage needs.

        With tied embeddings, lm_head is the embedding: a single stage shares the Parameter,
        while a last stage without the embedding fills lm_head from `model.embed_tokens.weight`
        (a stored `lm_head.weight` is then ignored, as in HF).

        A quantised linear's `X.weight` target is virtual: MXFP4Linear.load quantises the dense
        tensor, or, from a pre-quantised checkpoint, takes `X.weight_blocks` and
        `X.weight_scales` as stored (a packed tied head is stored as `lm_head.weight_*`).
        """
        quantized = self._quantized_weights
        packed = self.quantization is not None and self.quantization.prequantized
        targets = set(dict(self.named_parameters())) | quantized
        out: dict[str, list[tuple[str, int | None]]] = {}

        def add(hf_name: str, target: str, part: int | None) -> None:
            if packed and target in quantized:
                for hf_packed, packed_target in zip(packed_names(hf_name), packed_names(target),
                                                    strict=True):
                    out.setdefault(hf_packed, []).append((packed_target, part))
            else:
                out.setdefault(hf_name, []).append((target, part))

        params = self._layer_params
        for local, layer in enumerate(range(self.start, self.end)):
            for suffix, (param, part) in params.items():
                if f"layers.{local}.{param}" in targets:
                    add(f"model.layers.{layer}.{suffix}", f"layers.{local}.{param}", part)
        if self.is_first:
            add("model.embed_tokens.weight", "embed_tokens.weight", None)
        if self.is_last:
            add("model.norm.weight", "norm.weight", None)
            head_quantized = "lm_head.weight" in quantized
            if not self.config.tie_word_embeddings or (head_quantized and packed):
                add("lm_head.weight", "lm_head.weight", None)
            elif head_quantized or not self.is_first:
                add("model.embed_tokens.weight", "lm_head.weight", None)
        return out

    def linear_rows(self) -> dict[str, tuple[str, int, int]]:
        """HF weight name -> (our nn.Linear module, its rows lo..hi that weight fills), for
        every dense linear weight this stage loads (q/k/v are row ranges of qkv_proj)."""
        out: dict[str, tuple[str, int, int]] = {}
        for hf_name, targets in self._weight_map.items():
            param, part = targets[0]
            module_name, _, attr = param.rpartition(".")
            module = self.get_submodule(module_name)
            if attr != "weight" or type(module) is not nn.Linear:
                continue
            lo, hi = (0, module.out_features) if part is None else self._slice_bounds(param, part)
            out[hf_name] = (module_name, lo, hi)
        return out

    def hf_tensors(self, params: set[str]) -> dict[str, torch.Tensor]:
        """HF name -> a copy of what that tensor fills now (its slice of a fused parameter),
        for every HF tensor whose target is one of params (our parameter names)."""
        out: dict[str, torch.Tensor] = {}
        for hf_name, targets in self._weight_map.items():
            param, part = targets[0]
            if param not in params:
                continue
            value = self.get_parameter(param).detach()
            if part is not None:
                lo, hi = self._slice_bounds(param, part)
                value = value[lo:hi]
            out[hf_name] = value.clone()
        return out

    @functools.cached_property
    def _layer_params(self) -> dict[str, tuple[str, int | None]]:
        return self.layer_params()

    @functools.cached_property
    def _quantized_weights(self) -> frozenset[str]:
        """`X.weight` for every MXFP4Linear X (weights that are not Parameters)."""
        return frozenset(f"{name}.weight" for name, module in self.named_modules()
                         if isinstance(module, MXFP4Linear))

    def _skippable(self, name: str) -> bool:
        """A known tensor this stage does not need (other stages, tied lm_head, vision...)."""
        name = _PACKED_NAME.sub(".weight", name)
        if _IGNORED.match(name) or name in ("model.embed_tokens.weight", "model.norm.weight",
                                            "lm_head.weight"):
            return True
        m = _LAYER_NAME.fullmatch(name)
        return (m is not None and m.group(2) in self._layer_params
                and not self.start <= int(m.group(1)) < self.end
                and int(m.group(1)) < self.config.num_layers)

    def _slice_bounds(self, param_name: str, part: int) -> tuple[int, int]:
        c = self.config
        sizes: tuple[int, ...]
        if "qkv_proj" in param_name:
            sizes = (c.q_size, c.kv_size, c.kv_size)
        else:  # gate_up_proj [2 I, hidden]: the dense MLP's I, or an expert's
            half = _out_features(self.get_submodule(param_name.rpartition(".")[0])) // 2
            sizes = (half, half)
        lo = sum(sizes[:part])
        return lo, lo + sizes[part]

    @torch.no_grad()
    def _copy_into(self, param_name: str, part: int | None, src: torch.Tensor, name: str) -> None:
        module_name, _, attr = param_name.rpartition(".")
        module = self.get_submodule(module_name)
        if isinstance(module, MXFP4Linear) and attr != "bias":
            lo, hi = (0, module.out_features) if part is None else self._slice_bounds(param_name, part)
            module.load(attr, src, lo, hi, name)
            return
        dest: torch.Tensor = self.get_parameter(param_name)
        if part is not None:
            lo, hi = self._slice_bounds(param_name, part)
            dest = dest.narrow(0, lo, hi - lo)
        if tuple(dest.shape) != tuple(src.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(src)


def _out_features(linear: nn.Module) -> int:
    """Rows of a linear's weight, whether nn.Linear, DenseLinear or MXFP4Linear."""
    out = getattr(linear, "out_features", None)
    assert isinstance(out, int), f"{type(linear).__name__} has no out_features"
    return out


def _canonical(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name
