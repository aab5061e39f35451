"""When stage 0 awaits a step's sampled tokens, judged by the order of events (no clock).

The last stage's token send is held behind a gate (a controllable delay) that opens only
when stage 0 starts waiting for those tokens. With the async hand-off, stage 0 has by then
scheduled, prepared and sent the OTHER lane's step; it consumes the tokens only after they
arrive, right before preparing its own lane's next step. The blocking baseline, under the
same gate, does no other work in between: the contrast shows the log can tell them apart.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from shared.pipeline.engine import PipelineEngine
from shared.pipeline.events import EventKind, EventLog, PipelineEvent, PipelineHooks
from tests.support.engine import random_prompts, run_engine
from tests.support.pipeline import engine_config, greedy, pipeline_config

E = EventKind


def run_gated(ckpt, blocking: bool) -> list[PipelineEvent]:
    gate = mp.get_context("spawn").Semaphore(0)

    def open_gate(event: PipelineEvent) -> None:
        if event.kind is E.WAIT_BEGIN:
            gate.release()  # one token message may now leave the last stage

    hooks = PipelineHooks(events=EventLog(open_gate), token_gate=gate)
    pipeline = pipeline_config(2, blocking_handoff=blocking)
    with PipelineEngine(engine_config(ckpt), pipeline, hooks) as engine:
        run_engine(engine, random_prompts([9, 12]), [greedy(6), greedy(6)])
        assert len(engine.ledger) == 0
    return hooks.events.snapshot()


def between(log: list[PipelineEvent], start: int, end: int) -> list[tuple[EventKind, int]]:
    return [(e.kind, e.lane) for e in log[start + 1:end]]


def handoffs(log: list[PipelineEvent]) -> list[PipelineEvent]:
    return [e for e in log if e.kind is E.POST_RECV]


def position(log: list[PipelineEvent], kind: EventKind, step: int) -> int:
    return next(i for i, e in enumerate(log) if e.kind is kind and e.step == step)


@pytest.mark.timeout(60)
def test_async_handoff_overlaps_the_other_lane_and_consumes_late(small_ckpt):
    log = run_gated(small_ckpt, blocking=False)
    posted = handoffs(log)
    assert len(posted) >= 10
    overlapped = 0
    for post in posted:
        lane, other = post.lane, 1 - post.lane
        p, w = position(log, E.POST_RECV, post.step), position(log, E.WAIT_BEGIN, post.step)
        a, c = position(log, E.ARRIVED, post.step), position(log, E.CONSUME, post.step)
        assert p < w < a < c  # awaited once, consumed only after arrival
        done_meanwhile = between(log, p, w)
        if {(E.SCHEDULE, other), (E.PREPARE, other), (E.SEND, other)} <= set(done_meanwhile):
            overlapped += 1
        # Nothing of this lane happens until its tokens are consumed; its next step is
        # prepared only after that.
        assert all(ln != lane for _, ln in done_meanwhile)
        later = [e for e in log[c:] if e.lane == lane and e.kind is E.PREPARE]
        if later:
            assert position(log, E.PREPARE, later[0].step) > c
    # Every hand-off but the tail ones (when the other lane has finished) overlapped.
    assert overlapped >= len(posted) - 2


@pytest.mark.timeout(60)
def test_blocking_handoff_does_no_other_work_while_waiting(small_ckpt):
    log = run_gated(small_ckpt, blocking=True)
    for post in handoffs(log):
        p, c = position(log, E.POST_RECV, post.step), position(log, E.CONSUME, post.step)
        assert [k for k, _ in between(log, p, c)] == [E.WAIT_BEGIN, E.ARRIVED]
