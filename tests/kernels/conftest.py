"""Session fixtures: both library variants are built (or loaded from the cache) once per run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernels._native import runnable_backends, unavailable_reason
from kernels.mxfp4 import Backend, BuildConfig, BuildState, KernelPath, Variant
from kernels.mxfp4.backend import FASTEST_FIRST
from kernels.mxfp4.build import BuildResult, load

# Every compiled code path, one per tier of the full library, and the scalar-only library's one.
CPP_PATHS = ("avx512_bf16", "avx512", "avx2", "scalar", "scalar_only")


@pytest.fixture(scope="session")
def builds() -> dict[Variant, BuildResult]:
    """Both variants, built into the configured cache (TORCH_EXTENSIONS_DIR / PDMESH_CACHE)."""
    config = BuildConfig.from_env()
    return {v: load(replace(config, variant=v)) for v in Variant}


@pytest.fixture(scope="session", params=CPP_PATHS)
def cpp_path(request: pytest.FixtureRequest, builds: dict[Variant, BuildResult]) -> KernelPath:
    """A compiled KernelPath. A failed build, or a full build missing a tier's code, fails the
    test; only a tier this CPU cannot execute skips."""
    variant = Variant.SCALAR_ONLY if request.param == "scalar_only" else Variant.FULL
    result = builds[variant]
    assert result.state is BuildState.READY, f"{variant} build failed: {result.error}"
    lib = result.library
    assert lib is not None
    assert lib.has_avx2_code and lib.has_avx512_code or variant is Variant.SCALAR_ONLY
    backend = Backend.SCALAR if request.param == "scalar_only" else Backend(request.param)
    if backend not in runnable_backends(FASTEST_FIRST, result):
        reason = unavailable_reason(backend, result)
        assert reason.startswith("this CPU cannot run"), reason
        pytest.skip(reason)
    return KernelPath(backend, lib)
