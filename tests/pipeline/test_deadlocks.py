"""Regression tests for the upstream pipeline deadlocks; each must finish well inside its
timeout. A run that posted a receive with no matching send would hang in `step()` until the
step timeout, and the checks below also count the traffic on both sides:
- a receive posted with no matching send;
- the last rank entering the receive path;
- dummy tokens sent for non-final chunked-prefill steps;
- empty batches.
"""

from __future__ import annotations

import pytest

from shared.pipeline.channel import Counter
from shared.pipeline.engine import PipelineEngine
from shared.pipeline.events import EventKind, EventLog, PipelineHooks
from tests.support.engine import random_prompts, run_engine
from tests.support.pipeline import (
    assert_quiescent,
    engine_config,
    greedy,
    pipeline_config,
    reference,
)

CHUNK = {"max_num_batched_tokens": 16}
pytestmark = pytest.mark.timeout(45)


@pytest.fixture(scope="module")
def engine(small_ckpt):
    hooks = PipelineHooks(events=EventLog())
    with PipelineEngine(engine_config(small_ckpt, **CHUNK), pipeline_config(2, step_timeout_s=10),
                        hooks) as eng:
        yield eng


def traffic(engine: PipelineEngine) -> dict[str, int]:
    c = engine.counters
    return {"forward": int(c[0, Counter.FORWARD_SENT]), "posted": int(c[0, Counter.TOKEN_RECVS_POSTED]),
            "sent": int(c[1, Counter.TOKENS_SENT]), "received": int(c[1, Counter.FORWARD_RECEIVED]),
            "last_recv": int(c[1, Counter.TOKEN_RECVS_ON_LAST])}


def steps_by_kind(engine: PipelineEngine, since: int) -> tuple[set[int], set[int]]:
    """(steps sent, steps that posted a token receive) among events[since:]."""
    events = engine.hooks.events.snapshot()[since:]
    sent = {e.step for e in events if e.kind is EventKind.SEND}
    posted = {e.step for e in events if e.kind is EventKind.POST_RECV}
    return sent, posted


def test_every_posted_receive_has_a_matching_send(engine, small_ckpt):
    prompts, params = random_prompts([5, 40, 23, 2]), [greedy(6)] * 4
    before = traffic(engine)
    got = run_engine(engine, prompts, params)
    assert {i: o.token_ids for i, o in got.items()} == {
        i: o.token_ids for i, o in reference(small_ckpt, prompts, params, **CHUNK).items()}
    after = traffic(engine)
    assert after["posted"] - before["posted"] == after["sent"] - before["sent"] > 0
    assert_quiescent(engine)


def test_the_last_rank_never_enters_the_receive_path(engine):
    run_engine(engine, random_prompts([7, 3]), [greedy(4)] * 2)
    assert traffic(engine)["last_recv"] == 0
    assert_quiescent(engine)


def test_non_final_prefill_chunks_send_no_tokens(engine):
    """A 100-token prompt with a 16-token budget takes 7 steps; only the last one samples,
    so the 6 others post nothing on either side."""
    since, before = len(engine.hooks.events.snapshot()), traffic(engine)
    out = run_engine(engine, random_prompts([100]), [greedy(1)])
    assert len(out[0].token_ids) == 1
    sent, posted = steps_by_kind(engine, since)
    assert len(sent) == 7 and len(posted) == 1
    after = traffic(engine)
    assert after["forward"] - before["forward"] == 7
    assert after["posted"] - before["posted"] == after["sent"] - before["sent"] == 1
    assert_quiescent(engine)


def test_empty_batches_post_nothing(engine):
    before = traffic(engine)
    for _ in range(20):  # no request: every lane turn schedules nothing
        assert engine.step() == []
    assert not engine.has_work()
    assert traffic(engine) == before
    # One request, two lanes: the empty lane's turns send nothing either.
    since = len(engine.hooks.events.snapshot())
    run_engine(engine, random_prompts([4]), [greedy(5)])
    sent, posted = steps_by_kind(engine, since)
    after = traffic(engine)
    assert after["forward"] - before["forward"] == len(sent) == 5
    assert after["received"] - before["received"] == 5
    assert after["posted"] - before["posted"] == after["sent"] - before["sent"] == len(posted)
    assert_quiescent(engine)
