"""MXFP4 (OCP MX v1.0) weights on the CPU: quantise, dequantise, and a fused decode linear.

    blocks, scales = quantize(w)                  # w [..., K] -> [..., K/32, 16], [..., K/32]
    w2 = dequantize(blocks, scales, torch.bfloat16)
    y = linear(x, blocks, scales, bias)           # x @ W.T, W stored as [N, K/32, 16], [N, K/32]

Each function takes backend=None | "reference" | "scalar" | "avx2" | "avx512" | "avx512_bf16";
None picks the fastest this CPU runs whose kernels.tier.Tier is at most kernels.tier.max_tier()
(explicit names are not capped). The C++ library is JIT-built at first use (see build.py); configure() chooses where
and which variant, build_info() reports what is active (for `pdmesh doctor`). If it cannot be
built, a RuntimeWarning is issued and everything runs on the plain-torch reference.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kernels import tier
from kernels.mxfp4.backend import (
    Backend,
    BackendUnavailableError,
    KernelPath,
    cpu_tier,
    runnable_backends,
    unavailable_reason,
)
from kernels.mxfp4.build import BuildConfig, BuildResult, BuildState, Variant, load, peek

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "BuildConfig",
    "BuildInfo",
    "BuildState",
    "KernelPath",
    "Variant",
    "available_backends",
    "build_info",
    "configure",
    "dequantize",
    "kernel_path",
    "linear",
    "quantize",
]

_config: BuildConfig | None = None
_config_lock = threading.Lock()
_paths: dict[str | Backend | None, KernelPath] = {}  # resolved backend arguments (per config, cap)


def configure(config: BuildConfig) -> None:
    """Choose the build directory and variant; call before the first kernel use."""
    global _config
    with _config_lock:
        _config = config
        _paths.clear()


def _forget_paths() -> None:
    """A new tier cap: backend=None must be resolved again."""
    with _config_lock:
        _paths.clear()


tier.on_cap_change(_forget_paths)


def _current_config() -> BuildConfig:
    global _config
    with _config_lock:
        if _config is None:
            _config = BuildConfig.from_env()
        return _config


def _build() -> BuildResult:
    return load(_current_config())


def available_backends() -> list[str]:
    """Backends this machine can run, fastest first, whatever the tier cap (builds the library on
    first call)."""
    return [str(b) for b in runnable_backends(_build())]


def kernel_path(backend: str | Backend | None = None) -> KernelPath:
    """The KernelPath that `backend` resolves to; callers on a hot path can keep it."""
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
        chosen = next(b for b in runnable if b.tier <= cap)  # the reference is always runnable
    else:
        try:
            chosen = Backend(backend)
        except ValueError:
            names = ", ".join(repr(str(b)) for b in Backend)
            raise ValueError(f"mxfp4: unknown backend {backend!r}; expected None or one of {names}") from None
        if chosen not in runnable:
            raise BackendUnavailableError(
                f"mxfp4: backend {str(chosen)!r} is unavailable: {unavailable_reason(chosen, build)}"
            )
    return KernelPath(chosen, None if chosen is Backend.REFERENCE else build.library)


def quantize(
    w: torch.Tensor, backend: str | Backend | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])."""
    return kernel_path(backend).quantize(w)


def dequantize(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    backend: str | Backend | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> dtype [..., G*32] (or into out)."""
    return kernel_path(backend).dequantize(blocks, scales, dtype, out)


def linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype; W is blocks [N, K/32, 16], scales [N, K/32]."""
    return kernel_path(backend).linear(x, blocks, scales, bias)


@dataclass(frozen=True)
class BuildInfo:
    """What `pdmesh doctor` shows: the build's state, the CPU's tier, the cap and which backend
    None picks (`active`)."""

    variant: str
    state: str
    build_dir: str
    library: str | None
    seconds: float
    compiled: bool
    error: str | None
    cpu_avx2: bool | None  # avx2 + fma + f16c; None: unknown (the library is not loaded)
    cpu_avx512: bool | None
    cpu_avx512_bf16: bool | None
    cpu_tier: str | None  # the highest tier this CPU executes (None: unknown)
    max_tier: str  # the cap on backend=None (kernels.tier.max_tier())
    available: tuple[str, ...]  # runnable here, fastest first, uncapped
    active: str

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)

    def __str__(self) -> str:
        if self.state == BuildState.READY:
            how = f"compiled in {self.seconds:.1f} s" if self.compiled else "loaded from cache"
            build = f"{self.variant} build ready ({how}) in {self.build_dir}"
        elif self.state == BuildState.FAILED:
            build = f"{self.variant} build failed: {self.error}"
        else:
            build = f"{self.variant} build not attempted"
        flags = {True: "yes", False: "no", None: "unknown"}
        cpu = (f"cpu tier {self.cpu_tier or 'unknown'} (avx2={flags[self.cpu_avx2]} "
               f"avx512={flags[self.cpu_avx512]} avx512_bf16={flags[self.cpu_avx512_bf16]})")
        return (f"active={self.active} (cap {self.max_tier}; available: "
                f"{', '.join(self.available)}); {build}; {cpu}")


def build_info(build: bool = True) -> BuildInfo:
    """Build state and active backend; build=False reports without compiling anything."""
    config = _current_config()
    result = _build() if build else peek(config.variant)
    if result is None:
        result = BuildResult(config, BuildState.NOT_BUILT)
    runnable = runnable_backends(result)
    lib = result.library
    cap = tier.max_tier()
    top = cpu_tier(lib)
    return BuildInfo(
        variant=str(result.config.variant),
        state=str(result.state),
        build_dir=str(result.config.build_dir),
        library=None if lib is None else str(lib.path),
        seconds=round(result.seconds, 3),
        compiled=result.compiled,
        error=result.error,
        cpu_avx2=None if lib is None else lib.cpu_avx2,
        cpu_avx512=None if lib is None else lib.cpu_avx512,
        cpu_avx512_bf16=None if lib is None else lib.cpu_bf16,
        cpu_tier=None if top is None else top.label,
        max_tier=cap.label,
        available=tuple(str(b) for b in runnable),
        active=str(next(b for b in runnable if b.tier <= cap)),
    )
