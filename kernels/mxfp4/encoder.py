"""MXFP4 encoders: how a block's shared exponent is chosen (the stored format never changes).

OCP MX v1.0 fixes the shared exponent at floor(log2(amax)) - 2, so amax / 2^shared lies in
[4, 8): a block whose amax lands in (6, 8) after scaling saturates its largest elements to 6,
and one just above 4 leaves the top code unused. The MSE encoder tries the OCP exponent and its
neighbours (MSE_OFFSETS) for every block at once and keeps the one whose round-to-nearest-even
E2M1 encoding has the smallest squared error against the block; ties keep the OCP exponent, so
its error is never larger than OCP's, block by block. Decoding is unchanged: any scale byte
is a valid E8M0 scale, and the compiled kernels decode it bit for bit like the reference.

Everything runs in float64 (exact for |v| / 2^shared and for every E2M1 value times its scale),
over chunks of blocks to bound the temporaries; there is no per-block Python loop. This is the
oracle: a compiled path runs the same search in C++ (csrc/scalar.cpp, ~50x faster; an MXFP4
worker quantises SmolLM2-135M at start-up in about a second instead of a minute), and the
tests hold the two equal byte for byte.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from kernels.mxfp4 import reference
from kernels.mxfp4.format import E2M1_MAGNITUDES, SCALE_BIAS, check_weight

# Exponent offsets from the OCP one, tried in this order (argmin keeps the first of equal
# errors, so OCP wins ties). +1 undoes the saturation of amax in (6, 8) * 2^shared; -1 gives the
# small elements finer steps at the cost of clipping the largest (it wins on blocks with one
# outlier). +2 cannot beat +1: its grid points up to amax (0, 2, 4, 6 times 2^shared) are all
# on +1's grid. -2 clips amax (>= 4 * 2^shared) to 1.5 * 2^shared; on SmolLM2-135M's decoder
# weights it is never chosen (offsets -1, 0, +1: 75, 2772214, 545471 blocks).
MSE_OFFSETS = (0, 1, -1)
_CHUNK_BLOCKS = 1 << 15  # blocks per chunk: 32K * 32 float64 = 8 MiB per temporary


class Encoder(StrEnum):
    """How the shared exponent of each 32-element block is picked."""

    OCP = "ocp"  # OCP MX v1.0's rule, floor(log2(amax)) - 2 (the compiled quantize ops)
    MSE = "mse"  # the offset in MSE_OFFSETS with the least squared error per block


def block_sq_error(v: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """v float64 [..., G, 32], shared int64 [..., G] -> float64 [..., G]: sum over the block of
    (decoded - v)^2 when encoded with that exponent (round to nearest even, saturating)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    scale = reference.pow2(shared).unsqueeze(-1)
    decoded = magnitudes[reference.e2m1_codes(v.abs() / scale)] * scale
    squares = (decoded - v.abs()).square()
    # Summed in element order 0..31, not by torch's reduction order: the compiled encoder
    # (csrc/scalar.cpp quantize_mse_blocks) adds in the same order, so the two round every
    # partial sum alike and pick the same exponent on near ties.
    total = squares[..., 0].clone()
    for i in range(1, squares.shape[-1]):
        total += squares[..., i]
    return total


def mse_exponent(v: torch.Tensor, offsets: tuple[int, ...] = MSE_OFFSETS) -> torch.Tensor:
    """v float64 [B, 32] (finite or not) -> int64 [B]: per block, the OCP exponent plus the
    offset of least squared error, clamped to E8M0's range [-127, 127]."""
    ocp = reference.ocp_exponent(v)
    if not offsets or offsets[0] != 0:
        raise ValueError(f"offsets must start with 0 (the OCP exponent), got {offsets}")
    candidates = torch.stack([(ocp + d).clamp(-SCALE_BIAS, SCALE_BIAS) for d in offsets])
    v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)  # non-finite blocks: NaN scale
    errors = torch.stack([block_sq_error(v, c) for c in candidates])  # [len(offsets), B]
    best = errors.argmin(0, keepdim=True)  # first minimum: OCP on ties
    return candidates.gather(0, best).squeeze(0)


def quantize_mse(w: torch.Tensor, offsets: tuple[int, ...] = MSE_OFFSETS,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8
    [..., K/32]) with each block's exponent chosen by mse_exponent."""
    check_weight(w)
    v = w.detach().to(torch.float32).reshape(-1, 32)  # [B, 32], B = numel / 32
    blocks = torch.empty(v.shape[0], 16, dtype=torch.uint8)
    scales = torch.empty(v.shape[0], dtype=torch.uint8)
    for lo in range(0, v.shape[0], _CHUNK_BLOCKS):
        chunk = v[lo:lo + _CHUNK_BLOCKS].to(torch.float64)
        blocks[lo:lo + _CHUNK_BLOCKS], scales[lo:lo + _CHUNK_BLOCKS] = reference.encode(
            chunk, mse_exponent(chunk, offsets))
    groups = w.shape[-1] // 32
    return blocks.reshape(*w.shape[:-1], groups, 16), scales.reshape(*w.shape[:-1], groups)

