"""The MXFP4 format (OCP Microscaling v1.0, as in gpt-oss checkpoints): constants and input checks.

Elements are FP4 E2M1 (sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4,
6); 32 consecutive elements share one E8M0 scale byte s meaning 2^(s-127), with s == 255 NaN.
Byte i of a block's 16 bytes holds element 2i in its low nibble and 2i+1 in its high nibble.
A tensor [..., K] is stored as blocks uint8 [..., K/32, 16] and scales uint8 [..., K/32].
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32  # elements sharing one scale
BLOCK_BYTES = 16  # packed bytes per block
SCALE_BIAS = 127  # E8M0 exponent bias
NAN_SCALE = 255  # E8M0 NaN encoding
EMAX_ELEM = 2  # exponent of E2M1's largest normal (6 = 1.5 * 2^2)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_weight(w: torch.Tensor) -> None:
    """Raise unless w is a floating tensor [..., K] with K a multiple of 32."""
    if not isinstance(w, torch.Tensor) or w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"mxfp4: expected a float tensor, got {_describe(w)}")
    if w.dim() < 1 or w.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"mxfp4: last dim must be a multiple of {BLOCK_SIZE}, got {tuple(w.shape)}")


def check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise unless blocks is uint8 [..., G, 16] and scales uint8 [..., G]."""
    for name, t in (("blocks", blocks), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise TypeError(f"mxfp4: {name} must be a uint8 tensor, got {_describe(t)}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: blocks must be [..., G, {BLOCK_BYTES}] and scales [..., G]; "
            f"got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"mxfp4: unsupported output dtype {dtype}")


def check_out(out: torch.Tensor, blocks: torch.Tensor) -> None:
    """Raise unless out can receive the dequantised blocks: [..., G*32], contiguous."""
    expected = (*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE)
    if tuple(out.shape) != expected or not out.is_contiguous():
        raise ValueError(f"mxfp4: out must be a contiguous {expected} tensor, got {tuple(out.shape)}")


def check_linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Raise unless x [..., K] matches a weight stored as blocks [N, K/32, 16], scales [N, K/32]."""
    check_packed(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"mxfp4: linear weight blocks must be [N, K/32, 16], got {tuple(blocks.shape)}")
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"mxfp4: x must be a float tensor, got {_describe(x)}")
    in_features = blocks.shape[1] * BLOCK_SIZE
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"mxfp4: x {tuple(x.shape)} does not match in_features={in_features}")
    if bias is not None and tuple(bias.shape) != (blocks.shape[0],):
        raise ValueError(f"mxfp4: bias must be [{blocks.shape[0]}], got {tuple(bias.shape)}")


def _describe(t: object) -> str:
    return f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
