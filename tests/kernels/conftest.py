"""Session fixtures: both library variants are built (or loaded from the cache) once per run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernels.mxfp4 import Backend, BuildConfig, BuildState, KernelPath, Variant
from kernels.mxfp4.build import BuildResult, load

# Every compiled code path: the full library's two, and the scalar-only library's one.
CPP_PATHS = ("avx512", "scalar", "scalar_only")


@pytest.fixture(scope="session")
def builds() -> dict[Variant, BuildResult]:
    """Both variants, built into the configured cache (TORCH_EXTENSIONS_DIR / PDMESH_CACHE)."""
    config = BuildConfig.from_env()
    return {v: load(replace(config, variant=v)) for v in Variant}


@pytest.fixture(scope="session", params=CPP_PATHS)
def cpp_path(request: pytest.FixtureRequest, builds: dict[Variant, BuildResult]) -> KernelPath:
    """A compiled KernelPath. A failed build fails the test; only a CPU without AVX-512 skips."""
    variant = Variant.SCALAR_ONLY if request.param == "scalar_only" else Variant.FULL
    result = builds[variant]
    assert result.state is BuildState.READY, f"{variant} build failed: {result.error}"
    assert result.library is not None
    backend = Backend.SCALAR if request.param == "scalar_only" else Backend(request.param)
    if backend is Backend.AVX512 and not result.library.cpu_avx512:
        pytest.skip("this CPU lacks avx512f/bw/vl/dq")
    return KernelPath(backend, result.library)
