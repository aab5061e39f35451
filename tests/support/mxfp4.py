"""Exact comparisons and test data for the MXFP4 kernel tests."""

from __future__ import annotations

import torch

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float64: torch.int64}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype and shape, NaN at the same positions, identical bit patterns everywhere else."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"NaN positions differ at {torch.nonzero(nan_a != nan_e)[:8]}"
    view = _INT_VIEW[actual.dtype]
    bits_a = actual.contiguous().view(view)[~nan_a]
    bits_e = expected.contiguous().view(view)[~nan_e]
    if not torch.equal(bits_a, bits_e):
        bad = torch.nonzero(bits_a != bits_e)[:8].flatten()
        raise AssertionError(
            f"bits differ at {bad.tolist()}: {actual[~nan_a][bad].tolist()} vs "
            f"{expected[~nan_e][bad].tolist()}"
        )


def every_code_blocks(scales: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One block per scale holding all 16 codes in both nibble positions: [S, 1, 16], [S, 1]."""
    codes = torch.arange(16, dtype=torch.uint8)
    block = codes | (codes.flip(0) << 4)
    blocks = block.repeat(len(scales), 1).reshape(len(scales), 1, 16)
    return blocks, torch.tensor(scales, dtype=torch.uint8).reshape(-1, 1)


def random_packed(shape: tuple[int, ...], seed: int, scale_lo: int = 0, scale_hi: int = 256,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks uint8 [*shape, 16] and scales uint8 [*shape] in [scale_lo, scale_hi)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(scale_lo, scale_hi, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def random_weights(shape: tuple[int, ...], seed: int, spread: int = 20) -> torch.Tensor:
    """Normal values with a random power-of-two magnitude per 32-block (exponents +-spread)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    exps = torch.randint(-spread, spread + 1, (*shape[:-1], shape[-1] // 32, 1), generator=g)
    return (w.unflatten(-1, (-1, 32)) * torch.exp2(exps.float())).flatten(-2)
