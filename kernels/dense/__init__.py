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

import torch
from torch import nn

from kernels._native import BackendUnavailableError, BuildInfo, Dispatch
from kernels.dense.backend import (
    FASTEST_FIRST,
    MAX_ROWS,
    Backend,
    KernelPath,
    bucketed_linear,
    padded_rows,
    reference_linear,
    row_buckets,
)
from kernels.dense.build import RECIPE, BuildConfig
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
    "bucketed_linear",
    "padded_rows",
    "row_buckets",
]

_dispatch: Dispatch[Backend, KernelPath] = Dispatch(
    "dense", FASTEST_FIRST, lambda _config: RECIPE, BuildConfig.from_env, KernelPath, Backend)


def configure(config: BuildConfig) -> None:
    """Choose the build directory; call before the first kernel use (the first build wins)."""
    _dispatch.configure(config)


def available_backends() -> list[str]:
    """Backends this machine can run, fastest first (builds the library on first call)."""
    return [str(b) for b in _dispatch.runnable(_dispatch.build())]


def kernel_path(backend: str | Backend | None = None) -> KernelPath:
    """The KernelPath that `backend` resolves to; callers on a hot path can keep it.

    None: the fastest backend this CPU runs whose tier is at most kernels.tier.max_tier()
    (the reference at worst)."""
    return _dispatch.path(backend)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: str | Backend | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x's dtype; weight [N, K] (bf16 for the kernels)."""
    return kernel_path(backend).linear(x, weight, bias)


def accelerate_linears(model: nn.Module, backend: str | Backend | None = None) -> int:
    """Swap every bf16 CPU nn.Linear in model for a DenseLinear; returns how many were swapped.

    Parameters are shared, not copied (tied embeddings stay tied). Without a runnable C++
    kernel the swap still pays: prefill-sized products get their rows bucketed
    (backend.padded_rows), so torch's bf16 GEMM caches a bounded set of shapes.
    """
    return swap_linears(model, kernel_path(backend))


def decoder(backend: str | Backend | None = None, mxfp4_int8: bool = False,
            ) -> NativeDecoder | None:
    """The fused decoder layer / native paged attention on `backend`'s library (kernels.dense
    .layer), or None when that resolves to the reference path (then torch runs everything).
    mxfp4_int8: fused MXFP4 projections take int8 activations (EngineConfig.quant_activations)."""
    return native_decoder(kernel_path(backend), mxfp4_int8)


def build_info(build: bool = True) -> BuildInfo:
    """Build state and active backend; build=False reports without compiling anything."""
    return _dispatch.info(build)
