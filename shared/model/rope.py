"""Rotary position embeddings: the RoPE configuration, its HF parsing, and the cos/sin tables.

Supported scalings (HF transformers semantics): `default`, `linear` (frequencies / factor),
`dynamic` (NTK-aware, base grows with the sequence length past `max_position_embeddings`) and
`llama3` (low frequencies / factor, a smooth ramp in between) and `longrope` (Phi-3: per-frequency
`short_factor`/`long_factor` divisors, cos/sin scaled by the attention factor) and `yarn` (gpt-oss,
Qwen long context: interpolated frequencies below a ramp, original ones above, cos/sin scaled by
the attention factor). Anything else (mrope...) is refused rather than approximated.
`partial_rotary_factor` (Phi-4-mini: 0.75) makes every table `rotary_dim` wide and
`RotaryEmbedding.apply` rotate only the first `rotary_dim` channels of each head, passing the
rest through (HF Phi3's apply_rotary_pos_emb).

LongRoPE, like dynamic NTK below, is made per position: position p uses the long factors when
`p + 1 > original_max_position_embeddings`, i.e. HF's decode path token for token.

Dynamic NTK, exactly: HF recomputes the base from `seq_len = max(position) + 1` of each forward
call. During incremental decoding that is `p + 1` for the token at position p, so we give every
position p the frequencies for `seq_len = max(p + 1, max_position_embeddings)`. A token's key
then depends only on its own position, never on how the prompt was chunked, which prefix
caching, chunked prefill and P/D transfer require. This equals HF's decode path token for token;
a single HF forward over a prompt longer than `max_position_embeddings` instead uses the whole
prompt's length for every token, which we deliberately do not reproduce.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch


class RopeType(Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"
    LONGROPE = "longrope"
    YARN = "yarn"


_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "short_factor", "long_factor", "attention_factor", "partial_rotary_factor",
                 "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class RopeConfig:
    """One model's RoPE: base `theta`, scaling `type` and its parameters.

    `factor` is 1.0 for DEFAULT. `low_freq_factor`, `high_freq_factor` and
    `original_max_position_embeddings` are set only for LLAMA3; everything else is None.
    """

    theta: float = 10000.0
    type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] | None = None  # LONGROPE only: [rotary_dim/2] divisors
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0  # multiplies cos and sin (HF's attention_scaling)
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated
    beta_fast: float | None = None  # YARN only: the ramp between interpolated and original
    beta_slow: float | None = None  # frequencies, in rotations over the original context
    truncate: bool = True  # YARN: round the ramp's ends to whole dimensions (gpt-oss: false)

    def rotary_dim(self, head_dim: int) -> int:
        """Channels rotated per head (HF: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise when the factor lists do not fit this head size (needs head_dim, so not in
        __post_init__)."""
        dim = self.rotary_dim(head_dim)
        if dim % 2 or dim <= 0:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives rotary dim {dim}, "
                             "which must be even and positive")
        for name in ("short_factor", "long_factor"):
            got = getattr(self, name)
            if got is not None and len(got) != dim // 2:
                raise ValueError(f"rope {name} has {len(got)} entries, expected rotary_dim/2 = {dim // 2}")

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.type in (RopeType.LINEAR, RopeType.DYNAMIC, RopeType.LLAMA3) and self.factor < 1.0:
            raise ValueError(f"rope factor must be >= 1 for {self.type.value}, got {self.factor}")
        if self.type is RopeType.LLAMA3:
            if self.low_freq_factor is None or self.high_freq_factor is None:
                raise ValueError("llama3 rope scaling needs low_freq_factor and high_freq_factor")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
            if not self.original_max_position_embeddings:
                raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.type is RopeType.YARN and (self.beta_fast is None or self.beta_slow is None
                                           or not self.original_max_position_embeddings):
            raise ValueError("yarn rope scaling needs beta_fast, beta_slow and "
                             "original_max_position_embeddings")
        if self.type is RopeType.LONGROPE:
            if self.short_factor is None or self.long_factor is None:
                raise ValueError("longrope rope scaling needs short_factor and long_factor")
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError("longrope short_factor and long_factor differ in length")
            if not self.original_max_position_embeddings:
                raise ValueError("longrope rope scaling needs original_max_position_embeddings")

    def as_dict(self) -> dict[str, Any]:
        """Canonical, JSON-friendly form (for the compatibility hash and logs)."""
        d = dataclasses.asdict(self)
        d["type"] = self.type.value
        return d

    @staticmethod
    def from_hf(cfg: Mapping[str, Any], max_position_embeddings: int) -> RopeConfig:
        """Parse both key generations of an HF (text) config.

        Legacy: top-level `rope_theta` plus `rope_scaling` (with `type` or `rope_type`).
        transformers 5: `rope_parameters` holding `rope_theta`, `rope_type` and the scaling keys.
        When both are present, a field they both set must agree, or this raises.
        """
        legacy = _fields_from(cfg.get("rope_scaling"), cfg.get("rope_theta"), "rope_scaling")
        modern = _fields_from(cfg.get("rope_parameters"), None, "rope_parameters")
        clash = sorted(k for k in legacy.keys() & modern.keys() if legacy[k] != modern[k])
        if clash:
            detail = ", ".join(f"{k}: {legacy[k]!r} vs {modern[k]!r}" for k in clash)
            raise ValueError(f"rope_scaling/rope_theta and rope_parameters disagree on {detail}")
        fields = {**legacy, **modern}
        rope_type = _parse_type(fields.pop("type", None))
        theta = float(fields.get("theta", 10000.0))
        prf = _agree(fields, cfg, "partial_rotary_factor")
        partial = 1.0 if prf is None else float(prf)
        if rope_type is RopeType.DEFAULT:
            return RopeConfig(theta=theta, partial_rotary_factor=partial)
        orig = _agree(fields, cfg, "original_max_position_embeddings")
        if rope_type is RopeType.LONGROPE:
            return _longrope(fields, theta, partial, int(orig or max_position_embeddings),
                             max_position_embeddings)
        if rope_type is RopeType.YARN:
            return _yarn(fields, theta, partial, int(orig or max_position_embeddings),
                         max_position_embeddings)
        if "factor" not in fields:
            raise ValueError(f"rope scaling {rope_type.value!r} needs a 'factor'")
        if rope_type is not RopeType.LLAMA3:
            return RopeConfig(theta=theta, type=rope_type, factor=float(fields["factor"]),
                              partial_rotary_factor=partial)
        return RopeConfig(
            theta=theta,
            type=rope_type,
            factor=float(fields["factor"]),
            low_freq_factor=_opt_float(fields.get("low_freq_factor")),
            high_freq_factor=_opt_float(fields.get("high_freq_factor")),
            original_max_position_embeddings=int(orig or max_position_embeddings),
            partial_rotary_factor=partial,
        )


def _agree(fields: Mapping[str, Any], cfg: Mapping[str, Any], key: str) -> Any:
    """A key that HF also reads at the config's top level (Phi-3 style): both places must agree."""
    inner, top = fields.get(key), cfg.get(key)
    if inner is not None and top is not None and float(inner) != float(top):
        raise ValueError(f"{key} disagrees: {top} (top level) vs {inner} (rope block)")
    return inner if inner is not None else top


def _longrope(fields: Mapping[str, Any], theta: float, partial: float, orig: int,
              max_pos: int) -> RopeConfig:
    """HF's _compute_longrope_parameters: factor defaults to max/original positions, and the
    attention factor to sqrt(1 + ln(factor) / ln(original)) (1.0 when factor <= 1)."""
    factor = float(fields["factor"]) if fields.get("factor") is not None else max_pos / orig
    attn = fields.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    lists: dict[str, tuple[float, ...]] = {}
    for key in ("short_factor", "long_factor"):
        v = fields.get(key)
        if not isinstance(v, list | tuple) or not v:
            raise ValueError(f"longrope rope scaling needs a non-empty list {key!r}, got {v!r}")
        lists[key] = tuple(float(x) for x in v)
    # factor itself only feeds the attention factor; kept for the compat hash.
    return RopeConfig(theta=theta, type=RopeType.LONGROPE, factor=factor,
                      original_max_position_embeddings=orig, attention_factor=float(attn),
                      partial_rotary_factor=partial, short_factor=lists["short_factor"],
                      long_factor=lists["long_factor"])


def _yarn(fields: Mapping[str, Any], theta: float, partial: float, orig: int,
          max_pos: int) -> RopeConfig:
    """HF's _compute_yarn_parameters: factor defaults to max/original positions, the attention
    factor to 0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio), beta_fast/beta_slow to
    32/1 and truncate to true."""
    factor = float(fields["factor"]) if fields.get("factor") is not None else max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = fields.get("attention_factor")
    if attn is None:
        m, m_all = fields.get("mscale"), fields.get("mscale_all_dim")
        attn = (mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all
                else mscale(factor))
    return RopeConfig(theta=theta, type=RopeType.YARN, factor=factor,
                      original_max_position_embeddings=orig, attention_factor=float(attn),
                      partial_rotary_factor=partial,
                      beta_fast=float(fields.get("beta_fast") or 32.0),
                      beta_slow=float(fields.get("beta_slow") or 1.0),
                      truncate=bool(fields.get("truncate", True)))


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim/2] YaRN frequencies: interpolated (divided by factor) below the ramp, original
    above it, blended linearly in between (HF's float32 arithmetic, same order)."""
    assert rope.beta_fast is not None and rope.beta_slow is not None
    orig = rope.original_max_position_embeddings
    assert orig is not None

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _fields_from(block: Any, theta: Any, where: str) -> dict[str, Any]:
    """The fields one key generation sets explicitly (absent keys stay absent)."""
    out: dict[str, Any] = {}
    if theta is not None:
        out["theta"] = float(theta)
    if block is None:
        return out
    if not isinstance(block, Mapping):
        raise ValueError(f"{where} must be an object, got {type(block).__name__}")
    if any(isinstance(v, Mapping) for v in block.values()):
        raise ValueError(f"{where} is nested per layer type; per-layer RoPE is not supported")
    if block.get("rope_theta") is not None:
        out["theta"] = float(block["rope_theta"])
    kind = block.get("rope_type", block.get("type"))
    if kind is not None:
        out["type"] = str(kind)
    for key in _SCALING_KEYS:
        if block.get(key) is not None:
            out[key] = block[key]
    return out


def _parse_type(kind: str | None) -> RopeType:
    try:
        return RopeType(kind or "default")
    except ValueError:
        supported = ", ".join(t.value for t in RopeType)
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {supported})") from None


def base_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, computed exactly as HF does."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponent)


def scaled_inv_freq(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """[rotary_dim/2] float32 inverse frequencies for positions below max_position_embeddings
    (LONGROPE: below original_max_position_embeddings, or past it when `long`)."""
    dim = rope.rotary_dim(head_dim)
    if rope.type is RopeType.LONGROPE:
        ext = rope.long_factor if long else rope.short_factor
        assert ext is not None
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        # Same operation order as HF: 1 / (ext * base ** exponent).
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * rope.theta ** exponent)
    if rope.type is RopeType.YARN:
        return _yarn_inv_freq(rope, dim)
    inv = base_inv_freq(rope.theta, dim)
    if rope.type is RopeType.LINEAR:
        return inv / rope.factor
    if rope.type is RopeType.LLAMA3:
        return _llama3(inv, rope)
    return inv  # DEFAULT, and DYNAMIC inside the original context


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    assert rope.low_freq_factor is not None and rope.high_freq_factor is not None
    assert rope.original_max_position_embeddings is not None
    old_len, lo, hi = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old_len / lo, inv / rope.factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / rope.factor + smooth * out
    medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, out)


def rope_angles(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                num_positions: int) -> torch.Tensor:
    """[num_positions, rotary_dim/2] float32 angles `position * inv_freq` for positions 0..n-1."""
    pos = torch.arange(num_positions, dtype=torch.int64).to(torch.float32)
    angles = pos[:, None] * scaled_inv_freq(rope, head_dim)[None, :]
    orig = rope.original_max_position_embeddings
    if rope.type is RopeType.LONGROPE and orig is not None and num_positions > orig:
        # Position p is computed with seq_len = p + 1 > orig: the long factors.
        angles[orig:] = pos[orig:, None] * scaled_inv_freq(rope, head_dim, long=True)[None, :]
    head_dim = rope.rotary_dim(head_dim)  # dynamic NTK below grows the base over the rotated dims
    if rope.type is RopeType.DYNAMIC and num_positions > max_position_embeddings:
        # Rows past the original context: base for seq_len = p + 1 (see the module docstring),
        # in float32 like HF's tensor arithmetic.
        seq = torch.arange(max_position_embeddings + 1, num_positions + 1, dtype=torch.int64)
        growth = (rope.factor * seq / max_position_embeddings) - (rope.factor - 1)
        base = rope.theta * growth ** (head_dim / (head_dim - 2))  # [P']
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv = 1.0 / (base[:, None] ** exponent[None, :])  # [P', D/2]
        angles[max_position_embeddings:] = pos[max_position_embeddings:, None] * inv
    return angles


class RotaryEmbedding:
    """Precomputed cos/sin tables for one model, indexed by absolute position.

    The table covers at least `max_position_embeddings` positions (built lazily in doublings
    so a 128k-context config costs nothing until used) and grows past it on demand, which is
    how dynamic NTK extends the context. Tables are stored in the model dtype, as HF casts
    cos/sin to the activation dtype before rotating.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                 dtype: torch.dtype, initial_positions: int = 4096) -> None:
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        rope.check_head_dim(head_dim)
        self.rope = rope
        self.head_dim = head_dim
        self.rotary_dim = rope.rotary_dim(head_dim)
        self.max_position_embeddings = max_position_embeddings
        self.dtype = dtype
        self._cos_sin = torch.empty(0, self.rotary_dim, dtype=dtype)  # [P, R]: cos | sin halves
        self._ensure(min(initial_positions, max_position_embeddings))

    @property
    def num_positions(self) -> int:
        return self._cos_sin.shape[0]

    def _ensure(self, n: int) -> None:
        if n <= self.num_positions:
            return
        size = max(n, 2 * self.num_positions, 1)
        angles = rope_angles(self.rope, self.head_dim, self.max_position_embeddings, size)
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        if self.rope.attention_factor != 1.0:
            cos_sin = cos_sin * self.rope.attention_factor  # HF: cos/sin * attention_scaling, fp32
        self._cos_sin = cos_sin.to(self.dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long -> (cos, sin), each [T, 1, R/2], broadcastable over heads."""
        if positions.numel():
            self._ensure(int(positions.max()) + 1)
        cs = self._cos_sin[positions].unsqueeze(1)  # [T, 1, R]
        cos, sin = cs.chunk(2, dim=-1)
        return cos, sin

    def table(self, num_positions: int) -> torch.Tensor:
        """The whole table [P >= num_positions, R] (cos | sin halves, model dtype), for native
        RoPE kernels that index it by position themselves."""
        self._ensure(num_positions)
        return self._cos_sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, N, D] (HF's rotate-half layout) over its first R = 2 * cos.shape[-1]
        channels, passing the rest through (partial rotary); returns a new contiguous tensor."""
        rot = 2 * cos.shape[-1]
        if rot != x.shape[-1]:
            head, tail = x[..., :rot], x[..., rot:]
            x1, x2 = head.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, tail), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
