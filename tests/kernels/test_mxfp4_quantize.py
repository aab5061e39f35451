"""Compiled quantisation: equal to the reference, and exact round trips of representable values."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.mxfp4 import KernelPath, reference
from tests.support.mxfp4 import assert_same_bits, every_code_blocks, random_weights


def _check(path: KernelPath, w: torch.Tensor) -> None:
    blocks, scales = path.quantize(w)
    ref_blocks, ref_scales = reference.quantize(w)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(blocks, ref_blocks)


@pytest.mark.parametrize("shape", [(32,), (1, 32), (3, 96), (7, 576), (2, 5, 64), (65, 1536)], ids=str)
def test_random_weights(cpp_path: KernelPath, shape: tuple[int, ...]) -> None:
    _check(cpp_path, random_weights(shape, seed=len(shape) + shape[-1]))


def test_wide_exponent_range(cpp_path: KernelPath) -> None:
    # Block exponents from fp32 subnormals to near fp32 max: clamped and unclamped scales.
    _check(cpp_path, random_weights((40, 256), seed=9, spread=127))


def test_special_values(cpp_path: KernelPath) -> None:
    tiny = torch.finfo(torch.float32).tiny
    w = random_weights((12, 64), seed=4)
    w[0, 3] = math.nan
    w[1, 40] = math.inf
    w[2, 7] = -math.inf
    w[3, :32] = 0.0
    w[4, :32] = -0.0
    w[5, :32] = torch.linspace(-1, 1, 32) * tiny * 0.25  # subnormals only
    w[6, :32] = torch.finfo(torch.float32).max
    w[7, :32] = -torch.finfo(torch.float32).max * torch.rand(32)
    w[8, 5] = -1e-30  # rounds to the negative-zero code
    _check(cpp_path, w)


def test_exact_ties_round_to_even(cpp_path: KernelPath) -> None:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    rows = []
    for exp in (-130, -100, -3, 0, 17, 120):
        row = torch.cat([mids, -mids, mids * 0.999, mids * 1.001]) * 2.0**exp
        row[0] = 6.0 * 2.0**exp  # pin the block maximum
        rows.append(row)
    _check(cpp_path, torch.stack(rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_input_dtypes(cpp_path: KernelPath, dtype: torch.dtype) -> None:
    _check(cpp_path, random_weights((5, 128), seed=6, spread=4).to(dtype))


def test_every_representable_value_round_trips(cpp_path: KernelPath) -> None:
    # Scales 253 and 254 need a block maximum >= 2^128: no fp32 input selects them.
    blocks, scales = every_code_blocks(list(range(253)))
    values = reference.dequantize(blocks, scales)
    got_blocks, got_scales = cpp_path.quantize(values)
    assert torch.equal(got_scales, scales)
    assert torch.equal(got_blocks, blocks)
    assert_same_bits(cpp_path.dequantize(got_blocks, got_scales), values)


def test_dequantized_values_are_fixed_points(cpp_path: KernelPath) -> None:
    w = random_weights((33, 192), seed=8, spread=60)
    once = cpp_path.dequantize(*cpp_path.quantize(w))
    twice = cpp_path.dequantize(*cpp_path.quantize(once))
    assert_same_bits(twice, once)


def test_bad_inputs_raise(cpp_path: KernelPath) -> None:
    with pytest.raises(ValueError):
        cpp_path.quantize(torch.zeros(4, 48))
    with pytest.raises(TypeError):
        cpp_path.quantize(torch.zeros(4, 32, dtype=torch.int32))
