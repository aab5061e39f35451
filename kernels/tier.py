"""The one dispatch ladder of every native kernel (kernels.dense and kernels.mxfp4).

A tier names an instruction-set level, fastest first:

    avx512_bf16   AVX-512 F/BW/VL/DQ plus vdpbf16ps (AMD Zen 4/5, Intel Sapphire Rapids+)
    avx512        AVX-512 F/BW/VL/DQ without bf16 dot products (Intel Skylake-SP .. Ice Lake)
    avx2          AVX2 + FMA + F16C (most cloud x86 before 2022, every AMD Zen 2/3)
    portable      compiled C++ with baseline x86-64 flags (kernels.mxfp4's scalar path only)
    reference     plain torch: the oracle every faster tier is tested against

Each library's backends declare their tier; a backend=None lookup picks the fastest backend the
CPU can run whose tier is at most the process-wide cap. The cap is set once, from configuration
(`PDMESH_KERNEL_TIER`, read by shared/config.py, or the `--kernel-tier` flag), through
`set_max_tier`; kernels/ itself never reads the environment for it. Lowering the cap is how a
machine of one CPU kind runs (and tests) the code paths of the kinds it is not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from enum import IntEnum


class Tier(IntEnum):
    """An instruction-set rung; a larger value is a faster, more demanding tier."""

    REFERENCE = 0
    PORTABLE = 1
    AVX2 = 2
    AVX512 = 3
    AVX512_BF16 = 4

    @property
    def label(self) -> str:
        """The name used in flags, the environment, /v1/metadata and `pdmesh doctor`."""
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> Tier:
        """'avx2' -> Tier.AVX2; raises ValueError naming the choices for anything else."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            choices = ", ".join(t.label for t in sorted(cls, reverse=True))
            raise ValueError(f"unknown kernel tier {name!r}; expected auto or one of {choices}"
                             ) from None


TIER_CHOICES = ("auto", *(t.label for t in sorted(Tier, reverse=True)))

_lock = threading.Lock()
_max_tier = Tier.AVX512_BF16
# Callables run after the cap changes (each library drops its resolved lookups).
_listeners: list[Callable[[], None]] = []


def max_tier() -> Tier:
    """The cap on automatic backend choice (Tier.AVX512_BF16, i.e. none, unless set)."""
    return _max_tier


def set_max_tier(tier: Tier | str | None) -> Tier:
    """Cap automatic backend choice at `tier` (None or 'auto': no cap); returns the cap.

    Explicit backend= arguments are not capped: tests name the tier they exercise.
    """
    global _max_tier
    if tier is None or tier == "auto":
        new = Tier.AVX512_BF16
    else:
        new = tier if isinstance(tier, Tier) else Tier.parse(tier)
    with _lock:
        _max_tier = new
        listeners = list(_listeners)
    for fn in listeners:
        fn()
    return new


def on_cap_change(fn: Callable[[], None]) -> None:
    """Register fn() to run after every set_max_tier (libraries clear their resolved paths)."""
    with _lock:
        _listeners.append(fn)
