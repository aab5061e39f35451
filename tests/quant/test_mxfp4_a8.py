"""Int8 activations (W4A8) in the MXFP4 linear: every compiled path against the plain-torch
oracle (kernels/mxfp4/reference.py quantize_x_a8 / linear_a8).

The activation quantisation is checked bit for bit through the op itself: with a weight whose
row n holds 1.0 at input i and zeros elsewhere, output n is q_i * d exactly (the kernel's
integer dot 2 q_i times d * 2^-1 rounds once, as the oracle's product does). The products are
checked against float64 sums of the exact terms, within fp32 accumulation error.
"""

from __future__ import annotations

import pytest
import torch

from kernels import mxfp4
from kernels.mxfp4 import reference
from shared.config import QUANT_ACTIVATION_CHOICES, EngineConfig

INT8 = mxfp4.Activations.INT8
COMPILED = [b for b in mxfp4.available_backends() if b != "reference"]
BACKENDS = [*COMPILED, "reference"]


def probe_weight(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [k, k] = identity, packed: output n reads input n alone (code 2 = 1.0, scale 2^0)."""
    return mxfp4.quantize(torch.eye(k), backend="reference")


def edge_rows(k: int = 128) -> torch.Tensor:
    """x [6, k]: ordinary blocks, exact ties of x / d, an all-zero block, tiny and huge values,
    and blocks holding Inf / NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, k, generator=g) * 3
    x[1, 31] = 127.0  # d = 1: -7.5 .. 7.5 by halves are exact ties, rounded to even
    x[1, :31] = torch.arange(31, dtype=torch.float32) * 0.5 - 7.5
    x[2, 32:64] = 0.0
    x[3, :32] *= 1e-30
    x[3, 32:64] *= 1e30
    x[4, 5] = float("inf")
    x[5, 40] = float("nan")
    return x


def test_activation_choices_match_the_config() -> None:
    assert tuple(a.value for a in mxfp4.Activations) == QUANT_ACTIVATION_CHOICES


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantised_activations_are_the_oracles_bit_for_bit(backend: str, dtype: torch.dtype
                                                           ) -> None:
    x = edge_rows().to(dtype)
    blocks, scales = probe_weight(x.shape[1])
    y = mxfp4.linear(x.float() if dtype == torch.float32 else x, blocks, scales,
                     backend=backend, activations=INT8).float()
    q, d = reference.quantize_x_a8(x)
    want = (q.double().unflatten(-1, (-1, 32)) * d.double().unsqueeze(-1)).flatten(-2).float()
    # A block holding Inf or NaN has d = NaN, and NaN times a zero weight is NaN: its whole row
    # is NaN, as Inf or NaN times zero weights makes the float kernels' row.
    assert torch.isnan(y[4:]).all() and torch.isnan(d[4:]).sum() == 2
    want = want.to(dtype).float()  # bf16 x gives a bf16 result: one more rounding on both sides
    assert not torch.isnan(y[:4]).any()
    assert torch.equal(y[:4], want[:4])
    # The ties rounded to even: -7.5 .. 7.5 by halves against d = 1.
    assert q[1, :31].tolist() == torch.round(torch.arange(31) * 0.5 - 7.5).int().tolist()
    assert (q.abs() <= reference.A8_MAX).all() and (d[2, 1] == 0) and (q[2, 32:64] == 0).all()


def _bound(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Sum of |terms| per output: the scale of fp32 accumulation error."""
    q, d = reference.quantize_x_a8(x)
    xq = (q.double().unflatten(-1, (-1, 32)) * d.double().unsqueeze(-1)).flatten(-2)
    return xq.abs() @ reference.dequantize(blocks, scales, torch.float64).abs().T


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("m, k, n", [(1, 576, 100), (3, 1536, 37), (4, 64, 16), (7, 96, 9),
                                     (33, 64, 21)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_the_float64_oracle(backend: str, m: int, k: int, n: int, bias: bool
                                           ) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g)
    w[0] *= 1e-36  # tiny scales: fp32 subnormal block scales 2^-128 .. 2^-126
    blocks, scales = mxfp4.quantize(w, backend="reference")
    x = torch.randn(m, k, generator=g) * 4
    b = torch.randn(n, generator=g) if bias else None
    y = mxfp4.linear(x, blocks, scales, b, backend=backend, activations=INT8)
    want = reference.linear_a8(x.double(), blocks, scales, None if b is None else b.double())
    slack = _bound(x, blocks, scales) * 2.0**-20 + (0 if b is None else b.abs().double() * 2**-23)
    assert ((y.double() - want).abs() <= slack).all()
    # The oracle differs from float activations: the mode is not a no-op.
    assert not torch.equal(y, mxfp4.linear(x, blocks, scales, b, backend=backend))


@pytest.mark.parametrize("backend", COMPILED)
def test_scale_bytes_at_the_edges(backend: str) -> None:
    """Scale bytes 0, 1 (2^-128 and 2^-127 after the table's factor 2: fp32 subnormals), a
    large one (2^117) and 255 (NaN, the whole column) decode as the oracle's 2^(s-127)."""
    k, n = 64, 4
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.tensor([[0, 1], [1, 0], [200, 245], [255, 127]], dtype=torch.uint8)
    x = torch.randn(2, k, generator=g)
    y = mxfp4.linear(x, blocks, scales, backend=backend, activations=INT8)
    want = reference.linear_a8(x.double(), blocks, scales)
    assert torch.isnan(y[:, 3]).all() and torch.isnan(want[:, 3]).all()
    assert torch.isfinite(y[:, :3]).all()
    # d * 2^(s-128) is an fp32 subnormal for s <= 1: rounded to 2^-149, times an integer dot of
    # at most 32 * 12 * 127 < 2^16, each block term may be off by 2^-133
    assert torch.allclose(y[:, :3].double(), want[:, :3], rtol=1e-5, atol=2.0**-130)


@pytest.mark.parametrize("backend", COMPILED)
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(backend: str) -> None:
    g = torch.Generator().manual_seed(5)
    blocks, scales = mxfp4.quantize(torch.randn(300, 576, generator=g), backend="reference")
    x = torch.randn(9, 576, generator=g).to(torch.bfloat16)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([mxfp4.linear(x[i:i + 1], blocks, scales, backend=backend,
                                        activations=INT8) for i in range(9)])
        torch.set_num_threads(2)
        batch = mxfp4.linear(x, blocks, scales, backend=backend, activations=INT8)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(alone, batch)


def test_engine_config_refuses_bad_activation_settings() -> None:
    with pytest.raises(ValueError, match="quant_activations must be one of"):
        EngineConfig(quantization="mxfp4", quant_activations="int4")
    with pytest.raises(ValueError, match="needs quantization"):
        EngineConfig(quant_activations="int8")
