"""The screened greedy head (kernels/dense/greedy_head.py) against the full head it stands in
for, on every compiled dense tier.

The contract is exact: GreedyHead(x) is argmax over the vocabulary of the full head's logits,
DenseLinear(x).float() through the same tier, with the first index on ties. So every test
compares token ids for equality, never within a tolerance, on heads built to make the screen's
job hard: near-ties within a bf16 step, exact ties (duplicate rows), one loud row among quiet
ones, zero rows and zero hidden states, and widths that are no multiple of the kernels' steps.
The bound the screen relies on is checked on its own, in float64, from the stored int8 rows
and coefficients: it must cover the exact dot product of every row with x.
"""

from __future__ import annotations

import pytest
import torch

from kernels.dense import DenseLinear, KernelPath
from kernels.dense.greedy_head import SCREEN_CHUNK, GreedyHead, screen_weights
from tests.support.dense import DENSE_TIERS, dense_or_skip


@pytest.fixture(scope="module", params=DENSE_TIERS)
def path(request: pytest.FixtureRequest) -> KernelPath:
    return dense_or_skip(request.param)


def _head(weight: torch.Tensor, path: KernelPath) -> tuple[DenseLinear, GreedyHead]:
    full = DenseLinear(torch.nn.Parameter(weight, requires_grad=False), None, path)
    return full, GreedyHead(full)


def _full_argmax(full: DenseLinear, x: torch.Tensor) -> list[int]:
    """The oracle: the whole head's bf16 logits, widened, and torch's first-index argmax."""
    return full(x).float().argmax(-1).tolist()


def _check(full: DenseLinear, screen: GreedyHead, x: torch.Tensor) -> None:
    got = screen(x)
    assert got is not None
    assert got == _full_argmax(full, x)


@pytest.mark.parametrize(("vocab", "k"), [(49152, 576), (1000, 64), (997, 100), (333, 72),
                                          (5, 40)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 32])
def test_random_heads_pick_the_full_heads_argmax(path: KernelPath, vocab: int, k: int,
                                                  rows: int) -> None:
    g = torch.Generator().manual_seed(vocab * 31 + k * 7 + rows)
    weight = (torch.randn(vocab, k, generator=g) * k ** -0.5).bfloat16()
    full, screen = _head(weight, path)
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    _check(full, screen, x)


def test_near_ties_and_exact_ties(path: KernelPath) -> None:
    """Rows that differ from one base row by a few bf16 steps in one element, and duplicates:
    many logits within one bf16 step of the maximum, several exactly equal to it."""
    g = torch.Generator().manual_seed(1)
    k, vocab = 256, 4096
    base = torch.randn(k, generator=g).bfloat16()
    weight = base.repeat(vocab, 1)
    idx = torch.randint(0, k, (vocab,), generator=g)
    bump = torch.randint(-3, 4, (vocab,), generator=g).float() * 2.0 ** -7
    weight[torch.arange(vocab), idx] = (weight[torch.arange(vocab), idx].float()
                                        * (1 + bump)).bfloat16()
    full, screen = _head(weight, path)
    for seed in range(8):
        x = torch.randn(4, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
        logits = full(x).float()
        top = logits.max(-1, keepdim=True).values
        assert int((logits == top).sum()) > 4  # the test does hold exact ties
        _check(full, screen, x)


def test_lowest_index_wins_a_tie(path: KernelPath) -> None:
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(600, 96, generator=g) * 0.1).bfloat16()
    weight[400] = weight[17] = weight[250] = weight[599] = (torch.randn(96, generator=g)).bfloat16()
    full, screen = _head(weight, path)
    x = weight[17:18].clone()  # aligned with the duplicated rows: they win, tied
    got = screen(x)
    assert got == [17] == _full_argmax(full, x)


def test_loud_rows_zero_rows_and_zero_hidden(path: KernelPath) -> None:
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(2000, 128, generator=g) * 0.02).bfloat16()
    weight[7] *= 1000  # one row whose int8 step is 1000x the others'
    weight[100:200] = 0
    full, screen = _head(weight, path)
    x = torch.randn(6, 128, generator=g).bfloat16()
    x[1] = 0  # every logit 0: token 0
    x[2] = -x[0]
    _check(full, screen, x)
    got = screen(x)
    assert got is not None and got[1] == 0


def test_non_finite_hidden_rows_return_none(path: KernelPath) -> None:
    weight = torch.randn(300, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    _, screen = _head(weight, path)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(3, 64).bfloat16()
        x[1, 5] = bad
        assert screen(x) is None
    assert screen(torch.randn(3, 64).bfloat16()) is not None


def test_rejects_what_it_cannot_take(path: KernelPath) -> None:
    weight = torch.randn(50, 64).bfloat16()
    full, screen = _head(weight, path)
    with pytest.raises(ValueError, match="bf16"):
        screen(torch.randn(2, 64))  # fp32 hidden
    with pytest.raises(ValueError, match="bf16"):
        screen(torch.randn(33, 64).bfloat16())  # more rows than the GEMV takes
    biased = DenseLinear(full.weight, torch.nn.Parameter(torch.zeros(50)), path)
    assert not GreedyHead.takes(biased)
    with pytest.raises(ValueError, match="bias-free"):
        GreedyHead(biased)


@pytest.mark.parametrize("seed", range(4))
def test_the_stored_bound_covers_every_rows_error(seed: int) -> None:
    """|w.x - s q.(xs xq)| <= a |x| + b |x - xs xq| for every row, in float64, with x rounded
    to int16 as the op rounds it: the inequality the screen's exactness rests on."""
    g = torch.Generator().manual_seed(seed)
    k = 200
    weight = (torch.randn(3000, k, generator=g) * torch.rand(3000, 1, generator=g) * 2).bfloat16()
    weight[0] = 0
    q, coef = screen_weights(weight)
    assert q.shape == (3000, -(-k // SCREEN_CHUNK) * SCREEN_CHUNK) and q.dtype == torch.int8
    assert torch.count_nonzero(q[:, k:]) == 0  # the K padding is zeros
    s, a, b = coef.double()
    w = weight.double()
    for _ in range(5):
        x = (torch.randn(k, generator=g) * 10).bfloat16().double()
        limit = min(32767, 2**31 // (127 * q.shape[1]) - 1)
        xs = float((x.abs().max() / limit).float())  # rounded to fp32 as the op rounds it
        xq = torch.round(x / xs).clamp(-limit, limit)
        approx = (q[:, :k].double() @ xq) * s * xs
        exact = w @ x
        bound = a * x.norm() + b * (x - xs * xq).norm()
        assert bool(((exact - approx).abs() <= bound).all())
        # and it is no vacuous bound: a small fraction of the logits' range
        assert float(bound.max()) < 0.1 * float(exact.abs().max())
