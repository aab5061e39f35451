"""Sampler vs a plain-torch per-row oracle (penalties, min_p, top_k, top_p, bans), seeded
draws independent of the batch, the sampled distribution, greedy and logprobs."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from shared.engine.request import Request
from shared.engine.sampler import (
    Sampler,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    argmax_rows,
)
from shared.engine.sampling_params import InvalidSamplingParams, SamplingParams

V = 50
NEG = float("-inf")


def request(params: SamplingParams, prompt: list[int], output: list[int] = (), eos=(2,)) -> Request:
    r = Request("x", list(prompt), params, eos_token_ids=frozenset(eos))
    for t in output:
        r.append_output_token(t)
    return r


# ---- plain per-row oracle ------------------------------------------------------------------
def oracle_penalties(row: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    row = row.clone()
    counts = collections.Counter(output)
    for tok in set(prompt) | set(output):
        x = row[tok].item()
        row[tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for tok, c in counts.items():
        row[tok] -= p.frequency_penalty * c + p.presence_penalty
    return row


def oracle_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = row.softmax(-1)
    return torch.tensor([x if probs[i] >= min_p * probs.max() else NEG for i, x in enumerate(row.tolist())])


def oracle_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0:
        return row
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.tensor([x if x >= kth else NEG for x in row.tolist()])


def oracle_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    probs = row.softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:  # smallest prefix (by probability) whose mass reaches p
        keep.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return torch.tensor([x if i in keep else NEG for i, x in enumerate(row.tolist())])


def test_penalties_match_oracle():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    cases = [
        (SamplingParams(repetition_penalty=1.3), [1, 4, 4, 9], [9, 11, 11, 11]),
        (SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4), [5, 6], [6, 7, 7, 3]),
        (SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
         [0, 49], [0]),
    ]
    reqs = [request(p, pr, out) for p, pr, out in cases]
    st = SamplingTensors.from_requests(reqs, V)
    got = apply_penalties(logits, st.penalties)
    for i, (p, pr, out) in enumerate(cases):
        torch.testing.assert_close(got[i], oracle_penalties(logits[i], p, pr, out))


@pytest.mark.parametrize("seed", range(5))
def test_min_p_top_k_top_p_match_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, V, generator=g) * 2
    min_ps, ks, ps = [0.0, 0.05, 0.2, 0.0], [0, 5, 1, 17], [0.9, 1.0, 0.5, 0.3]
    got_min_p = apply_min_p(logits, torch.tensor(min_ps))
    got_k = apply_top_k(logits, torch.tensor(ks))
    got_p = apply_top_p(logits, torch.tensor(ps))
    for i in range(4):
        assert torch.equal(got_min_p[i], oracle_min_p(logits[i], min_ps[i]))
        assert torch.equal(got_k[i], oracle_top_k(logits[i], ks[i]))
        assert torch.equal(got_p[i], oracle_top_p(logits[i], ps[i]))


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # EOS is the greedy choice
    logits[:, 3] = 9.0  # a stop token id
    logits[:, 4] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    reqs = [request(p, [1], []), request(p, [1], [5, 6]),
            request(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), [1], [])]
    out = Sampler()(logits, SamplingTensors.from_requests(reqs, V))
    assert out.token_ids == [4, 2, 2]


@pytest.mark.parametrize("seed", range(4))
def test_argmax_rows_equals_torch_argmax(seed):
    """First index of the maximum, ties, infinities and NaN (the maximum) included, for the
    NumPy path (contiguous or not) and the torch fallback (other dtypes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (9, 40), generator=g).float()  # many ties
    x[1, 7] = math.inf
    x[2, 3], x[2, 30] = math.inf, math.inf
    x[3] = -math.inf
    x[4, 11], x[4, 20] = math.nan, math.nan
    x[5, 2] = math.nan
    x[5, 9] = math.inf
    for t in (x, x.T.contiguous().T, x[:, ::2], x.double(), x.bfloat16()):
        want = t.argmax(-1)
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, want), (t.dtype, got, want)


def test_greedy_is_exact_argmax_and_mixed_batches_keep_it():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3)] * 3
    reqs = [request(p, [1, 2]) for p in params]
    out = Sampler()(logits, SamplingTensors.from_requests(reqs, V))
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_seeded_draw_depends_only_on_seed_and_position():
    torch.manual_seed(2)
    row = torch.randn(V) * 2
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234)
    alone = Sampler(seed=1)(row[None], SamplingTensors.from_requests([request(p, [1, 2, 3])], V))
    others = [request(SamplingParams(temperature=1.0), [5] * n) for n in range(1, 8)]
    batch = others[:3] + [request(p, [9, 9, 9])] + others[3:]  # same position (3), other prompt
    logits = torch.randn(8, V)
    logits[3] = row
    together = Sampler(seed=99)(logits, SamplingTensors.from_requests(batch, V))
    assert together.token_ids[3] == alone.token_ids[0]
    # A different position gives an independent draw (over many positions, not all equal).
    draws = {Sampler()(row[None], SamplingTensors.from_requests([request(p, [1] * n)], V)).token_ids[0]
             for n in range(1, 40)}
    assert len(draws) > 1


def test_sampled_distribution_matches_probs():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -5.0]])
    probs = (logits[0] / 0.7).softmax(-1)
    counts = collections.Counter()
    n = 4000
    for pos in range(n):
        p = SamplingParams(temperature=0.7, seed=7)
        counts[Sampler()(logits, SamplingTensors.from_requests([request(p, [0] * (pos + 1))], 6))
               .token_ids[0]] += 1
    for tok in range(6):
        expected = probs[tok].item()
        sd = math.sqrt(expected * (1 - expected) / n)
        assert abs(counts[tok] / n - expected) < 5 * sd + 1e-3


def test_a_masked_token_is_never_drawn():
    """Tokens at -inf (a grammar's mask, a ban) have probability 0: over 64 rows x 49,152
    tokens x 20 draws (some noise values land at the extremes of their range) the draw is
    always one of the two allowed tokens, seeded rows and unseeded alike."""
    vocab = 49_152
    logits = torch.full((64, vocab), float("-inf"))
    logits[:, 7], logits[:, vocab - 1] = 0.0, -30.0  # one likely token, one very unlikely
    seeded = [request(SamplingParams(temperature=1.0, seed=i), [1]) for i in range(32)]
    unseeded = [request(SamplingParams(temperature=1.0), [1]) for _ in range(32)]
    sampler = Sampler(seed=3)
    drawn = set()
    for _ in range(20):
        drawn |= set(sampler(logits, SamplingTensors.from_requests(seeded + unseeded, vocab))
                     .token_ids)
    assert drawn <= {7, vocab - 1} and 7 in drawn


def test_unseeded_rows_use_the_batch_generator():
    logits = torch.zeros(2, V)
    reqs = [request(SamplingParams(temperature=1.0), [1])] * 2
    a = Sampler(seed=5)(logits, SamplingTensors.from_requests(reqs, V)).token_ids
    b = Sampler(seed=5)(logits, SamplingTensors.from_requests(reqs, V)).token_ids
    assert a == b


def test_logprobs_are_raw_model_logprobs_with_top_n():
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    p_lp = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0)
    reqs = [request(p_lp, [int(logits[0].argmax())]), request(SamplingParams(temperature=0.0), [1])]
    out = Sampler()(logits, SamplingTensors.from_requests(reqs, V))
    raw = logits[0].log_softmax(-1)
    lp = out.logprobs[0]
    assert out.logprobs[1] is None
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(raw[lp.token_id].item())
    top_v, top_i = raw.topk(3)
    assert list(lp.top) == top_i.tolist()
    assert list(lp.top.values()) == pytest.approx(top_v.tolist())


def test_logit_bias_is_added_before_penalties_and_sampling():
    """Each row's bias is added to its own logits (other rows untouched), before the
    repetition penalty; -100 bans a token and +100 forces one even when sampling."""
    torch.manual_seed(1)
    logits = torch.randn(4, V) * 2
    top = int(logits[0].argmax())
    p_ban = SamplingParams(temperature=0.0, logit_bias={top: -100.0, 7: 0.5})
    p_pen = SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={4: 1.5})
    p_force = SamplingParams(temperature=1.0, seed=3, logit_bias={11: 100.0})
    plain = SamplingParams(temperature=0.0)
    reqs = [request(p_ban, [1]), request(p_pen, [4, 9], [4]), request(p_force, [1]),
            request(plain, [1])]
    st = SamplingTensors.from_requests(reqs, V)
    assert not st.plain_greedy
    out = Sampler()(logits, st)
    ban = logits[0].clone()
    ban[top] -= 100.0
    ban[7] += 0.5
    pen = logits[1].clone()
    pen[4] += 1.5
    pen = oracle_penalties(pen, p_pen, [4, 9], [4])
    assert out.token_ids == [int(ban.argmax()), int(pen.argmax()), 11, int(logits[3].argmax())]
    assert out.token_ids[0] != top
    alone = SamplingTensors.from_requests([request(plain, [1])], V)
    assert alone.bias is None and alone.plain_greedy


def test_logit_bias_is_checked_by_sampling_params():
    for bias in ({1: 100.5}, {1: -101.0}, {-1: 1.0}, ((1, 1.0), (1, 2.0))):
        with pytest.raises(InvalidSamplingParams) as err:
            SamplingParams(logit_bias=bias)
        assert err.value.param == "logit_bias"
    assert SamplingParams(logit_bias={5: 2}).logit_bias == ((5, 2.0),)
