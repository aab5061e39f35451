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

import torch

from kernels._native import BackendUnavailableError, BuildInfo, BuildState, Dispatch
from kernels.mxfp4.backend import FASTEST_FIRST, Activations, Backend, KernelPath
from kernels.mxfp4.build import BuildConfig, Variant, recipe
from kernels.mxfp4.encoder import Encoder

__all__ = [
    "Activations",
    "Backend",
    "BackendUnavailableError",
    "BuildConfig",
    "BuildInfo",
    "BuildState",
    "Encoder",
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

_dispatch: Dispatch[Backend, KernelPath] = Dispatch(
    "mxfp4", FASTEST_FIRST, recipe, BuildConfig.from_env, KernelPath, Backend)


def configure(config: BuildConfig) -> None:
    """Choose the build directory and variant; call before the first kernel use."""
    _dispatch.configure(config)


def available_backends() -> list[str]:
    """Backends this machine can run, fastest first, whatever the tier cap (builds the library on
    first call)."""
    return [str(b) for b in _dispatch.runnable(_dispatch.build())]


def kernel_path(backend: str | Backend | None = None) -> KernelPath:
    """The KernelPath that `backend` resolves to; callers on a hot path can keep it."""
    return _dispatch.path(backend)


def quantize(
    w: torch.Tensor, backend: str | Backend | None = None, encoder: Encoder = Encoder.OCP
) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]);
    encoder picks each block's shared exponent (OCP's rule, or the least squared error)."""
    return kernel_path(backend).quantize(w, encoder)


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
    activations: Activations = Activations.FLOAT,
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype; W is blocks [N, K/32, 16], scales [N, K/32].
    activations=INT8 quantises x to int8 per 32-block first (W4A8)."""
    return kernel_path(backend).linear(x, blocks, scales, bias, activations)


def build_info(build: bool = True) -> BuildInfo:
    """Build state and active backend; build=False reports without compiling anything."""
    return _dispatch.info(build)
