"""Compiled dequantisation against the reference, bit for bit, on every code path."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.mxfp4 import KernelPath, reference
from tests.support.mxfp4 import assert_same_bits, every_code_blocks, random_packed

DTYPES = [torch.float32, torch.bfloat16]


def _check(path: KernelPath, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    assert_same_bits(path.dequantize(blocks, scales, dtype), reference.dequantize(blocks, scales, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_at_every_scale(cpp_path: KernelPath, dtype: torch.dtype) -> None:
    blocks, scales = every_code_blocks(list(range(256)))  # 0..254 and 255 (NaN)
    _check(cpp_path, blocks, scales, dtype)
    out = cpp_path.dequantize(blocks, scales, dtype)
    assert torch.isnan(out[255]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("byte", [0x00, 0x88], ids=["zero", "negative_zero"])
def test_zero_blocks(cpp_path: KernelPath, dtype: torch.dtype, byte: int) -> None:
    blocks = torch.full((256, 2, 16), byte, dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.uint8).reshape(-1, 1).repeat(1, 2)
    _check(cpp_path, blocks, scales, dtype)
    out = cpp_path.dequantize(blocks[:255], scales[:255], dtype)
    assert (out == 0).all() and bool(torch.signbit(out).all()) == (byte == 0x88)


@pytest.mark.parametrize("dtype", DTYPES)
def test_overflowing_scales_give_inf(cpp_path: KernelPath, dtype: torch.dtype) -> None:
    blocks, scales = every_code_blocks([252, 253, 254])
    _check(cpp_path, blocks, scales, dtype)
    out = cpp_path.dequantize(blocks, scales, dtype)
    assert torch.isinf(out[1:]).any() and not torch.isinf(out[0]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_subnormal_results(cpp_path: KernelPath, dtype: torch.dtype) -> None:
    blocks, scales = every_code_blocks([0, 1, 2])
    _check(cpp_path, blocks, scales, dtype)
    out = cpp_path.dequantize(blocks, scales, dtype).float()
    tiny = (out != 0) & (out.abs() < torch.finfo(torch.float32).tiny)
    assert tiny[0].any() and tiny[1].any() and not tiny[2].any()
    assert out[0].abs().min().item() == 0 and math.ldexp(1.0, -128) in out[0].abs().tolist()


SHAPES = [(1, 1), (1, 18), (3, 1), (7, 3), (5, 48), (513, 18), (2, 3, 5), (4, 1, 7), (4096, 18)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_tensors(cpp_path: KernelPath, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # (4096, 18) spans several parallel chunks and uses non-temporal stores in fp32.
    blocks, scales = random_packed(shape, seed=sum(shape))
    _check(cpp_path, blocks, scales, dtype)


def test_realistic_scales(cpp_path: KernelPath) -> None:
    blocks, scales = random_packed((64, 18), seed=5, scale_lo=110, scale_hi=135)
    _check(cpp_path, blocks, scales, torch.float32)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16, torch.float64])
def test_into_out_and_other_dtypes(cpp_path: KernelPath, dtype: torch.dtype) -> None:
    blocks, scales = random_packed((9, 4), seed=11)
    out = torch.empty(9, 128, dtype=dtype)
    result = cpp_path.dequantize(blocks, scales, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_same_bits(out, reference.dequantize(blocks, scales, dtype))
    assert_same_bits(cpp_path.dequantize(blocks, scales, dtype), reference.dequantize(blocks, scales, dtype))


def test_non_contiguous_inputs(cpp_path: KernelPath) -> None:
    blocks, scales = random_packed((6, 8), seed=2)
    b, s = blocks[:, ::2], scales[:, ::2]
    _check(cpp_path, b, s, torch.float32)


def test_bad_inputs_raise(cpp_path: KernelPath) -> None:
    blocks, scales = random_packed((2, 3), seed=1)
    with pytest.raises(ValueError):
        cpp_path.dequantize(blocks, scales[:, :2])
    with pytest.raises(TypeError):
        cpp_path.dequantize(blocks.int(), scales)
    with pytest.raises(ValueError):
        cpp_path.dequantize(blocks, scales, out=torch.empty(2, 95))
