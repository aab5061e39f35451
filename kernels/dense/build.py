"""JIT build of the dense C++ library with torch.utils.cpp_extension.load.

Built the same way as the MXFP4 library (kernels/mxfp4/build.py, whose generic helpers this
module reuses): compiled at first use (about 20 s on two cores) into a directory keyed by the
torch and Python versions under the same build root, and reloaded from there afterwards (ninja
only recompiles what changed). Its ops register under torch.ops.pdmesh_dense; no pybind. A
failed build is recorded, not raised: callers fall back to torch and a RuntimeWarning says why.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.mxfp4.build import BuildConfig as _Mxfp4BuildConfig
from kernels.mxfp4.build import BuildState
from kernels.mxfp4.build import _missing_tool as missing_tool
from kernels.mxfp4.build import _summarise as summarise

CSRC = Path(__file__).parent / "csrc"
NAMESPACE = "pdmesh_dense"  # extension name and torch.ops namespace
# ops.cpp: features() and linear(); layer_ops.cpp: the fused decoder layer (kernels/dense/layer.py).
# Every TU is compiled on every x86-64 CPU: the kernel TUs hold their tier's code in
# `#pragma GCC target` regions, and the ops check the CPU before calling in.
SOURCES = ("ops.cpp", "layer_ops.cpp",
           "gemv_avx512.cpp", "layer_avx512.cpp", "attend_avx512.cpp",
           "gemv_avx2.cpp", "layer_avx2.cpp", "attend_avx2.cpp")

# Bits of the library's features() op (see csrc/ops.cpp).
_CPU_AVX512 = 1
_CPU_BF16 = 2
_CPU_AVX2 = 4


@dataclass(frozen=True)
class BuildConfig:
    """Where to build: build_root holds one directory per torch/Python version."""

    build_root: Path
    verbose: bool = False

    @classmethod
    def from_env(cls) -> BuildConfig:
        """The MXFP4 library's root: TORCH_EXTENSIONS_DIR, else <PDMESH_CACHE>/torch_extensions."""
        return cls(build_root=_Mxfp4BuildConfig.from_env().build_root)

    @property
    def build_dir(self) -> Path:
        tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
        return self.build_root / tag / NAMESPACE


@dataclass(frozen=True)
class Library:
    """The loaded library: its path and what this CPU can run of it."""

    path: Path
    features: int

    @property
    def ops(self) -> Any:
        return getattr(torch.ops, NAMESPACE)

    @property
    def cpu_avx2(self) -> bool:
        """The CPU has avx2, fma and f16c: the AVX2 kernels run."""
        return bool(self.features & _CPU_AVX2)

    @property
    def cpu_avx512(self) -> bool:
        """The CPU has avx512f/bw/vl/dq: the AVX-512 FMA kernels run."""
        return bool(self.features & _CPU_AVX512)

    @property
    def cpu_bf16(self) -> bool:
        """The CPU also has avx512_bf16: the vdpbf16ps kernel runs."""
        return bool(self.features & _CPU_BF16)


@dataclass(frozen=True)
class BuildResult:
    """Outcome of the load; library is None unless state is READY."""

    config: BuildConfig
    state: BuildState
    library: Library | None = None
    seconds: float = 0.0  # wall time of the load (compile included when it compiled)
    compiled: bool = False  # the .so was (re)built by this load
    error: str | None = None


_result: BuildResult | None = None
_lock = threading.Lock()


def peek() -> BuildResult | None:
    """The result of an earlier load() in this process, without building."""
    return _result


def load(config: BuildConfig) -> BuildResult:
    """Build (if needed) and load the library, once per process; never raises for build errors.

    A torch.ops namespace can be registered once per process, so the first config wins.
    """
    global _result
    with _lock:
        if _result is None:
            _result = _build(config)
            if _result.state is BuildState.FAILED:
                warnings.warn(
                    f"dense C++ kernels unavailable ({_result.error}); "
                    "falling back to torch's F.linear",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return _result


def _build(config: BuildConfig) -> BuildResult:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    start_ns = time.time_ns()
    missing = missing_tool()
    if missing:
        return BuildResult(config, BuildState.FAILED, error=missing)
    config.build_dir.mkdir(parents=True, exist_ok=True)
    try:
        path = cpp_extension.load(
            name=NAMESPACE,
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=["-O3", "-fopenmp"],  # -fopenmp: at::parallel_for's OpenMP region
            extra_ldflags=["-fopenmp"],
            build_directory=str(config.build_dir),
            is_python_module=False,
            verbose=config.verbose,
        )
        features = int(getattr(torch.ops, NAMESPACE).features())
    except Exception as exc:  # compiler errors, linker errors, a broken toolchain...
        return BuildResult(config, BuildState.FAILED, seconds=time.perf_counter() - start,
                           error=summarise(exc))
    return BuildResult(
        config,
        BuildState.READY,
        library=Library(Path(path), features),
        seconds=time.perf_counter() - start,
        compiled=Path(path).stat().st_mtime_ns >= start_ns,
    )
