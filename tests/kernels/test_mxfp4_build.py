"""Both library variants build, dispatch picks the fastest path, and a broken build falls back."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import kernels.mxfp4 as mxfp4
from kernels.mxfp4 import (
    Backend,
    BackendUnavailableError,
    BuildConfig,
    BuildState,
    KernelPath,
    Variant,
    build,
    reference,
)
from kernels.mxfp4.backend import runnable_backends, unavailable_reason
from kernels.mxfp4.build import BuildResult

MAX_BUILD_SECONDS = 60.0


@pytest.mark.parametrize("variant", list(Variant))
def test_both_variants_compile(builds: dict[Variant, BuildResult], variant: Variant) -> None:
    result = builds[variant]
    assert result.state is BuildState.READY, result.error
    assert result.library is not None and result.library.path.is_file()
    if result.compiled:  # a cold cache: this run compiled it
        assert result.seconds < MAX_BUILD_SECONDS
    assert result.library.has_avx512_code == (variant is Variant.FULL)


def test_scalar_only_library_has_no_avx512_instructions(builds: dict[Variant, BuildResult]) -> None:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    libs = {v: builds[v].library for v in Variant}
    assert all(lib is not None for lib in libs.values())
    text = {v: subprocess.run([objdump, "-d", str(lib.path)], capture_output=True, text=True,
                              check=True).stdout for v, lib in libs.items()}
    assert "zmm" not in text[Variant.SCALAR_ONLY]
    assert "zmm" in text[Variant.FULL]


def test_available_backends_and_default(builds: dict[Variant, BuildResult]) -> None:
    lib = builds[Variant.FULL].library
    assert lib is not None
    expected = (["avx512"] if lib.cpu_avx512 else []) + ["scalar", "reference"]
    assert mxfp4.available_backends() == expected
    assert mxfp4.kernel_path().backend == expected[0]
    assert mxfp4.kernel_path("reference") == KernelPath(Backend.REFERENCE)
    assert runnable_backends(builds[Variant.SCALAR_ONLY]) == (Backend.SCALAR, Backend.REFERENCE)


def test_build_info_reports_the_active_path(builds: dict[Variant, BuildResult]) -> None:
    info = mxfp4.build_info()
    assert info.state == "ready" and info.variant == "full"
    assert info.active == mxfp4.available_backends()[0]
    assert info.available == tuple(mxfp4.available_backends())
    assert info.library is not None and Path(info.library).is_file()
    assert f"active={info.active}" in str(info) and info.to_dict()["state"] == "ready"


def test_every_public_function_takes_every_backend() -> None:
    w = torch.randn(3, 64)
    for name in mxfp4.available_backends():
        blocks, scales = mxfp4.quantize(w, backend=name)
        values = mxfp4.dequantize(blocks, scales, torch.bfloat16, backend=name)
        y = mxfp4.linear(torch.randn(2, 64), blocks, scales, backend=name)
        assert values.shape == (3, 64) and y.shape == (2, 3)


def test_bad_backend_names_and_missing_features(builds: dict[Variant, BuildResult]) -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        mxfp4.quantize(torch.zeros(32), backend="cuda")
    scalar_only = builds[Variant.SCALAR_ONLY]
    assert "no AVX-512 code" in unavailable_reason(Backend.AVX512, scalar_only)
    with pytest.raises(ValueError, match="needs library"):
        KernelPath(Backend.SCALAR)


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Forget the loaded libraries and resolved paths for one test (restored afterwards)."""
    monkeypatch.setattr(build, "_results", {})
    monkeypatch.setattr(mxfp4, "_paths", {})
    monkeypatch.setattr(mxfp4, "_config", None)
    mxfp4.configure(BuildConfig(build_root=tmp_path))
    return tmp_path


def test_compile_error_falls_back_to_reference(fresh_state: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    from torch.utils import cpp_extension

    def broken_load(**_: object) -> str:
        raise RuntimeError("ops.cpp:1:1: error: simulated compiler failure\nninja: build stopped")

    monkeypatch.setattr(cpp_extension, "load", broken_load)
    with pytest.warns(RuntimeWarning, match="simulated compiler failure"):
        assert mxfp4.available_backends() == ["reference"]
    info = mxfp4.build_info()
    assert info.state == "failed" and info.active == "reference" and info.cpu_avx512 is None
    w = torch.randn(2, 32)
    blocks, scales = mxfp4.quantize(w)  # runs on the reference
    expected = reference.quantize(w)
    assert torch.equal(blocks, expected[0]) and torch.equal(scales, expected[1])
    with pytest.raises(BackendUnavailableError, match="did not build"):
        mxfp4.dequantize(blocks, scales, backend="scalar")


def test_missing_compiler_is_reported(fresh_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda _name: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = mxfp4.build_info()
    assert info.state == "failed" and "no C++ compiler" in (info.error or "")
    assert any("no C++ compiler" in str(w.message) for w in caught)
    assert not any(fresh_state.iterdir())  # nothing was attempted


def test_build_info_without_building(fresh_state: Path) -> None:
    info = mxfp4.build_info(build=False)
    assert info.state == "not_built" and info.available == ("reference",)
