"""The code paths (backends) of the dense linear, and the object that runs one of them.

KernelPath is the one type callers hold: a Backend plus the loaded library (None for the
reference). Its linear() sends what the C++ kernels handle (bf16 weight, fp32/bf16 x, up to
MAX_ROWS rows) to them and everything else to torch's F.linear, so every backend accepts the
same inputs and returns the same dtype.
"""

from __future__ import annotations

import functools
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F

from kernels._native import NativePath, path_id
from kernels.tier import Tier

MAX_ROWS = 32  # more rows (prefill) go to torch's matmul (oneDNN), which is compute-efficient
X_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes the C++ kernels take
_BIAS_DTYPES = (torch.float32, torch.bfloat16)


class Backend(StrEnum):
    """A code path: torch's F.linear, or one tier of the C++ library's kernels.

    Each value is its kernels.tier.Tier's label. AVX512_BF16 runs bf16 activations through
    vdpbf16ps and fp32 ones through the AVX-512 FMA kernel; AVX512 and AVX2 widen bf16 weights
    to fp32 and use FMA (16 or 8 lanes) for both activation dtypes.
    """

    REFERENCE = "reference"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_BF16 = "avx512_bf16"

    @property
    def tier(self) -> Tier:
        return Tier.parse(self.value)

    @property
    def path_id(self) -> int:
        """The C++ ops' `path` (csrc/native.h); the reference has none (ValueError)."""
        return path_id(self.tier)


FASTEST_FIRST = (Backend.AVX512_BF16, Backend.AVX512, Backend.AVX2, Backend.REFERENCE)


def needs_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Autograd must see this call: the C++ op has no backward, so torch runs it instead."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The oracle and fallback: F.linear with weight (and bias) in x's dtype; returns x's dtype."""
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    b = bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)
    return F.linear(x, w, b)


def is_bf16_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether torch would run this product as a bf16 GEMM on the CPU (oneDNN)."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu
            and not needs_grad(x, weight, bias))


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """x [T, K] bf16 @ weight.T in fp32, rounded to bf16 once: what torch's bf16 GEMM computes
    (fp32 accumulation) up to the order of its sums, ~6x faster on CPUs without bf16 dot
    products (AMD Zen 3: SmolLM2's 200-token prompt 0.7 s against 4.3 s on one thread)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


# Tiers whose prefill-sized bf16 products stay a bf16 GEMM (torch's, through oneDNN): the
# oracle, and CPUs with bf16 dot products. The others widen to fp32 (prefill_linear).
BF16_GEMM_TIERS = (Tier.REFERENCE, Tier.AVX512_BF16)


def onednn_bf16_gemm() -> bool:
    """Whether torch runs a CPU bf16 GEMM through oneDNN on this CPU (AVX-512 BW and up).
    Elsewhere (AMD Zen 3: AVX2 only) torch's own bf16 GEMM runs it, which keeps no per-shape
    primitive, so there is nothing to pre-build."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def padded_rows(rows: int) -> int:
    """The row count torch's bf16 GEMM is given for a `rows`-row product (rows > MAX_ROWS):
    rounded up to one of eight steps per power of two, so at most 1/8 more rows.

    Why: torch runs a bf16 GEMM through oneDNN, which builds and caches one primitive per
    shape, with its own scratch buffers, up to 1024 of them. A worker that prefills prompts
    of every length therefore grew by ~3 MB per new token count on SmolLM2's shapes (+750 MB
    over 220 lengths; the soak's decode worker +10% after warm-up), and paid a primitive
    build for most prompts. Eight buckets per octave bound the shapes to ~8 per doubling of
    the batch (123 against 758 MB over the same lengths) and run 3.26x faster on new lengths
    (Intel Xeon with AMX and avx512_bf16, 2 threads; benchmarks/gemm_buckets.py). The
    padding is zero rows, sliced off.
    """
    if rows <= MAX_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every padded_rows value a product of MAX_ROWS < rows <= max_rows can take, ascending."""
    buckets: list[int] = []
    rows = MAX_ROWS + 1
    while rows <= max_rows:
        buckets.append(padded_rows(rows))
        rows = buckets[-1] + 1
    return buckets


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """reference_linear on x [T, K] padded with zero rows to padded_rows(T); returns [T, N].
    Each output row depends on its own input row only, so the padding changes no value but
    the GEMM's blocking (as any change of T does)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    return reference_linear(x, weight, bias)[:rows]


class KernelPath(NativePath[Backend]):
    """One runnable backend: the reference, or a compiled one with the loaded library."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        """x [..., K] @ weight.T (+ bias) -> [..., N] in x's dtype; weight [N, K].

        The kernels take a bf16 weight (rows contiguous), fp32 or bf16 x of up to MAX_ROWS rows
        on the CPU, and accumulate in fp32; any other input, or a call autograd must record,
        runs torch's F.linear.
        """
        if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
            raise ValueError(f"dense: x [..., {x.shape[-1]}] does not match weight "
                             f"{tuple(weight.shape)} (expected [N, {x.shape[-1]}])")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"dense: bias {tuple(bias.shape)} does not match weight "
                             f"{tuple(weight.shape)}")
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.shape[0] > MAX_ROWS and self.widens_prefill(x2, weight, bias):
            return prefill_linear(x, weight, bias)
        if x2.shape[0] > MAX_ROWS and is_bf16_gemm(x2, weight, bias):
            y = bucketed_linear(x2, weight, bias)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
        if (self.library is None or x2.shape[0] > MAX_ROWS or x2.dtype not in X_DTYPES
                or not x2.is_cpu or not self.takes_weight(weight, bias)
                or needs_grad(x, weight, bias)):
            return reference_linear(x, weight, bias)
        y = self.op(x2, weight, bias, self.backend.path_id)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])

    def widens_prefill(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> bool:
        """Whether a prefill-sized bf16 product runs in fp32 (prefill_linear) on this tier:
        every compiled tier without bf16 dot products, where torch's bf16 GEMM is slow."""
        return self.backend.tier not in BF16_GEMM_TIERS and is_bf16_gemm(x, weight, bias)

    def takes_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the C++ kernels take this weight and bias (else torch runs them)."""
        return (self.library is not None and weight.dtype == torch.bfloat16 and weight.is_cpu
                and weight.stride(-1) == 1 and weight.stride(0) >= weight.shape[1]
                and (bias is None or (bias.dtype in _BIAS_DTYPES and bias.is_contiguous())))

    @functools.cached_property
    def op(self) -> Any:
        """The C++ op's overload, resolved once: (x [m, K], weight, bias, path) -> y [m, N]."""
        assert self.library is not None, "the reference path has no C++ op"
        return self.library.ops.linear.default
