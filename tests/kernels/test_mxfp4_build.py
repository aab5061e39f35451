"""Both library variants build, dispatch picks the fastest path under the tier cap, the path ids
keep their contract, and a broken build falls back."""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kernels.mxfp4 as mxfp4
from kernels import _native
from kernels._native import runnable_backends, unavailable_reason
from kernels.mxfp4 import (
    Backend,
    BackendUnavailableError,
    BuildConfig,
    BuildState,
    KernelPath,
    Variant,
    reference,
)
from kernels.mxfp4.backend import FASTEST_FIRST
from kernels.mxfp4.build import BuildResult
from kernels.tier import Tier, max_tier, set_max_tier


@pytest.mark.parametrize("variant", list(Variant))
def test_both_variants_compile(builds: dict[Variant, BuildResult], variant: Variant) -> None:
    result = builds[variant]
    assert result.state is BuildState.READY, result.error
    assert result.library is not None and result.library.path.is_file()
    # Build time is not asserted here (a timed assertion fails on a busy machine);
    # `pdmesh kernels build` reports it, and benchmarks measure speed.
    assert result.library.has_avx512_code == (variant is Variant.FULL)
    assert result.library.has_avx2_code == (variant is Variant.FULL)


def test_scalar_only_library_has_no_avx2_or_avx512_instructions(
        builds: dict[Variant, BuildResult]) -> None:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    libs = {v: builds[v].library for v in Variant}
    assert all(lib is not None for lib in libs.values())
    text = {v: subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib.path)],
                              capture_output=True, text=True, check=True).stdout
            for v, lib in libs.items()}
    mnemonics = {v: set(re.findall(r"^\s*[0-9a-f]+:\t(\S+)", t, re.MULTILINE))
                 for v, t in text.items()}
    # VEX/EVEX-encoded instructions (AVX and later) are the only ones whose mnemonic starts with v.
    assert not {m for m in mnemonics[Variant.SCALAR_ONLY] if m.startswith("v")}
    assert "ymm" not in text[Variant.SCALAR_ONLY] and "zmm" not in text[Variant.SCALAR_ONLY]
    # The full library holds both kinds: vpshufb on ymm is the AVX2 decoder's lookup.
    assert "zmm" in text[Variant.FULL] and re.search(r"vpshufb\s+%ymm", text[Variant.FULL])


def test_available_backends_and_default(builds: dict[Variant, BuildResult]) -> None:
    lib = builds[Variant.FULL].library
    assert lib is not None
    expected = ((["avx512_bf16"] if lib.cpu_bf16 else []) + (["avx512"] if lib.cpu_avx512 else [])
                + (["avx2"] if lib.cpu_avx2 else []) + ["scalar", "reference"])
    assert mxfp4.available_backends() == expected
    assert mxfp4.kernel_path().backend == next(b for b in expected if Backend(b).tier <= max_tier())
    assert mxfp4.kernel_path("reference") == KernelPath(Backend.REFERENCE)
    assert runnable_backends(FASTEST_FIRST, builds[Variant.SCALAR_ONLY]) == (Backend.SCALAR, Backend.REFERENCE)
    assert lib.cpu_tier() == Backend(expected[0]).tier


def test_path_ids_and_tiers_are_the_contract() -> None:
    # csrc/ops.cpp and kernels.dense's fused layer take these ids; they must never change.
    assert {b: b.path_id for b in Backend if b is not Backend.REFERENCE} == {
        Backend.SCALAR: 0, Backend.AVX512: 1, Backend.AVX2: 2, Backend.AVX512_BF16: 3}
    assert [b.tier for b in FASTEST_FIRST] == sorted(Tier, reverse=True)
    assert Backend.SCALAR.tier is Tier.PORTABLE and Backend.REFERENCE.tier is Tier.REFERENCE
    with pytest.raises(ValueError, match="has no C\\+\\+ code path"):
        _ = Backend.REFERENCE.path_id


@pytest.fixture
def restore_cap() -> Iterator[None]:
    before = max_tier()
    yield
    set_max_tier(before)


def test_the_tier_cap_lowers_the_default_only(builds: dict[Variant, BuildResult],
                                              restore_cap: None) -> None:
    runnable = runnable_backends(FASTEST_FIRST, builds[Variant.FULL])
    for cap in Tier:
        set_max_tier(cap)
        expected = next(b for b in runnable if b.tier <= cap)
        assert mxfp4.kernel_path().backend is expected  # resolved again after each change
        info = mxfp4.build_info()
        assert info.active == expected and info.max_tier == cap.label
        assert f"cap {cap.label}" in str(info)
        assert mxfp4.available_backends() == [str(b) for b in runnable]  # uncapped
    set_max_tier(Tier.REFERENCE)
    w = torch.randn(2, 64)
    for backend in runnable:  # explicit names are not capped
        assert mxfp4.kernel_path(backend).backend is backend
        assert torch.equal(mxfp4.quantize(w, backend=backend)[1], reference.quantize(w)[1])


def test_build_info_reports_the_active_path(builds: dict[Variant, BuildResult]) -> None:
    info = mxfp4.build_info()
    lib = builds[Variant.FULL].library
    assert lib is not None
    assert info.state == "ready" and info.variant == "full"
    assert info.active == mxfp4.kernel_path().backend
    assert info.available == tuple(mxfp4.available_backends())
    assert info.cpu_tier == lib.cpu_tier().label and info.max_tier == max_tier().label
    assert (info.cpu_avx2, info.cpu_avx512, info.cpu_avx512_bf16) == (
        lib.cpu_avx2, lib.cpu_avx512, lib.cpu_bf16)
    assert info.library is not None and Path(info.library).is_file()
    assert f"active={info.active}" in str(info) and f"cpu tier {info.cpu_tier}" in str(info)
    assert info.to_dict()["state"] == "ready"


def test_a_path_this_cpu_cannot_run_raises(builds: dict[Variant, BuildResult]) -> None:
    """The C++ op refuses a path id this CPU (or this variant) cannot run, with the reason."""
    full, scalar_only = builds[Variant.FULL], builds[Variant.SCALAR_ONLY]
    assert full.library is not None and scalar_only.library is not None
    w = torch.randn(2, 32)
    for backend in set(Backend) - set(runnable_backends(FASTEST_FIRST, full)):
        with pytest.raises(RuntimeError, match="which this CPU lacks"):
            full.library.ops.quantize(w, backend.path_id)
        with pytest.raises(BackendUnavailableError, match="this CPU cannot run"):
            mxfp4.kernel_path(backend)
    for backend in (Backend.AVX2, Backend.AVX512, Backend.AVX512_BF16):
        with pytest.raises(RuntimeError, match="not compiled into this library"):
            scalar_only.library.ops.quantize(w, backend.path_id)


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
    assert "no AVX-512 code" in unavailable_reason(Backend.AVX512_BF16, scalar_only)
    assert "no AVX2 code" in unavailable_reason(Backend.AVX2, scalar_only)
    with pytest.raises(ValueError, match="needs library"):
        KernelPath(Backend.SCALAR)


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Forget the loaded libraries and resolved paths for one test (restored afterwards)."""
    monkeypatch.setattr(_native, "_results", {})
    monkeypatch.setattr(mxfp4._dispatch, "_paths", {})
    monkeypatch.setattr(mxfp4._dispatch, "_config", None)
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
    monkeypatch.setattr(_native.shutil, "which", lambda _name: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = mxfp4.build_info()
    assert info.state == "failed" and "no C++ compiler" in (info.error or "")
    assert any("no C++ compiler" in str(w.message) for w in caught)
    assert not any(fresh_state.iterdir())  # nothing was attempted


def test_build_info_without_building(fresh_state: Path) -> None:
    info = mxfp4.build_info(build=False)
    assert info.state == "not_built" and info.available == ("reference",)
