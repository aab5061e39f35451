"""The plain-torch oracle against first principles: the OCP tables, brute-force rounding."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.mxfp4 import reference
from tests.support.mxfp4 import assert_same_bits, every_code_blocks, random_weights

OCP_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _python_value(code: int, scale: int) -> float:
    """One element from the OCP definitions, in Python floats (exact in double)."""
    if scale == 255:
        return math.nan
    e, m = (code >> 1) & 3, code & 1
    magnitude = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return (-1.0 if code & 8 else 1.0) * magnitude * 2.0 ** (scale - 127)


def test_e2m1_table_is_the_ocp_table() -> None:
    values = reference.e2m1_values()
    assert values[:8].tolist() == OCP_E2M1
    assert values[8:].tolist() == [-v for v in OCP_E2M1]
    assert math.copysign(1.0, values[8].item()) == -1.0  # code 8 is -0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_the_definition(dtype: torch.dtype) -> None:
    blocks, scales = every_code_blocks(list(range(256)))
    expected = []
    for s in range(256):
        row = blocks[s, 0].tolist()
        codes = [c for b in row for c in (b & 15, b >> 4)]
        expected.append([_python_value(c, s) for c in codes])
    want = torch.tensor(expected, dtype=torch.float64).to(dtype)
    assert_same_bits(reference.dequantize(blocks, scales, dtype), want)


def test_overflow_and_subnormals_follow_ieee() -> None:
    blocks, scales = every_code_blocks([0, 254])
    out = reference.dequantize(blocks, scales)
    codes = [c for b in blocks[0, 0].tolist() for c in (b & 15, b >> 4)]
    six = codes.index(7)
    assert out[1, six] == math.inf and out[1, codes.index(15)] == -math.inf
    half = codes.index(1)
    assert out[0, half].item() == math.ldexp(1.0, -128)  # an fp32 subnormal, exact


def _brute_force_code(value: float, scale_exp: int) -> int:
    """Nearest E2M1 magnitude to |value| / 2^scale_exp, ties to the even code, saturating."""
    a = abs(value) / 2.0**scale_exp
    best = min(range(8), key=lambda c: (abs(OCP_E2M1[c] - a), c & 1))
    return best | (8 if math.copysign(1.0, value) < 0 else 0)


def test_quantize_follows_the_ocp_recipe() -> None:
    w = random_weights((24, 64), seed=3)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4) * 2.0**-3
    ties[0], ties[1] = 6.0 * 2.0**-3, -0.0  # the block maximum pins the scale
    w[0, :32] = ties
    blocks, scales = reference.quantize(w)
    for row in range(w.shape[0]):
        for g in range(w.shape[1] // 32):
            vals = w[row, 32 * g : 32 * g + 32].tolist()
            amax = max(abs(v) for v in vals)
            exp = math.frexp(amax)[1] - 1 - 2 if amax > 0 else -127
            exp = max(exp, -127)
            assert scales[row, g].item() == exp + 127
            packed = blocks[row, g].tolist()
            got = [c for b in packed for c in (b & 15, b >> 4)]
            assert got == [_brute_force_code(v, exp) for v in vals]


def test_quantize_special_blocks() -> None:
    w = torch.zeros(4, 32)
    w[1] = -0.0
    w[2, 5] = math.nan
    w[3, 9] = -math.inf
    blocks, scales = reference.quantize(w)
    assert scales.flatten().tolist() == [0, 0, 255, 255]
    assert blocks[0].flatten().tolist() == [0] * 16
    assert blocks[1].flatten().tolist() == [0x88] * 16
    assert blocks[2:].flatten().tolist() == [0] * 32
