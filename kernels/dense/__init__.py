"""Dense bf16-weight linear for CPU decode: a GEMV/GEMM that streams weights near bandwidth.

    y = linear(x, weight, bias)          # x [..., K] @ weight.T (+ bias), weight [N, K]
    n = accelerate_linears(model)        # bf16 nn.Linear -> DenseLinear, Parameters shared
    native = decoder()                   # fused decoder layer + paged attention (layer.py)

The C++ kernels take a bf16 weight and fp32 or bf16 x of 1..32 rows (fp32 accumulation,
output in x's dtype); larger batches (prefill), fp32 weights and other dtypes run torch's
F.linear, the reference. Each function takes backend=None | "reference" | "avx2" | "avx512" |
"avx512_bf16" (the kernels.tier labels); None picks the fastest backend this CPU runs whose tier
is at most kernels.tier.max_tier(), and is resolved again after set_max_tier. An explicit
backend is not capped. The library is JIT-built at first use (see build.py); configure()
chooses where, build_info() reports what is active. If it cannot be built, a RuntimeWarning is
issued and everything runs on torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from kernels import tier
from kernels.dense.backend import (
    MAX_ROWS,
    Backend,
    BackendUnavailableError,
    KernelPath,
    cpu_tier,
    reference_linear,
    runnable_backends,
    unavailable_reason,
)
from kernels.dense.build import BuildConfig, BuildResult, BuildState, load, peek
from kernels.dense.layer import (
    LayerGeometry,
    LayerWeights,
    NativeDecoder,
    Projection,
    StepTables,
    native_decoder,
)
from kernels.dense.module import DenseLinear, swap_linears

__all__ = [
    "MAX_ROWS",
    "Backend",
    "BackendUnavailableError",
    "BuildConfig",
    "BuildInfo",
    "DenseLinear",
    "KernelPath",
    "LayerGeometry",
    "LayerWeights",
    "NativeDecoder",
    "Projection",
    "StepTables",
    "accelerate_linears",
    "available_backends",
    "build_info",
    "configure",
    "decoder",
    "kernel_path",
    "linear",
    "reference_linear",
]

_config: BuildConfig | None = None
_config_lock = threading.Lock()
_paths: dict[str | Backend | None, KernelPath] = {}  # resolved backend arguments


def _forget_paths() -> None:
    """The cap changed: backend=None must be resolved again (explicit names are not capped,
    but clearing everything keeps this simple and cheap)."""
    _paths.clear()


tier.on_cap_change(_forget_paths)


def configure(config: BuildConfig) -> None:
    """Choose the build directory; call before the first kernel use (the first build wins)."""
    global _config
    with _config_lock:
        _config = config
        _paths.clear()


def _build() -> BuildResult:
    global _config
    with _config_lock:
        if _config is None:
            _config = BuildConfig.from_env()
        config = _config
    return load(config)


def available_backends() -> list[str]:
    """Backends this machine can run, fastest first (builds the library on first call)."""
    return [str(b) for b in runnable_backends(_build())]


def kernel_path(backend: str | Backend | None = None) -> KernelPath:
    """The KernelPath that `backend` resolves to; callers on a hot path can keep it.

    None: the fastest backend this CPU runs whose tier is at most kernels.tier.max_tier()
    (the reference at worst)."""
    path = _paths.get(backend)
    if path is None:
        path = _resolve(backend)
        _paths[backend] = path
    return path


def _resolve(backend: str | Backend | None) -> KernelPath:
    build = _build()
    runnable = runnable_backends(build)
    if backend is None:
        cap = tier.max_tier()
        chosen = next(b for b in runnable if b.tier <= cap)
    else:
        try:
            chosen = Backend(backend)
        except ValueError:
            names = ", ".join(repr(str(b)) for b in Backend)
            raise ValueError(f"dense: unknown backend {backend!r}; expected None or one of {names}"
                             ) from None
        if chosen not in runnable:
            raise BackendUnavailableError(
                f"dense: backend {str(chosen)!r} is unavailable: {unavailable_reason(chosen, build)}")
    return KernelPath(chosen, None if chosen is Backend.REFERENCE else build.library)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: str | Backend | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x's dtype; weight [N, K] (bf16 for the kernels)."""
    return kernel_path(backend).linear(x, weight, bias)


def accelerate_linears(model: nn.Module, backend: str | Backend | None = None) -> int:
    """Swap every bf16 CPU nn.Linear in model for a DenseLinear; returns how many were swapped.

    Parameters are shared, not copied (tied embeddings stay tied). With backend=None and no
    runnable C++ kernel, the model is left as it is (0): the swap would only add overhead.
    """
    path = kernel_path(backend)
    if backend is None and path.backend is Backend.REFERENCE:
        return 0
    return swap_linears(model, path)


def decoder(backend: str | Backend | None = None) -> NativeDecoder | None:
    """The fused decoder layer / native paged attention on `backend`'s library (kernels.dense
    .layer), or None when that resolves to the reference path (then torch runs everything)."""
    return native_decoder(kernel_path(backend))


@dataclass(frozen=True)
class BuildInfo:
    """What `pdmesh doctor` can show: the build's state, the CPU's tier, the cap, and which
    backend None picks (active)."""

    state: str
    build_dir: str
    library: str | None
    seconds: float
    compiled: bool
    error: str | None
    available: tuple[str, ...]
    active: str
    cpu_tier: str | None  # the fastest tier this CPU runs (None: unknown, library not loaded)
    max_tier: str  # kernels.tier's cap on automatic choice

    def __str__(self) -> str:
        if self.state == BuildState.READY:
            how = f"compiled in {self.seconds:.1f} s" if self.compiled else "loaded from cache"
            build = f"build ready ({how}) in {self.build_dir}"
        elif self.state == BuildState.FAILED:
            build = f"build failed: {self.error}"
        else:
            build = "build not attempted"
        return (f"active={self.active} (cpu tier {self.cpu_tier or 'unknown'}, cap "
                f"{self.max_tier}; available: {', '.join(self.available)}); {build}")


def build_info(build: bool = True) -> BuildInfo:
    """Build state and active backend; build=False reports without compiling anything."""
    result = _build() if build else peek()
    if result is None:
        result = BuildResult(_config or BuildConfig.from_env(), BuildState.NOT_BUILT)
    runnable = runnable_backends(result)
    cap = tier.max_tier()
    lib = result.library
    detected = cpu_tier(result)
    return BuildInfo(
        state=str(result.state),
        build_dir=str(result.config.build_dir),
        library=None if lib is None else str(lib.path),
        seconds=round(result.seconds, 3),
        compiled=result.compiled,
        error=result.error,
        available=tuple(str(b) for b in runnable),
        active=str(next(b for b in runnable if b.tier <= cap)),
        cpu_tier=None if detected is None else detected.label,
        max_tier=cap.label,
    )
