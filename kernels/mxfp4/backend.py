"""The code paths (backends) of the MXFP4 ops, and the object that runs one of them.

Every backend exposes the same three operations with the same signatures; KernelPath is the one
type that carries them, built the same way for each backend (a Backend plus the loaded library,
None for the reference).
"""

from __future__ import annotations

from enum import StrEnum

import torch

from kernels._native import NativePath, path_id
from kernels.mxfp4 import reference
from kernels.mxfp4.encoder import Encoder, quantize_mse
from kernels.mxfp4.format import (
    check_dtype,
    check_linear,
    check_out,
    check_packed,
    check_weight,
)
from kernels.tier import Tier

FUSED_MAX_ROWS = 32  # linear() with more rows dequantises once and calls torch's matmul
ACT_INT8 = 16  # ORed onto a path id: the linear op quantises x to int8 first (csrc/native.h)


class Activations(StrEnum):
    """How x enters the fused linear: as it is (fp32, or bf16 widened / vdpbf16ps), or quantised
    to int8 per 32-block with one fp32 scale each (W4A8: integer products, llama.cpp's Q8
    activations). INT8 runs one kernel on every compiled path (avx2_a8.cpp; AVX-512 CPUs run
    its AVX2 code) and the scalar one elsewhere; reference.linear_a8 is its oracle."""

    FLOAT = "float"
    INT8 = "int8"

    def op_path(self, path_id: int) -> int:
        """The `path` argument of the linear ops for this activation mode."""
        return path_id | ACT_INT8 if self is Activations.INT8 else path_id


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # dtypes the C++ ops produce directly


class Backend(StrEnum):
    """A code path: the plain-torch oracle, or one of the C++ library's kernel sets.

    Each backend sits on one rung of the kernels.tier ladder (`tier`) and, when compiled, has the
    `path` id the C++ ops take (`path_id`; kernels.dense's fused layer passes it through too).
    AVX512 never uses vdpbf16ps, even on a CPU that has it; AVX512_BF16 does for bf16 x.
    """

    REFERENCE = "reference"
    SCALAR = "scalar"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_BF16 = "avx512_bf16"

    @property
    def tier(self) -> Tier:
        return _TIERS[self]

    @property
    def path_id(self) -> int:
        """The `path` argument of the C++ ops (csrc/native.h); the reference has none
        (ValueError)."""
        return path_id(self.tier)


_TIERS = {
    Backend.REFERENCE: Tier.REFERENCE,
    Backend.SCALAR: Tier.PORTABLE,
    Backend.AVX2: Tier.AVX2,
    Backend.AVX512: Tier.AVX512,
    Backend.AVX512_BF16: Tier.AVX512_BF16,
}
FASTEST_FIRST = tuple(sorted(Backend, key=lambda b: b.tier, reverse=True))


def _cpu_only(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and not t.is_cpu:
            raise ValueError(f"mxfp4: the C++ kernels take CPU tensors, got one on {t.device}")


class KernelPath(NativePath[Backend]):
    """One runnable backend: the reference, or a compiled one with the loaded library."""

    def quantize(self, w: torch.Tensor, encoder: Encoder = Encoder.OCP,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """w float [..., K] -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

        The OCP encoder runs on this path; the MSE one (kernels/mxfp4/encoder.py) runs as one
        portable C++ loop on every compiled path (the same bytes), and in torch on the
        reference."""
        check_weight(w)
        if self.library is None:
            return quantize_mse(w) if encoder is Encoder.MSE else reference.quantize(w)
        _cpu_only(w)
        w32 = w.to(torch.float32).contiguous()
        if encoder is Encoder.MSE:
            blocks, scales = self.library.ops.quantize_mse(w32)
        else:
            blocks, scales = self.library.ops.quantize(w32, self.backend.path_id)
        return blocks, scales

    def dequantize(
        self,
        blocks: torch.Tensor,
        scales: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """blocks uint8 [..., G, 16], scales uint8 [..., G] -> dtype [..., G*32].

        With out (a contiguous tensor of that shape; its dtype wins over dtype) the values are
        written there and out is returned: no allocation, for reused buffers.
        """
        check_packed(blocks, scales)
        check_dtype(dtype if out is None else out.dtype)
        if out is not None:
            check_out(out, blocks)
        if self.library is None:
            values = reference.dequantize(blocks, scales, dtype if out is None else out.dtype)
            return values if out is None else out.copy_(values)
        _cpu_only(blocks, scales, out)
        blocks, scales = blocks.contiguous(), scales.contiguous()
        if out is not None and out.dtype in _NATIVE_DTYPES:
            self.library.ops.dequantize_into(blocks, scales, out, self.backend.path_id)
            return out
        native = dtype if out is None and dtype in _NATIVE_DTYPES else torch.float32
        values = self.library.ops.dequantize(blocks, scales, native, self.backend.path_id)
        if out is not None:
            return out.copy_(values)
        return values.to(dtype)  # exact: every MXFP4 value is exact in fp32

    def linear(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        activations: Activations = Activations.FLOAT,
    ) -> torch.Tensor:
        """x [..., K] @ W.T (+ bias), W [N, K] stored as blocks [N, K/32, 16], scales [N, K/32].

        Up to FUSED_MAX_ROWS rows run the fused kernel on the packed bytes (fp32 accumulation);
        more rows dequantise W once and use torch's matmul. The result has x's dtype. INT8
        activations run the int8 kernel for any number of rows (reference.linear_a8).
        """
        check_linear(x, blocks, scales, bias)
        int8 = activations is Activations.INT8
        if self.library is None:
            return (reference.linear_a8 if int8 else reference.linear)(x, blocks, scales, bias)
        _cpu_only(x, blocks, scales, bias)
        # The fast path (2-D, native dtype, contiguous) makes no copies: decode calls are ~10 us.
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.dtype not in _NATIVE_DTYPES:
            x2 = x2.to(torch.float32)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.to(torch.float32).contiguous()
        if x2.shape[0] > FUSED_MAX_ROWS and not int8:
            w = self.dequantize(blocks, scales, x2.dtype)
            y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(x2.dtype))
        else:
            y = self.library.ops.linear(
                x2, blocks.contiguous(), scales.contiguous(), bias,
                activations.op_path(self.backend.path_id)
            )
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], blocks.shape[0])
