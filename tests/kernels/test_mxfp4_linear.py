"""Fused linear against reference dequantisation + fp32 matmul, within fp32 accumulation error."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from kernels.mxfp4 import KernelPath, reference
from tests.support.mxfp4 import random_packed

SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out)
BATCHES = [1, 2, 7, 16, 32]
EPS32 = 2.0**-24


@cache
def _weights(in_f: int, out_f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed W [out_f, in_f] with realistic scales, and W in float64 (shared per shape)."""
    shape = (out_f, in_f // 32)
    blocks, scales = random_packed(shape, seed=in_f + out_f, scale_lo=118, scale_hi=124)
    return blocks, scales, reference.dequantize(blocks, scales, torch.float64)


def _assert_close(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None
                  ) -> None:
    """y within (K + 2) eps32 sum|x w| of the float64 product: the fp32 accumulation error bound
    (bf16 outputs add their own rounding)."""
    x64 = x.double().reshape(-1, x.shape[-1])
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    bound = (x.shape[-1] + 2) * EPS32 * (x64.abs() @ w64.abs().T) + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8
    err = (y.double().reshape(exact.shape) - exact).abs()
    assert (err <= bound).all(), f"error {(err / bound).max().item():.3g}x the fp32 bound"


def _run(path: KernelPath, x: torch.Tensor, in_f: int, out_f: int, bias: torch.Tensor | None
         ) -> torch.Tensor:
    blocks, scales, w64 = _weights(in_f, out_f)
    y = path.linear(x, blocks, scales, bias)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], out_f)
    _assert_close(y, x, w64, bias)
    return y


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", SMOLLM2_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_oracle_meets_the_same_bound(shape: tuple[int, int], batch: int) -> None:
    """The kernels are held to the bound the reference (dequantise + fp32 matmul) meets."""
    blocks, scales, w64 = _weights(*shape)
    x = torch.randn(batch, shape[0], generator=torch.Generator().manual_seed(batch))
    bias = torch.randn(shape[1]) if batch % 2 else None
    _assert_close(reference.linear(x, blocks, scales, bias), x, w64, bias)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", SMOLLM2_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_smollm2_shapes(cpp_path: KernelPath, shape: tuple[int, int], batch: int) -> None:
    x = torch.randn(batch, shape[0], generator=torch.Generator().manual_seed(batch))
    bias = torch.randn(shape[1]) if batch % 2 else None
    _run(cpp_path, x, *shape, bias)


@pytest.mark.parametrize("batch", [1, 3, 16, 32])
def test_bf16_activations(cpp_path: KernelPath, batch: int) -> None:
    _run(cpp_path, torch.randn(batch, 576).bfloat16(), 576, 1536, torch.randn(1536))


@pytest.mark.parametrize("rows,out_f", [(1, 1), (5, 3), (9, 13), (33, 7), (70, 21), (0, 8)])
def test_odd_sizes_and_the_unfused_path(cpp_path: KernelPath, rows: int, out_f: int) -> None:
    # rows > 32 dequantise once and use torch's matmul.
    _run(cpp_path, torch.randn(rows, 96), 96, out_f, torch.randn(out_f))


def test_leading_dims_and_strided_x(cpp_path: KernelPath) -> None:
    _run(cpp_path, torch.randn(2, 3, 128)[..., ::2], 64, 40, None)


def test_non_finite_weights_propagate(cpp_path: KernelPath) -> None:
    blocks, scales, _ = _weights(64, 8)
    blocks, scales = blocks.clone(), scales.clone()
    scales[3, 1] = 255  # a NaN block
    scales[5, 0] = 254  # 6 * 2^127 overflows to inf
    blocks[5, 0] = 0x77
    x = torch.ones(2, 64)
    y = cpp_path.linear(x, blocks, scales)
    expected = reference.linear(x, blocks, scales)
    assert torch.equal(torch.isnan(y), torch.isnan(expected)) and torch.isnan(y[:, 3]).all()
    assert torch.isinf(y[:, 5]).all() and torch.isinf(expected[:, 5]).all()


def test_shape_mismatch_raises(cpp_path: KernelPath) -> None:
    blocks, scales, _ = _weights(64, 8)
    with pytest.raises(ValueError):
        cpp_path.linear(torch.randn(2, 96), blocks, scales)
    with pytest.raises(ValueError):
        cpp_path.linear(torch.randn(2, 64), blocks, scales, torch.zeros(9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 32])
def test_thread_count_does_not_change_results(cpp_path: KernelPath, dtype: torch.dtype,
                                              batch: int) -> None:
    # Threads split output columns (this shape gives several chunks at every batch); each
    # column's summation order is fixed, so the bits match.
    blocks, scales, w64 = _weights(576, 1536)
    x = torch.randn(batch, 576, generator=torch.Generator().manual_seed(batch)).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpp_path.linear(x, blocks, scales)
        torch.set_num_threads(2)
        two = cpp_path.linear(x, blocks, scales)
    finally:
        torch.set_num_threads(before)
    _assert_close(one, x, w64, None)
    assert torch.equal(one.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       two.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
