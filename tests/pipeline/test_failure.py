"""A stage that dies or hangs fails the in-flight requests with errors (never a hang), marks
the engine unhealthy, and a new pipeline can start in the same process afterwards."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shared.engine.async_engine import EngineDeadError
from shared.engine.outputs import FinishReason, RequestOutput
from shared.pipeline.engine import PipelineEngine, PipelineState
from shared.pipeline.facades import PipelineAsyncEngine
from tests.support.engine import random_prompts
from tests.support.pipeline import engine_config, greedy, pipeline_config


async def until(predicate, timeout_s: float = 10.0) -> None:
    """Poll (the engine thread flips `healthy` right after delivering the errors)."""
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def collect(engine: PipelineAsyncEngine, rid: str, prompt: list[int],
                  started: asyncio.Event, max_tokens: int = 400) -> RequestOutput:
    last = None
    async for out in engine.generate(rid, prompt, greedy(max_tokens)):
        started.set()
        last = out
    assert last is not None and last.finished
    return last


async def break_a_stage_mid_generation(engine: PipelineAsyncEngine, sig: int) -> None:
    started = asyncio.Event()
    tasks = [asyncio.create_task(collect(engine, f"r{i}", p, started))
             for i, p in enumerate(random_prompts([5, 9, 7]))]
    await asyncio.wait_for(started.wait(), 20)
    pipe = engine.engine
    assert isinstance(pipe, PipelineEngine)
    os.kill(pipe._group.procs[1].pid, sig)
    finals = await asyncio.wait_for(asyncio.gather(*tasks), 20)  # errors, not a hang
    assert all(o.finish_reason is FinishReason.ERROR and o.error for o in finals)
    assert len(finals[0].token_ids) < 400
    await until(lambda: not engine.healthy)
    assert pipe.state is PipelineState.FAILED
    assert len(pipe.ledger) == 0
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("after", [5, 6], greedy(2)):
            pass
    await asyncio.wait_for(engine.shutdown(), 20)
    assert all(p.exitcode is not None for p in pipe._group.procs.values())


@pytest.mark.timeout(55)
async def test_killed_stage_errors_requests_and_worker_restarts(small_ckpt):
    engine = PipelineAsyncEngine(engine_config(small_ckpt), pipeline_config(2))
    await engine.start()
    await break_a_stage_mid_generation(engine, signal.SIGKILL)
    # Restart in the same process: a fresh pipeline serves again.
    engine = PipelineAsyncEngine(engine_config(small_ckpt), pipeline_config(2))
    await engine.start()
    try:
        out = await collect(engine, "again", random_prompts([6])[0], asyncio.Event(), 20)
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 20
        # A stage dying while the worker is idle is noticed too (the idle thread steps).
        os.kill(engine.engine._group.procs[1].pid, signal.SIGKILL)
        await until(lambda: not engine.healthy)
    finally:
        await engine.shutdown()


@pytest.mark.timeout(55)
async def test_hung_stage_times_out_into_errors(small_ckpt):
    engine = PipelineAsyncEngine(engine_config(small_ckpt), pipeline_config(2, step_timeout_s=3))
    await engine.start()
    await break_a_stage_mid_generation(engine, signal.SIGSTOP)
