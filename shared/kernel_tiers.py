"""KernelTiers: which rung of the kernel ladder (kernels/tier.py) this process runs, and why.

Three facts make the answer: the CPU's own tier (what its instruction set allows), the cap
(`EngineConfig.kernel_tier`, applied by the engine through kernels.tier.set_max_tier) and each
library's active backend, the fastest it can run here whose tier is within the cap. `pdmesh
doctor`, the worker's `GET /v1/metadata` and benchmarks/engine.py all report this one object.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.tier import Tier, max_tier

# Linux /proc/cpuinfo flags each tier needs, fastest first. The kernel lists avx512* only when
# the OS saves the zmm state, so a listed flag is one the process may execute.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
TIER_FLAGS: tuple[tuple[Tier, frozenset[str]], ...] = (
    (Tier.AVX512_BF16, _AVX512 | {"avx512_bf16"}),
    (Tier.AVX512, _AVX512),
    (Tier.AVX2, frozenset({"avx2", "fma", "f16c"})),
)
# torch's own CPU dispatch level, for hosts without /proc/cpuinfo (it cannot see avx512_bf16).
_TORCH_CAPABILITY = {"AVX512": Tier.AVX512, "AVX2": Tier.AVX2}
# Backend names whose label is not a tier name (dense's AVX-512 FMA path, mxfp4's scalar C++).
_BACKEND_ALIASES = {"avx512_fma": Tier.AVX512, "scalar": Tier.PORTABLE}


def tier_of_flags(flags: Iterable[str]) -> Tier:
    """The fastest tier whose CPU flags are all present; PORTABLE (plain compiled C++) else."""
    have = frozenset(flags)
    return next((tier for tier, need in TIER_FLAGS if need <= have), Tier.PORTABLE)


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The first processor's flags from /proc/cpuinfo, or None where there is no such file."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


@functools.cache
def cpu_tier() -> Tier:
    """The fastest tier this CPU can execute (detected once per process)."""
    flags = read_cpu_flags()
    if flags is not None:
        return tier_of_flags(flags)
    import torch

    return _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), Tier.PORTABLE)


def backend_tier(backend: object) -> Tier:
    """A library backend (enum member or name) -> its rung: 'avx2' -> AVX2, 'scalar' ->
    PORTABLE. A backend enum that declares `.tier` is taken at its word."""
    declared = getattr(backend, "tier", None)
    if isinstance(declared, Tier):
        return declared
    name = str(backend)
    return _BACKEND_ALIASES.get(name) or Tier.parse(name)


def active_backend(available: Iterable[str], cap: Tier) -> str:
    """The backend a backend=None lookup picks: the first (fastest) of `available` within cap."""
    names = list(available)
    return next((b for b in names if backend_tier(b) <= cap), "reference")


@dataclass(frozen=True)
class KernelTiers:
    """The CPU's tier, the cap and each library's active backend; None where the library is
    not loaded in this process (an fp32 worker never loads kernels.dense) or not asked for
    (`pdmesh doctor --skip-components`, which builds nothing)."""

    cpu: Tier
    cap: Tier
    dense: str | None = None
    mxfp4: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The `kernels` object of /v1/metadata and the benchmark JSON: tier labels per library
        and, under `backends`, the backend names they map from."""
        libs = {"dense": self.dense, "mxfp4": self.mxfp4}
        return {
            "cpu_tier": self.cpu.label,
            "max_tier": self.cap.label,
            **{k: None if v is None else backend_tier(v).label for k, v in libs.items()},
            "backends": libs,
        }

    def __str__(self) -> str:
        """'cpu=avx2 cap=avx512_bf16; active: dense=avx2, mxfp4=scalar (portable)'."""
        libs = []
        for name, backend in (("dense", self.dense), ("mxfp4", self.mxfp4)):
            if backend is not None:
                tier = backend_tier(backend).label
                libs.append(f"{name}={backend}" + ("" if tier == backend else f" ({tier})"))
        text = f"cpu={self.cpu.label} cap={self.cap.label}"
        return text + (f"; active: {', '.join(libs)}" if libs else "")


def kernel_tiers(*, libraries: bool = True, build: bool = False) -> KernelTiers:
    """Report the tiers now. libraries=False skips the libraries; build=False builds nothing
    and reports a library this process has not loaded as None."""
    cap = max_tier()
    if not libraries:
        return KernelTiers(cpu_tier(), cap)
    from kernels import dense, mxfp4

    active = {}
    for name, lib in (("dense", dense), ("mxfp4", mxfp4)):
        info = lib.build_info(build=build)
        # A failed build runs the reference; a library never loaded runs nothing at all.
        active[name] = None if info.state == "not_built" else active_backend(info.available, cap)
    return KernelTiers(cpu_tier(), cap, **active)
