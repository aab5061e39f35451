"""Plain-torch MXFP4 reference: the oracle every compiled path is tested against, bit for bit.

Everything is computed in float64, where each MXFP4 value (<= 2 significant bits times a power of
two in [2^-127, 2^127]) is exact, and rounded once to the output dtype; so a value that
overflows fp32 (6 * 2^127) becomes inf, and tiny ones become exact fp32/bf16 subnormals.

Quantisation (OCP MX v1.0, section 6.3): the block's shared exponent is
floor(log2(amax)) - emax_elem (emax_elem = 2 for E2M1), clamped to E8M0's minimum -127 (an
all-zero block gets -127, the limit of log2(0) = -inf); elements are divided by 2^shared, rounded
to the nearest E2M1 value with ties to the even code, and saturated to +-6. The sign bit is kept,
so -0.0 and negative values that round to zero get the negative-zero code 8. A block holding
Inf or NaN gets scale 255 (NaN) and zero codes. Inputs are first rounded to float32, as the
compiled paths take float32.
"""

from __future__ import annotations

import math

import torch

from kernels.mxfp4.format import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    E2M1_MAGNITUDES,
    EMAX_ELEM,
    NAN_SCALE,
    SCALE_BIAS,
    check_dtype,
    check_linear,
    check_packed,
    check_weight,
)


def e2m1_values() -> torch.Tensor:
    """float64 [16]: the value of every E2M1 code; code 8 is -0.0."""
    return torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)], dtype=torch.float64)


def e8m0_values() -> torch.Tensor:
    """float64 [256]: 2^(s-127) for every scale byte s, NaN for 255 (math.ldexp is exact)."""
    return torch.tensor(
        [math.ldexp(1.0, s - SCALE_BIAS) for s in range(NAN_SCALE)] + [math.nan], dtype=torch.float64
    )


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> dtype [..., G*32]."""
    check_packed(blocks, scales)
    check_dtype(dtype)
    e2m1, byte = e2m1_values(), torch.arange(256)
    pairs = torch.stack((e2m1[byte & 15], e2m1[byte >> 4]), dim=-1)  # byte -> (element 2i, 2i+1)
    values = pairs[blocks.int()].flatten(-2) * e8m0_values()[scales.int()].unsqueeze(-1)
    return values.flatten(-2).to(dtype)  # [..., G, 32] -> [..., G*32]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., K] -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])."""
    check_weight(w)
    v = as_blocks(w)
    return encode(v, ocp_exponent(v))


def as_blocks(w: torch.Tensor) -> torch.Tensor:
    """w float [..., K] -> float64 [..., K/32, 32], rounded through float32 first."""
    return w.to(torch.float32).to(torch.float64).unflatten(-1, (-1, BLOCK_SIZE))


def ocp_exponent(v: torch.Tensor) -> torch.Tensor:
    """v float64 [..., G, 32] -> int64 [..., G]: floor(log2(amax)) - emax_elem, clamped to
    -127 (an all-zero block gets -127); arbitrary (0) for a non-finite block."""
    amax = v.abs().amax(-1)  # NaN propagates
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = torch.where(amax > 0, exp - 1 - EMAX_ELEM, -SCALE_BIAS).clamp(min=-SCALE_BIAS)
    return torch.where(torch.isfinite(amax), shared, 0)


def pow2(shared: torch.Tensor) -> torch.Tensor:
    """int64 exponents in [-127, 127] -> float64 2^shared (exact)."""
    table = torch.tensor([math.ldexp(1.0, e) for e in range(-SCALE_BIAS, SCALE_BIAS + 1)],
                         dtype=torch.float64)
    return table[shared + SCALE_BIAS]


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Non-negative float64 magnitudes (not NaN) -> int64 codes 0..7 of the nearest E2M1 value,
    ties to the even code, saturating at 6 (code 7).

    Below 1 the grid is 0, 0.5, 1 (codes 0..2): round(2a), which rounds half to even. From 1 up
    E2M1 is a float with one mantissa bit, and code = 2 + 2 * exponent + mantissa: rounding the
    float64 bits to one mantissa bit (add half an ulp minus one, plus the kept bit: ties to
    even) gives (biased exponent, mantissa) in the bits above 51, and a carry moves to the next
    exponent by itself. Equal to counting the midpoints below a (the strict ones for even
    codes), at a fraction of the passes.
    """
    bits = scaled.view(torch.int64)
    rounded = (bits + ((1 << 50) - 1) + ((bits >> 51) & 1)) >> 51  # (1023 + exponent) * 2 + m
    high = (rounded - (2 * 1023 - 2)).clamp_(max=7)
    return torch.where(scaled < 1, torch.round(scaled * 2).long(), high)


def encode(v: torch.Tensor, shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v float64 [..., G, 32] with a chosen shared exponent int64 [..., G] in [-127, 127] ->
    (blocks, scales): elements rounded to nearest-even E2M1 after dividing by 2^shared; a
    block holding Inf or NaN gets scale 255 and zero codes whatever shared says."""
    finite = torch.isfinite(v).all(-1)
    shared = torch.where(finite, shared, 0)
    codes = e2m1_codes(v.abs() / pow2(shared).unsqueeze(-1))
    codes |= torch.signbit(v).long() << 3
    codes = torch.where(finite.unsqueeze(-1), codes, 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = torch.where(finite, shared + SCALE_BIAS, NAN_SCALE).to(torch.uint8)
    assert blocks.shape[-1] == BLOCK_BYTES
    return blocks, scales


def linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) with W [N, K] dequantised to fp32; fp32 matmul, result in x.dtype."""
    check_linear(x, blocks, scales, bias)
    y = x.to(torch.float32) @ dequantize(blocks, scales, torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


# ---- Int8 activations (W4A8): the oracle of the kernels' `activations=INT8` mode ---------------
A8_MAX = 127  # |q| bound: d = amax / 127


def quantize_x_a8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., K] -> (q int8 [..., K], d float32 [..., K/32]), natural element order.

    Per 32-block, in float32 as the kernels compute it (every step one IEEE rounding):
    d = amax / 127, q = round_half_even(x * (1 / d)). An all-zero block gets d = 0, q = 0; a
    block holding Inf or NaN gets d = NaN, q = 0, so every output reading it is NaN."""
    v = x.to(torch.float32).unflatten(-1, (-1, BLOCK_SIZE))
    amax = v.abs().amax(-1)  # NaN propagates
    finite = torch.isfinite(amax)
    live = finite & (amax > 0)
    d = torch.where(finite, amax / A8_MAX, torch.nan)
    inv = torch.where(live, 1.0 / torch.where(live, d, 1.0), 0.0)
    q = torch.round(torch.where(live.unsqueeze(-1), v, 0.0) * inv.unsqueeze(-1))
    return q.to(torch.int8).flatten(-2), d


def linear_a8(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) with x quantised by quantize_x_a8: float64 sums of the exact
    products q * w * d (the kernels sum the same terms in fp32). The result is float64 for
    float64 x, else rounded to fp32 and then to x.dtype, as the kernels round theirs."""
    check_linear(x, blocks, scales, bias)
    q, d = quantize_x_a8(x)
    xq = (q.to(torch.float64).unflatten(-1, (-1, BLOCK_SIZE)) * d.to(torch.float64).unsqueeze(-1))
    y = xq.flatten(-2) @ dequantize(blocks, scales, torch.float64).T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y if x.dtype == torch.float64 else y.to(torch.float32).to(x.dtype)
