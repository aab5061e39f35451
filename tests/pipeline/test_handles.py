"""No token handoff outlives an abort or a preemption, and no block leaks (shutdown: see
test_offline.py; one pipeline per process, so it needs its own module)."""

from __future__ import annotations

import pytest

from shared.engine.outputs import FinishReason
from shared.pipeline.engine import PipelineEngine
from shared.pipeline.handoff import HandoffState
from tests.support.engine import random_prompts, run_engine
from tests.support.pipeline import (
    assert_quiescent,
    engine_config,
    greedy,
    pipeline_config,
    reference,
)

# 12 blocks of 16 tokens: four requests growing to ~70 tokens each cannot all fit.
TIGHT = {"kv_blocks": 12, "max_num_batched_tokens": 64}
pytestmark = pytest.mark.timeout(50)


@pytest.fixture(scope="module")
def engine(small_ckpt):
    with PipelineEngine(engine_config(small_ckpt, **TIGHT), pipeline_config(2)) as eng:
        yield eng


def step_until_all_lanes_in_flight(engine: PipelineEngine) -> None:
    for _ in range(20):
        engine.step()
        if engine.num_in_flight == len(engine.scheduler.lanes):
            return
    raise AssertionError("the lanes never filled")


def test_abort_mid_flight_leaves_no_handoff(engine, small_ckpt):
    prompts = random_prompts([6, 9, 4, 12], seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", p, greedy(30))
    step_until_all_lanes_in_flight(engine)
    pending = [lane.inflight.handoff for lane in engine.scheduler.lanes]
    assert all(h is not None and h.state is HandoffState.PENDING for h in pending)
    # A request belongs to at most one in-flight microbatch.
    a, b = ({r.request_id for r in lane.inflight.batch.requests} for lane in engine.scheduler.lanes)
    assert a and b and not a & b
    outputs = []
    for i in range(len(prompts)):
        assert engine.abort_request(f"abort-{i}")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in finals) == [f"abort-{i}" for i in range(4)]
    assert all(o.finish_reason is FinishReason.ABORT for o in finals)
    assert all(h.state is HandoffState.CONSUMED for h in pending)  # waited, then discarded
    assert_quiescent(engine)
    # The pipeline (and the last stage's view of requests) is still consistent.
    prompts, params = random_prompts([5, 8]), [greedy(6)] * 2
    assert {i: o.token_ids for i, o in run_engine(engine, prompts, params).items()} == {
        i: o.token_ids for i, o in reference(small_ckpt, prompts, params, **TIGHT).items()}


def test_preemption_leaves_no_handoff_and_keeps_outputs(engine, small_ckpt):
    prompts, params = random_prompts([20, 30, 25, 18], seed=4), [greedy(48)] * 4
    preemptions = engine.stats().num_preemptions
    got = run_engine(engine, prompts, params)
    assert engine.stats().num_preemptions > preemptions
    want = reference(small_ckpt, prompts, params, **TIGHT)
    assert {i: o.token_ids for i, o in got.items()} == {i: o.token_ids for i, o in want.items()}
    assert_quiescent(engine)
