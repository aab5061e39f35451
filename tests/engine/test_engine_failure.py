"""An exception escaping an engine step fails the whole engine at once, loudly and for good:
every in-flight request gets an ERROR output, later ones EngineDeadError, the failure
listeners run once, and the traceback is logged once. Failures inside that handling (the
reported hang: finishing the requests re-decoded the id that had just failed) change nothing.
NaN logits are a per-request error instead: the engine goes on.

Failures are injected through the runner's test-only `fault_hook`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from shared.config import EngineConfig
from shared.engine import AsyncEngine, EngineDeadError, EngineState, FinishReason, SamplingParams
from shared.engine.engine import NON_FINITE_LOGITS
from shared.engine.outputs import RequestOutput
from shared.engine.scheduler import ScheduledBatch
from tests.support.engine import random_prompts

PROMPTS = random_prompts([5, 12, 7, 30], seed=3)
LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
BOUND_S = 30.0  # a hang fails the test instead of stalling the suite


class Fault:
    """A fault_hook that raises once armed (from any thread: a plain attribute)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.armed = False

    def __call__(self, batch: ScheduledBatch) -> None:
        if self.armed:
            raise self.exc


@pytest.fixture
async def engine(small_ckpt: Path):
    eng = AsyncEngine(EngineConfig(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
                                   num_threads=1))
    await eng.start()
    yield eng
    await eng.shutdown()


async def last_output(eng: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams,
                      started: asyncio.Event | None = None) -> RequestOutput:
    last = None
    async for out in eng.generate(rid, prompt, params):
        if started is not None:
            started.set()
        last = out
    assert last is not None and last.finished
    return last


async def run_until_failure(eng: AsyncEngine, fault: Fault) -> list[RequestOutput]:
    """Start every prompt, arm the fault once all produce tokens, return their finals."""
    eng.engine.runner.fault_hook = fault
    started = [asyncio.Event() for _ in PROMPTS]
    tasks = [asyncio.create_task(last_output(eng, f"r{i}", p, LONG, started[i]))
             for i, p in enumerate(PROMPTS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), BOUND_S)
    fault.armed = True
    return await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)


async def test_a_failed_step_fails_every_request_and_the_engine(engine, caplog) -> None:
    told: list[str] = []
    engine.add_failure_listener(told.append)
    with caplog.at_level(logging.ERROR, logger="shared.engine.async_engine"):
        finals = await run_until_failure(engine, Fault(RuntimeError("injected step failure")))
    for out in finals:
        assert out.finish_reason is FinishReason.ERROR
        assert "injected step failure" in out.error and len(out.token_ids) < LONG.max_tokens
    assert not engine.healthy and engine.state is EngineState.FAILED
    assert "injected step failure" in engine.failure
    with pytest.raises(EngineDeadError, match="injected step failure"):
        await last_output(engine, "late", PROMPTS[0], LONG)
    with pytest.raises(EngineDeadError):
        await engine.kv_connector.held_block_ids("any")
    await asyncio.sleep(0)
    assert told == [engine.failure]  # once
    late: list[str] = []
    engine.add_failure_listener(late.append)  # subscribed after the fact: told too
    await asyncio.sleep(0)
    assert late == [engine.failure]
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1 and "injected step failure" in str(tracebacks[0].exc_info[1])


async def test_failing_again_while_failing_still_releases_everyone(engine) -> None:
    """The issue's hang: finishing the in-flight requests (fail_all) raised a second time,
    so nothing was released and the engine still looked healthy."""
    def fail_all_raises(error: str) -> list[RequestOutput]:
        raise ValueError("token ids must be in [0, 49152)")

    engine.engine.fail_all = fail_all_raises
    finals = await run_until_failure(engine, Fault(ValueError("token ids must be in [0, 49152)")))
    assert all(o.finish_reason is FinishReason.ERROR and o.error for o in finals)
    assert not engine.healthy
    with pytest.raises(EngineDeadError):
        await last_output(engine, "late", PROMPTS[0], LONG)


async def test_a_detokenizer_that_raises_fails_loudly_instead_of_hanging(engine) -> None:
    """The reported failure replayed end to end: a tokenizer whose decode raises on the
    engine thread (as decode did for ids past the tokenizer), in the step and again in the
    failure handling's own decode of the requests' tails."""
    real = engine.engine.output_processor.tokenizer

    class Raising:
        """Decodes the first calls, then raises on every one (as for a bad id in a tail)."""

        calls = 0

        def __getattr__(self, name: str):
            return getattr(real, name)

        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            Raising.calls += 1
            if Raising.calls > 20:
                raise ValueError("token ids must be in [0, 49152)")
            return real.decode(ids, skip_special_tokens)

    engine.engine.output_processor.tokenizer = Raising()
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    finals = await asyncio.wait_for(asyncio.gather(
        *(last_output(engine, f"d{i}", p, greedy) for i, p in enumerate(PROMPTS))), BOUND_S)
    assert all(o.finish_reason is FinishReason.ERROR and "token ids" in o.error for o in finals)
    assert engine.state is EngineState.FAILED


async def test_a_command_that_raises_fails_the_engine_too(engine) -> None:
    """Anything escaping the engine thread's loop counts, not only the forward."""
    gen = engine.generate("a", PROMPTS[1], LONG)
    await gen.__anext__()

    def broken_abort(request_id: str, *args, **kwargs) -> bool:
        raise RuntimeError("abort broke")

    engine.engine.abort_request = broken_abort
    engine.abort("a")
    rest = await asyncio.wait_for(_drain(gen), BOUND_S)
    assert rest[-1].finish_reason is FinishReason.ERROR and "abort broke" in rest[-1].error
    assert engine.state is EngineState.FAILED


async def _drain(gen) -> list[RequestOutput]:
    return [out async for out in gen]


async def test_shutdown_is_not_a_failure(small_ckpt) -> None:
    eng = AsyncEngine(EngineConfig(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
                                   num_threads=1))
    await eng.start()
    told: list[str] = []
    eng.add_failure_listener(told.append)
    await eng.shutdown()
    await asyncio.sleep(0)
    assert eng.state is EngineState.STOPPED and eng.failure is None and told == []


async def test_nan_weights_fail_each_request_and_the_engine_goes_on(nan_ckpt) -> None:
    """All-NaN weights with sampling on: every request ends with a clear ERROR (never a
    hang, never a made-up token) and the engine itself stays healthy with all blocks free."""
    eng = AsyncEngine(EngineConfig(model=str(nan_ckpt), dtype="float32",
                                   kv_cache_memory_bytes=4 << 20, num_threads=1))
    await eng.start()
    try:
        params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i)
                  for i in range(3)]
        params.append(SamplingParams(temperature=1.0, top_k=5, min_p=0.1, max_tokens=20,
                                     logprobs=2, repetition_penalty=1.2))
        finals = await asyncio.wait_for(asyncio.gather(
            *(last_output(eng, f"n{i}", PROMPTS[i], p) for i, p in enumerate(params))), BOUND_S)
        for out in finals:
            assert out.finish_reason is FinishReason.ERROR and out.error == NON_FINITE_LOGITS
            assert out.token_ids == []
        assert eng.healthy
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    finally:
        await eng.shutdown()
