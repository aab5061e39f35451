"""The MSE encoder: per block never worse than OCP's rule, the best of its candidate exponents
(a brute-force oracle), and its bytes decode like any MXFP4 bytes on every compiled path."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import mxfp4
from kernels.mxfp4 import KernelPath, reference
from kernels.mxfp4.encoder import MSE_OFFSETS, Encoder, quantize_mse
from shared.config import QUANT_ENCODER_CHOICES
from tests.support.mxfp4 import assert_same_bits, random_weights

OCP_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _heavy_tailed(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Student-t (3 dof) values with a few large outliers, like trained LLM weights."""
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(3.0).sample(shape)  # uses the global generator
    spikes = torch.rand(shape, generator=g) < 0.002
    return torch.where(spikes, t * 20, t) * 0.02


def _block_errors(w: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., G]: the squared error of each block after decoding (the reference)."""
    decoded = reference.dequantize(blocks, scales, torch.float64)
    diff = decoded - w.to(torch.float32).to(torch.float64)
    return diff.unflatten(-1, (-1, 32)).square().sum(-1)


@pytest.mark.parametrize("kind", ["normal", "spread", "heavy_tailed", "bf16"])
def test_never_worse_than_ocp_per_block(kind: str) -> None:
    torch.manual_seed(0)
    w = {"normal": lambda: torch.randn(96, 576),
         "spread": lambda: random_weights((64, 256), seed=2, spread=30),
         "heavy_tailed": lambda: _heavy_tailed((96, 576), seed=1),
         "bf16": lambda: _heavy_tailed((64, 256), seed=3).bfloat16()}[kind]()
    ocp = _block_errors(w, *reference.quantize(w))
    mse = _block_errors(w, *mxfp4.quantize(w, encoder=Encoder.MSE))
    assert (mse <= ocp * (1 + 1e-12)).all()
    assert (mse < ocp).float().mean() > 0.05  # and it does pick other exponents


def _brute_force_scale(block: list[float]) -> int:
    """The scale byte the MSE encoder must pick: OCP's exponent plus the offset of least squared
    error (per element nearest E2M1, saturating), the earliest offset on ties."""
    amax = max(abs(v) for v in block)
    ocp = max(math.frexp(amax)[1] - 1 - 2, -127) if amax > 0 else -127
    best: tuple[float, int] | None = None
    for d in MSE_OFFSETS:
        e = min(max(ocp + d, -127), 127)
        err = sum((min(OCP_E2M1, key=lambda m: abs(m - abs(v) / 2.0**e)) * 2.0**e - abs(v)) ** 2
                  for v in block)
        if best is None or err < best[0]:
            best = (err, e)
    assert best is not None
    return best[1] + 127


def test_scales_match_a_brute_force_search() -> None:
    torch.manual_seed(4)
    w = torch.cat([_heavy_tailed((4, 128), seed=5), random_weights((4, 128), seed=6)])
    w[0, :32] = torch.tensor([4.0] + [0.25] * 31)  # one outlier: the lower exponent wins
    w[1, :32] = torch.linspace(-7.5, 7.5, 32)  # amax in (6, 8) * 2^e: the next exponent wins
    blocks, scales = quantize_mse(w)
    for row in range(w.shape[0]):
        for g in range(w.shape[1] // 32):
            assert scales[row, g].item() == _brute_force_scale(w[row, 32 * g:32 * g + 32].tolist())
    # Elements: the OCP element rule (RNE, saturation, sign) applied with the chosen exponents.
    expected = reference.encode(reference.as_blocks(w), scales.long() - 127)
    assert torch.equal(blocks, expected[0])
    offsets = {int(s) for s in (scales.long() - reference.quantize(w)[1].long()).flatten()}
    assert offsets == {-1, 0, 1}


def test_special_blocks_and_shapes() -> None:
    w = random_weights((5, 64), seed=7)
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2, 3] = math.nan
    w[3, 40] = -math.inf
    blocks, scales = quantize_mse(w)
    ref_blocks, ref_scales = reference.quantize(w)
    for row, g in ((0, 0), (1, 0), (2, 0), (2, 1), (3, 1)):  # zero and non-finite blocks: as OCP
        assert scales[row, g] == ref_scales[row, g]
        assert torch.equal(blocks[row, g], ref_blocks[row, g])
    for shape in ((32,), (2, 3, 64)):
        b, s = quantize_mse(random_weights(shape, seed=8))
        assert b.shape == (*shape[:-1], shape[-1] // 32, 16) and s.shape == b.shape[:-1]
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mse(torch.zeros(3, 48))


def test_compiled_paths_decode_mse_bytes_exactly(cpp_path: KernelPath) -> None:
    w = _heavy_tailed((33, 256), seed=9)
    blocks, scales = cpp_path.quantize(w, Encoder.MSE)
    assert torch.equal(scales, quantize_mse(w)[1])
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_bits(cpp_path.dequantize(blocks, scales, dtype),
                         reference.dequantize(blocks, scales, dtype))
    x = torch.randn(4, 256)
    torch.testing.assert_close(cpp_path.linear(x, blocks, scales),
                               reference.linear(x, blocks, scales), rtol=1e-5, atol=1e-5)


def test_config_choices_are_the_encoders() -> None:
    assert QUANT_ENCODER_CHOICES == tuple(e.value for e in Encoder)


def _special_weights() -> torch.Tensor:
    """Blocks that probe every branch: zeros of both signs, non-finite values, fp32 subnormals,
    values at the top of fp32's range, exact E2M1 midpoints (ties) at several exponents,
    amax in (6, 8) * 2^e, one outlier over tiny values, and bf16-rounded heavy tails."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = [
        [0.0] * 32, [-0.0] * 32,
        [math.nan] + [1.0] * 31, [1.0] * 31 + [-math.inf],
        [1e-45 * (i + 1) for i in range(32)],  # subnormal fp32: the smallest exponent
        [3.0e38 * (1 - i / 64) for i in range(32)],  # near fp32's max: the largest exponents
        [m * 2.0 ** e for e in (-3, 0, 4) for m in mids] + [8.0] * 11,
        [-(m + 4.0) for m in mids] + [7.9] * 25,
        [4.0] + [0.25] * 31, [-7.5 + i * 15 / 31 for i in range(32)],
    ]
    w = torch.tensor(rows, dtype=torch.float32).flatten()
    return torch.cat([w, _heavy_tailed((8, 256), seed=11).bfloat16().float().flatten()])


@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_mse_encoder_equals_the_torch_search(cpp_path: KernelPath, seed: int) -> None:
    """The C++ MSE encoder (every compiled path) against the torch one, byte for byte."""
    torch.manual_seed(seed)
    w = torch.cat([_special_weights(), _heavy_tailed((64, 576), seed=seed).flatten(),
                   random_weights((64, 256), seed=seed, spread=30).flatten(),
                   torch.randn(64 * 256)]).reshape(-1, 64)
    got_blocks, got_scales = cpp_path.quantize(w, Encoder.MSE)
    want_blocks, want_scales = quantize_mse(w)
    assert torch.equal(got_scales, want_scales)
    assert torch.equal(got_blocks, want_blocks)


def _codes_by_midpoints(a: torch.Tensor) -> torch.Tensor:
    """The E2M1 code by definition: the number of midpoints between grid values below a; a
    value on a midpoint goes to the even code (down after an even code, up after an odd one)."""
    codes = torch.zeros(a.shape, dtype=torch.int64)
    for j, (lo, hi) in enumerate(zip(OCP_E2M1, OCP_E2M1[1:], strict=False)):
        mid = (lo + hi) / 2
        codes += (a > mid) if j % 2 == 0 else (a >= mid)
    return codes


def test_e2m1_codes_equal_the_midpoint_definition() -> None:
    mids = [(lo + hi) / 2 for lo, hi in zip(OCP_E2M1, OCP_E2M1[1:], strict=False)]
    near = [math.nextafter(m, d) for m in mids for d in (0.0, 9.0)]
    a = torch.cat([
        torch.tensor([*mids, *near, *OCP_E2M1, 0.0, 5e-324, 1e-300, 7.0, 8.0, 100.0, 1e300,
                      math.inf], dtype=torch.float64),
        torch.arange(0, 9, 1 / 1024, dtype=torch.float64),
        torch.rand(100_000, dtype=torch.float64) * 8,
    ])
    assert torch.equal(reference.e2m1_codes(a), _codes_by_midpoints(a))
