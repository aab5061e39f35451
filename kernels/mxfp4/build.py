"""What the MXFP4 C++ library is built from, in two variants; kernels/_native.py builds and
loads them.

The full variant holds the scalar, AVX2 and AVX-512 code with run-time dispatch; the scalar-only
one has no AVX2 / AVX-512 translation unit or flag at all (the only one off x86-64, where there
is no <immintrin.h>). Each variant is its own library and torch.ops namespace, so both can be
loaded in one process. If neither can be built, the plain-torch reference runs.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kernels import _native
from kernels._native import BuildResult, BuildState, Recipe

__all__ = ["FULL_NAMESPACE", "BuildConfig", "BuildResult", "BuildState", "Variant", "load",
           "peek", "recipe", "source_digest"]

CSRC = Path(__file__).parent / "csrc"
_X86_64 = ("x86_64", "amd64")
# The full variant's namespace: kernels/dense's fused decoder layer calls its linear op.
FULL_NAMESPACE = "pdmesh_mxfp4"


class Variant(StrEnum):
    """Which code the library contains: scalar + AVX2 + AVX-512 with run-time dispatch, or scalar
    only."""

    FULL = "full"
    SCALAR_ONLY = "scalar_only"  # no AVX2 / AVX-512 code at all (no such TU, no such flags)


@dataclass(frozen=True)
class BuildConfig(_native.BuildConfig):
    """The shared build settings plus which variant to build."""

    variant: Variant = Variant.FULL

    @classmethod
    def from_env(cls) -> BuildConfig:
        """kernels._native.BuildConfig.from_env, with the full variant on x86-64 and the
        scalar-only one elsewhere."""
        base = _native.BuildConfig.from_env()
        variant = Variant.FULL if platform.machine().lower() in _X86_64 else Variant.SCALAR_ONLY
        return cls(base.build_root, base.verbose, base.prebuilt_dir, variant)

    @property
    def namespace(self) -> str:
        """Extension name and torch.ops namespace; distinct per variant (both can be loaded)."""
        return FULL_NAMESPACE if self.variant is Variant.FULL else "pdmesh_mxfp4_scalar"


def recipe(config: BuildConfig) -> Recipe:
    """The sources and flags of config.variant."""
    sources: tuple[str, ...] = ("ops.cpp", "scalar.cpp")
    cflags: tuple[str, ...] = (f"-DPDMESH_MXFP4_NS={config.namespace}",)
    if config.variant is Variant.FULL:
        sources += ("avx2.cpp", "avx2_linear.cpp", "avx2_a8.cpp", "avx512.cpp", "avx512_linear.cpp")
    else:
        cflags += ("-DPDMESH_MXFP4_SCALAR_ONLY",)
    return Recipe(config.namespace, CSRC, sources, Path(__file__), cflags,
                  variant=str(config.variant), fallback="the plain-torch reference (slow)")


def load(config: BuildConfig) -> BuildResult:
    """Build (if needed) and load config.variant, once per process; never raises for build errors.
    A torch.ops namespace registers once per process, so a variant's first config wins."""
    return _native.load(recipe(config), config)


def peek(variant: Variant) -> BuildResult | None:
    """The result of an earlier load() of this variant in this process, without building."""
    return _native.peek(BuildConfig(Path(), variant=variant).namespace)


def source_digest(config: BuildConfig) -> str:
    """What a prebuilt library of config.variant must have been built from (kernels/prebuilt.py)."""
    return recipe(config).source_digest()
