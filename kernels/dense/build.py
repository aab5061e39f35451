"""What the dense C++ library is built from; kernels/_native.py builds and loads it.

Compiled at first use (about 20 s on two cores), reloaded from the build directory afterwards,
or loaded from a prebuilt directory (`pdmesh kernels build`, PDMESH_KERNELS_DIR). Its ops
register under torch.ops.pdmesh_dense. If it cannot be built, torch's F.linear runs everything.
"""

from __future__ import annotations

from pathlib import Path

from kernels._native import BuildConfig, BuildResult, BuildState, Recipe
from kernels._native import load as _load
from kernels._native import peek as _peek

__all__ = ["NAMESPACE", "RECIPE", "BuildConfig", "BuildResult", "BuildState", "load", "peek",
           "source_digest"]

CSRC = Path(__file__).parent / "csrc"
NAMESPACE = "pdmesh_dense"  # extension name and torch.ops namespace
# ops.cpp: features() and linear(); layer_ops.cpp: the fused decoder layer (kernels/dense/layer.py);
# decode_team.cpp: a decode step's every layer in one parallel region; greedy_head.cpp (with the
# screen_*.cpp kernels): the greedy token of an LM head from its int8 screen.
# Every TU is compiled on every x86-64 CPU: the kernel TUs hold their tier's code in
# `#pragma GCC target` regions, and the ops check the CPU before calling in.
SOURCES = ("ops.cpp", "layer_ops.cpp", "decode_team.cpp", "greedy_head.cpp",
           "gemv_avx512.cpp", "layer_avx512.cpp", "attend_avx512.cpp", "screen_avx512.cpp",
           "flash_avx512bf16.cpp",
           "gemv_avx2.cpp", "layer_avx2.cpp", "attend_avx2.cpp", "screen_avx2.cpp",
           "flash_avx2.cpp")
RECIPE = Recipe(NAMESPACE, CSRC, SOURCES, Path(__file__), fallback="torch's F.linear")


def load(config: BuildConfig) -> BuildResult:
    """Build (if needed) and load the library, once per process; never raises for build errors."""
    return _load(RECIPE, config)


def peek() -> BuildResult | None:
    """The result of an earlier load() in this process, without building."""
    return _peek(NAMESPACE)


def source_digest() -> str:
    """What a prebuilt library must have been built from (kernels/prebuilt.py)."""
    return RECIPE.source_digest()
