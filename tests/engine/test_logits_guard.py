"""Non-finite logits: the guard against a per-row oracle, and the engine on a model whose one
weight is NaN (in one token's embedding row).

Only the requests whose prompt holds that token fail, with FinishReason.ERROR; every other
request of the same batches, and later requests reusing the failed requests' blocks, give
exactly the tokens of the clean model (the same checkpoint without the NaN). The guard counts
the failures for /metrics and stamps the latest for /health.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine import LLM, FinishReason, SamplingParams
from shared.engine.logits_guard import LogitsGuard
from tests.conftest import NAN_TOKEN, ONE_NAN

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=5, ignore_eos=True)
CLEAN_PROMPTS = [[5, 6, 7, 8, 9], [300, 301, 302] * 7, [42] * 3]
NAN_PROMPTS = [[5, 6, NAN_TOKEN, 8, 9], [NAN_TOKEN] + [11] * 20]


def oracle_bad_rows(logits: torch.Tensor) -> tuple[int, ...]:
    return tuple(i for i, row in enumerate(logits.tolist())
                 if not all(math.isfinite(v) for v in row))


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 40), data=st.data())
def test_guard_matches_a_per_row_oracle(rows: int, vocab: int, data: st.DataObject) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    poison = data.draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, vocab - 1),
                                          st.sampled_from([math.nan, math.inf, -math.inf,
                                                           3e38, -3e38])),
                                max_size=4))  # (+-3e38: finite, but two overflow a sum)
    for r, c, v in poison:
        logits[r, c] = v
    before = logits.clone()
    clock = iter([7.0])
    guard = LogitsGuard(clock=lambda: next(clock))
    checked = guard.check(logits)
    want = oracle_bad_rows(logits)
    assert checked.bad_rows == want
    assert guard.num_non_finite == len(want)
    assert torch.equal(logits.nan_to_num(0.0), before.nan_to_num(0.0))  # the input is untouched
    if not want:
        assert checked.logits is logits and guard.last_non_finite_at is None  # no copy
    else:
        assert guard.last_non_finite_at == 7.0
        assert torch.isfinite(checked.logits).all()
        good = [i for i in range(rows) if i not in want]
        assert torch.equal(checked.logits[good], logits[good])
        assert guard.check(torch.zeros(1, vocab)).bad_rows == ()  # a clean step clears the stamp
        assert guard.last_non_finite_at is None and guard.num_non_finite == len(want)
    assert guard.reset() == len(want) and guard.num_non_finite == 0


def test_finite_logits_whose_sum_overflows_are_clean() -> None:
    logits = torch.zeros(2, 8)
    logits[0, :3] = 3e38  # each finite; their float32 sum is inf
    assert not math.isfinite(float(logits.sum()))
    guard = LogitsGuard()
    checked = guard.check(logits)
    assert checked.bad_rows == () and checked.logits is logits
    assert guard.num_non_finite == 0 and guard.last_non_finite_at is None


@pytest.fixture(scope="module")
def clean_llm(make_checkpoint: Callable[..., Path]) -> LLM:
    return LLM(model=str(make_checkpoint(**ONE_NAN)), dtype="float32", num_threads=1,
               kv_cache_memory_bytes=2 << 20)


@pytest.fixture(scope="module")
def nan_llm(one_nan_ckpt: Path) -> LLM:
    return LLM(model=str(one_nan_ckpt), dtype="float32", num_threads=1,
               kv_cache_memory_bytes=2 << 20)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_only_the_requests_that_meet_the_nan_fail(clean_llm: LLM, nan_llm: LLM,
                                                   params: SamplingParams) -> None:
    engine = nan_llm.engine
    failed_before = engine.stats().num_non_finite_logits
    mixed = [CLEAN_PROMPTS[0], NAN_PROMPTS[0], CLEAN_PROMPTS[1], NAN_PROMPTS[1], CLEAN_PROMPTS[2]]
    got = nan_llm.generate(mixed, params)
    want = clean_llm.generate(CLEAN_PROMPTS, params)
    clean_got = [got[0], got[2], got[4]]
    for g, w in zip(clean_got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason is w.outputs[0].finish_reason
    for bad in (got[1], got[3]):
        assert bad.outputs[0].finish_reason is FinishReason.ERROR
        assert bad.outputs[0].token_ids == []
    stats = engine.stats()
    assert stats.num_non_finite_logits == failed_before + 2
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    # The failed requests' blocks (NaN KV inside) are reused by the next requests: still clean.
    again = nan_llm.generate(CLEAN_PROMPTS * 2, params)
    for g, w in zip(again, want * 2, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert engine.stats().non_finite_logits_at is None  # clean steps since


def test_a_warm_up_on_all_nan_weights_warns(nan_ckpt: Path, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    llm = LLM(model=str(nan_ckpt), dtype="float32", num_threads=1, kv_cache_memory_bytes=1 << 20)
    llm.engine.warmup()
    assert "NaN or infinite logits" in caplog.text
    assert llm.engine.stats().num_non_finite_logits == 0  # the warm-up is forgotten
