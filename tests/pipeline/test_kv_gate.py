"""Streamed prompt blocks (push overlap) leave a pipeline only once every stage wrote them.

Unit level: StageKVGate holds a request's progress until a step at or after the one that made
it has brought back sampled tokens (every stage then finished it). Engine level: a chunked
prompt streamed out of a PP=2 engine next to a decoding request, with the last stage held
back (a test gate) until stage 0 waits for tokens; every block reported mid-prompt already
holds, on every layer, exactly the KV it holds when the prompt finished.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from shared.engine.kv_stream import KVProgress, KVStreamTracker
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.pipeline.engine import PipelineEngine
from shared.pipeline.events import EventKind, EventLog, PipelineEvent, PipelineHooks
from shared.pipeline.kv_gate import StageKVGate
from tests.support.engine import random_prompts
from tests.support.pipeline import engine_config, greedy, pipeline_config


def running(rid: str, prompt_len: int, computed: int, blocks: list[int]) -> Request:
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(), hold_kv=True)
    req.status, req.num_computed_tokens, req.block_table = RequestStatus.RUNNING, computed, blocks
    return req


def test_progress_waits_for_a_step_that_came_back_from_the_last_stage() -> None:
    tracker = KVStreamTracker(block_size=4)
    gate = StageKVGate(tracker)
    a, b = running("a", 12, 8, [7, 8, 9]), running("b", 12, 4, [3, 4, 5])
    other = running("other", 4, 4, [1])  # not streamed: passes through silently
    tracker.track(a)
    tracker.track(b)
    gate.landed(0, [a], complete=False)  # a non-final chunk: later stages may still write
    gate.landed(1, [b], complete=False)
    assert tracker.take() == [] and len(gate) == 2
    gate.landed(2, [other], complete=True)  # tokens of step 2: steps 0..2 ran everywhere
    assert tracker.take() == [KVProgress("a", (7, 8), 0), KVProgress("b", (3,), 0)]
    a.num_computed_tokens = 12
    gate.landed(3, [a], complete=False)
    assert tracker.take() == [] and len(gate) == 1
    gate.landed(1, [b], complete=False)  # an older step landing late is final already
    assert tracker.take() == [] and len(gate) == 1  # (b made no new full block)
    gate.landed(4, [], complete=True)
    assert tracker.take() == [KVProgress("a", (7, 8, 9), 0)] and len(gate) == 0


def test_a_failed_pipeline_drops_what_it_held() -> None:
    tracker = KVStreamTracker(block_size=4)
    gate = StageKVGate(tracker)
    req = running("a", 12, 8, [1, 2, 3])
    tracker.track(req)
    gate.landed(0, [req], complete=False)
    gate.clear()
    gate.landed(1, [], complete=True)
    assert tracker.take() == [] and len(gate) == 0


class LastStageLeash:
    """The last stage may run step k only once stage 0 waits for the tokens of a step >= k:
    until then it lags, its layers of the silent chunks before unwritten (a `step_gate`)."""

    def __init__(self) -> None:
        self.gate = mp.get_context("spawn").Semaphore(0)
        self.allowed = 0

    def on_event(self, event: PipelineEvent) -> None:
        if event.kind is EventKind.WAIT_BEGIN and event.step + 1 > self.allowed:
            for _ in range(event.step + 1 - self.allowed):
                self.gate.release()
            self.allowed = event.step + 1

    def let_go(self) -> None:
        for _ in range(1000):
            self.gate.release()


@pytest.mark.timeout(60)
def test_streamed_blocks_are_final_on_every_layer(small_ckpt) -> None:
    prompt, other = random_prompts([90, 5], seed=4)
    config = engine_config(small_ckpt, max_num_batched_tokens=16)  # six chunks, five silent
    leash = LastStageLeash()
    hooks = PipelineHooks(events=EventLog(leash.on_event), step_gate=leash.gate)
    with PipelineEngine(config, pipeline_config(2), hooks) as engine:
        # The prompt's lane goes first, so its silent chunks land before stage 0 waits for the
        # decoding request's tokens, which are what tells it those chunks ran everywhere.
        engine.add_request("r", prompt, greedy(1), hold_kv=True, stream_kv=True)
        engine.add_request("decoding", other, greedy(40))
        assert engine.scheduler.lane_of("r") is not engine.scheduler.lane_of("decoding")
        snapshots: dict[int, torch.Tensor] = {}
        while engine.has_unfinished_requests():
            finished = any(o.finished and o.request_id == "r" for o in engine.step())
            for report in engine.take_kv_progress():
                assert report.epoch == 0 and not finished
                for block in report.block_ids:  # every layer, as the push sender reads it
                    snapshots.setdefault(block, engine.runner.kv_cache[:, :, block].clone())
        leash.let_go()
        held = engine.held_block_ids("r")
        assert held is not None and list(snapshots) == held[:len(prompt) // 16]
        for block, seen in snapshots.items():
            assert seen.abs().sum(dim=(1, 2, 3, 4)).gt(0).all(), f"block {block}: a stage's "\
                "layers were not written yet when it was reported"
            assert torch.equal(seen, engine.runner.kv_cache[:, :, block]), block
        assert engine.release_held("r") and len(engine.kv_gate) == 0
