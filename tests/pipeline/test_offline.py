"""Offline use through PipelineLLM, and a shutdown with steps in flight: each handoff is
waited exactly once, the stages exit cleanly, nothing leaks."""

from __future__ import annotations

import pytest

from shared.pipeline.channel import Counter
from shared.pipeline.engine import PipelineEngine, PipelineState
from shared.pipeline.facades import PipelineLLM
from shared.pipeline.handoff import HandoffState
from tests.support.engine import random_prompts
from tests.support.pipeline import greedy, pipeline_config


def step_until_all_lanes_in_flight(engine: PipelineEngine) -> None:
    for _ in range(20):
        engine.step()
        if engine.num_in_flight == len(engine.scheduler.lanes):
            return
    raise AssertionError("the lanes never filled")


@pytest.mark.timeout(50)
def test_shutdown_mid_flight_waits_each_handoff_once(small_ckpt):
    llm = PipelineLLM(model=str(small_ckpt), pp_size=2, num_threads=1,
                      kv_cache_memory_bytes=4 << 20, pipeline=pipeline_config(2))
    engine = llm.engine
    assert isinstance(engine, PipelineEngine)
    # Offline use first: generate() drives the pipeline to completion.
    outs = llm.generate(random_prompts([7, 3, 11]), greedy(5))
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    for i, p in enumerate(random_prompts([6, 9, 4], seed=8)):
        engine.add_request(f"late-{i}", p, greedy(40))
    step_until_all_lanes_in_flight(engine)
    pending = [lane.inflight.handoff for lane in engine.scheduler.lanes]
    llm.close()
    assert engine.state is PipelineState.CLOSED
    assert all(h.state is HandoffState.CONSUMED for h in pending)
    assert len(engine.ledger) == 0 and engine.num_in_flight == 0
    assert all(p.exitcode == 0 for p in engine._group.procs.values())
    assert engine.counters[0, Counter.TOKEN_RECVS_POSTED] == engine.counters[1, Counter.TOKENS_SENT]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.close()  # idempotent
