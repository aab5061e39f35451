"""The KV compatibility hash: which workers may exchange KV blocks at all.

`compat_hash` is SHA-256 over the sorted-key msgpack encoding of `CompatFactors`: protocol
version, model id and weights fingerprint, the run-time weight transforms (quantisation...),
dtype and KV dtype, layers, KV heads, head dim, the RoPE configuration, each layer's attention
window (sliding windows change every KV past the first window), the KV layout and the transfer
mode. Block size, KV capacity and pipeline size are deliberately left out; they are
negotiated after the hash matches.

The weights fingerprint covers the checkpoint's files; `WeightTransforms` covers what a worker
does to those weights when it loads them. Both change the KV bytes a prompt produces, so a
`--quantization mxfp4` prefill and a bf16 decode of one checkpoint never pair.

The transfer mode is never passed by a call site: `CompatFactors.for_transfer` reads it from the
transfer class's `mode` attribute, so the hash and the running code cannot disagree.

This module is protocol only (standard library and msgpack): the spec of a loaded model is built
from its ModelConfig and EngineConfig by `shared.engine.kv_spec`, next to the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Protocol

import msgpack

from shared.protocol.codec import KV_PROTOCOL_VERSION
from shared.protocol.layout import KV_LAYOUT

RopeValue = str | int | float | bool | None


class HasTransferMode(Protocol):
    mode: ClassVar[str]


@dataclass(frozen=True)
class WeightTransforms:
    """Every run-time transform of the checkpoint's weights, i.e. what makes two workers of one
    checkpoint (one weights fingerprint) compute different KV bytes for the same prompt.

    This is the one place such transforms are listed: a new one (another quantisation scheme,
    an adapter merged at load, pruning...) becomes a field here whose default is "untouched",
    set in `shared.engine.kv_spec.weight_transforms`. It then travels inside the
    `weight_transforms` factor, so a handshake refusal names it and the router groups on it.
    Values are plain strings naming a format, so the factor reads well in an error message.
    """

    quantization: str = "none"  # format of the decoder's linear layers: "none" | "mxfp4"
    lm_head: str = "dense"  # format of the LM head (it samples the prefill's first token)
    # How the quantised blocks' exponents were chosen ("ocp" | "mse"): same format, other bytes.
    encoder: str = "none"
    # How decode rows enter the quantised linears ("float" | "int8"): a short prompt's prefill
    # runs them too, so int8 activations change the KV bytes.
    activations: str = "float"

    def items(self) -> tuple[tuple[str, str], ...]:
        """Canonical (name, value) pairs, sorted: the factor's hashable form."""
        return tuple(sorted((f.name, getattr(self, f.name)) for f in fields(self)))


@dataclass(frozen=True)
class ModelKVSpec:
    """What the engine knows about its KV cache's meaning (everything but the transfer mode).

    `rope` is the checkpoint's RoPE configuration (theta, scaling type and factors...), kept as
    sorted (key, value) pairs so the dataclass stays hashable and canonical. `transforms` is
    what the worker does to the weights at load time (untouched by default).
    `attention_windows` names each layer's attention: "full" when no layer slides, else one
    comma-separated entry per layer, its sliding window or "full" (`windows_factor`). Built
    from a loaded model by `shared.engine.kv_spec.kv_spec_of`.
    """

    model_id: str
    weights_fingerprint: str
    dtype: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: tuple[tuple[str, RopeValue], ...] = ()
    kv_layout: str = KV_LAYOUT
    transforms: WeightTransforms = WeightTransforms()
    attention_windows: str = "full"

    @staticmethod
    def windows_factor(windows: Iterable[int | None]) -> str:
        """The attention_windows value of per-layer windows (None: full attention)."""
        named = [("full" if w is None else str(int(w))) for w in windows]
        return "full" if all(n == "full" for n in named) else ",".join(named)

    @staticmethod
    def rope_items(rope: Mapping[str, Any]) -> tuple[tuple[str, RopeValue], ...]:
        """Canonical, hashable form of a RoPE config dict (enums become their value, other
        non-scalars their repr)."""
        def scalar(v: Any) -> RopeValue:
            v = v.value if isinstance(v, Enum) else v
            return v if isinstance(v, str | int | float | bool) or v is None else repr(v)
        return tuple(sorted((str(k), scalar(v)) for k, v in rope.items()))


@dataclass(frozen=True)
class CompatFactors:
    """Every factor of the compat hash; travels next to the hash so a rejection can name
    each differing factor with both values."""

    protocol_version: int
    model_id: str
    weights_fingerprint: str
    weight_transforms: tuple[tuple[str, str], ...]  # WeightTransforms.items()
    dtype: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: tuple[tuple[str, RopeValue], ...]
    attention_windows: str
    kv_layout: str
    transfer_mode: str

    @classmethod
    def for_transfer(cls, spec: ModelKVSpec, transfer_cls: type[HasTransferMode]) -> CompatFactors:
        return cls(
            protocol_version=KV_PROTOCOL_VERSION, model_id=spec.model_id,
            weights_fingerprint=spec.weights_fingerprint,
            weight_transforms=spec.transforms.items(), dtype=spec.dtype,
            kv_dtype=spec.kv_dtype, num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, rope=spec.rope,
            attention_windows=spec.attention_windows, kv_layout=spec.kv_layout,
            transfer_mode=transfer_cls.mode,
        )

    def to_wire(self) -> dict[str, Any]:
        """Plain, canonical data: RoPE and the weight transforms as sorted maps (msgpack/JSON
        friendly)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rope"] = {k: v for k, v in self.rope}
        out["weight_transforms"] = {k: v for k, v in self.weight_transforms}
        return dict(sorted(out.items()))

    @property
    def hash(self) -> str:
        return compat_hash(self)


def compat_hash(factors: CompatFactors) -> str:
    """SHA-256 hex over the sorted-key msgpack encoding of the factors (stable across runs)."""
    canonical = msgpack.packb(factors.to_wire(), use_bin_type=True)
    return hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True)
class FactorDiff:
    name: str
    local: str
    remote: str

    def __str__(self) -> str:
        return f"{self.name}: local {self.local} vs remote {self.remote}"


_ABSENT = "<absent>"


def diff_factors(local: CompatFactors, remote: object) -> list[FactorDiff]:
    """Name every factor that differs, from the peer's *undecoded* factors (any shape).

    Tolerates garbage and other protocol versions: unknown factors on either side are listed
    as absent on the other, and a non-map yields a single "factors" entry.
    """
    mine = local.to_wire()
    if not isinstance(remote, dict):
        return [FactorDiff("factors", "<map>", _short(remote))]
    names = sorted(set(mine) | {k for k in remote if isinstance(k, str)})
    diffs = []
    for name in names:
        a, b = mine.get(name, _ABSENT), remote.get(name, _ABSENT)
        if repr(a) == repr(b):  # whole values: a shortened one could hide the difference
            continue
        if isinstance(a, dict) and isinstance(b, dict):  # name only the differing keys
            keys = sorted(k for k in a.keys() | b.keys() if repr(a.get(k)) != repr(b.get(k)))
            a, b = ({k: d.get(k, _ABSENT) for k in keys} for d in (a, b))
        diffs.append(FactorDiff(name, _short(a) if a is not _ABSENT else _ABSENT,
                                _short(b) if b is not _ABSENT else _ABSENT))
    return diffs


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fingerprint_files(paths: Iterable[Path], chunk: int = 1 << 20) -> str:
    """Weights fingerprint: sha256 over each file's name, size and full contents, in name order.

    Hashing the contents (not just the headers) is what catches two fine-tunes of one shape.
    """
    h = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()
