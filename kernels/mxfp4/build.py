"""JIT build of the MXFP4 C++ library with torch.utils.cpp_extension.load, one per Variant.

The library is compiled at first use (about 15 s on two cores) into a directory keyed by the
torch and Python versions under BuildConfig.build_root, and reloaded from there afterwards
(ninja only recompiles what changed). Its ops register under torch.ops.<namespace>; no pybind.
A failed build (no compiler, no ninja, a compile error) is recorded, not raised: callers fall back
to the plain-torch reference and a RuntimeWarning says why.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).parent / "csrc"

_X86_64 = ("x86_64", "amd64")
# Bits of the library's features() op (see csrc/ops.cpp): compiled code, and what the CPU has.
_HAS_AVX512_CODE = 1
_CPU_AVX512 = 2  # avx512f/bw/vl/dq
_CPU_BF16 = 4  # avx512_bf16 (with avx512)
_HAS_AVX2_CODE = 8
_CPU_AVX2 = 16
_CPU_FMA = 32
_CPU_F16C = 64


# The full (AVX-512) variant's namespace: kernels/dense's fused decoder layer calls its linear op.
FULL_NAMESPACE = "pdmesh_mxfp4"

class Variant(StrEnum):
    """Which code the library contains: scalar + AVX2 + AVX-512 with run-time dispatch, or scalar
    only."""

    FULL = "full"
    SCALAR_ONLY = "scalar_only"  # no AVX2 / AVX-512 code at all (no such TU, no such flags)


class BuildState(StrEnum):
    NOT_BUILT = "not_built"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class BuildConfig:
    """Where and what to build. build_root holds one directory per torch/Python version."""

    build_root: Path
    variant: Variant = Variant.FULL
    verbose: bool = False

    @classmethod
    def from_env(cls) -> BuildConfig:
        """TORCH_EXTENSIONS_DIR if set, else <PDMESH_CACHE or ~/.cache/pdmesh>/torch_extensions;
        the full variant on x86-64, the scalar-only one elsewhere (no <immintrin.h> there).

        The only place the kernels read the environment; engines pass their own config instead.
        """
        variant = Variant.FULL if platform.machine().lower() in _X86_64 else Variant.SCALAR_ONLY
        torch_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
        if torch_dir:
            return cls(build_root=Path(torch_dir), variant=variant)
        cache = os.environ.get("PDMESH_CACHE") or Path.home() / ".cache" / "pdmesh"
        return cls(build_root=Path(cache) / "torch_extensions", variant=variant)

    @property
    def namespace(self) -> str:
        """Extension name and torch.ops namespace; distinct per variant (both can be loaded)."""
        return FULL_NAMESPACE if self.variant is Variant.FULL else "pdmesh_mxfp4_scalar"

    @property
    def build_dir(self) -> Path:
        tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
        return self.build_root / tag / self.namespace


@dataclass(frozen=True)
class Library:
    """A loaded MXFP4 library: its ops namespace and what it (and this CPU) can run."""

    namespace: str
    path: Path
    features: int

    @property
    def ops(self) -> Any:
        return getattr(torch.ops, self.namespace)

    def _has(self, *bits: int) -> bool:
        return all(self.features & bit for bit in bits)

    @property
    def has_avx512_code(self) -> bool:
        return self._has(_HAS_AVX512_CODE)

    @property
    def has_avx2_code(self) -> bool:
        return self._has(_HAS_AVX2_CODE)

    @property
    def cpu_avx2(self) -> bool:
        """The CPU has avx2, fma and f16c (the AVX2 tier), whether or not the code is compiled in."""
        return self._has(_CPU_AVX2, _CPU_FMA, _CPU_F16C)

    @property
    def cpu_avx512(self) -> bool:
        """The CPU has avx512f/bw/vl/dq, whether or not the code is compiled in."""
        return self._has(_CPU_AVX512)

    @property
    def cpu_bf16(self) -> bool:
        """The CPU has avx512_bf16 as well: bf16 x can use vdpbf16ps."""
        return self._has(_CPU_AVX512, _CPU_BF16)

    def missing_avx2_features(self) -> list[str]:
        """The AVX2 tier's CPU features this CPU lacks (empty when it has them all)."""
        named = (("avx2", _CPU_AVX2), ("fma", _CPU_FMA), ("f16c", _CPU_F16C))
        return [name for name, bit in named if not self._has(bit)]


@dataclass(frozen=True)
class BuildResult:
    """Outcome of loading one variant; library is None unless state is READY."""

    config: BuildConfig
    state: BuildState
    library: Library | None = None
    seconds: float = 0.0  # wall time of the load (compile included when it compiled)
    compiled: bool = False  # the .so was (re)built by this load
    error: str | None = None


_results: dict[Variant, BuildResult] = {}
_lock = threading.Lock()


def peek(variant: Variant) -> BuildResult | None:
    """The result of an earlier load() of this variant in this process, without building."""
    return _results.get(variant)


def load(config: BuildConfig) -> BuildResult:
    """Build (if needed) and load config.variant, once per process; never raises for build errors.

    A torch.ops namespace can be registered once per process, so a variant's first config wins.
    """
    with _lock:
        result = _results.get(config.variant)
        if result is None:
            result = _build(config)
            _results[config.variant] = result
            if result.state is BuildState.FAILED:
                warnings.warn(
                    f"MXFP4 C++ kernels unavailable ({result.error}); "
                    "falling back to the plain-torch reference (slow)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return result


def _missing_tool() -> str | None:
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _build(config: BuildConfig) -> BuildResult:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    start_ns = time.time_ns()
    missing = _missing_tool()
    if missing:
        return BuildResult(config, BuildState.FAILED, error=missing)
    sources = [CSRC / "ops.cpp", CSRC / "scalar.cpp", CSRC / "cpu.cpp"]
    cflags = ["-O3", "-fopenmp", f"-DPDMESH_MXFP4_NS={config.namespace}"]
    if config.variant is Variant.FULL:
        sources += [CSRC / name for name in
                    ("avx2.cpp", "avx2_linear.cpp", "avx512.cpp", "avx512_linear.cpp")]
    else:
        cflags.append("-DPDMESH_MXFP4_SCALAR_ONLY")
    try:
        config.build_dir.mkdir(parents=True, exist_ok=True)
        path = cpp_extension.load(
            name=config.namespace,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(config.build_dir),
            is_python_module=False,
            verbose=config.verbose,
        )
        features = int(getattr(torch.ops, config.namespace).features())
    except Exception as exc:  # compiler/linker errors, a broken toolchain, an unwritable cache
        return BuildResult(
            config,
            BuildState.FAILED,
            seconds=time.perf_counter() - start,
            error=_summarise(exc),
        )
    return BuildResult(
        config,
        BuildState.READY,
        library=Library(config.namespace, Path(path), features),
        seconds=time.perf_counter() - start,
        compiled=Path(path).stat().st_mtime_ns >= start_ns,
    )


def _summarise(exc: Exception) -> str:
    """The first compiler 'error:' line of a failed build (BuildConfig(verbose=True) shows all)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    detail = errors[0] if errors else (lines[-1] if lines else "")
    return f"{type(exc).__name__}: {detail[:500]}"
