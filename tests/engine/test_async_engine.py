"""AsyncEngine: concurrent streams equal offline generation, aborts and consumer
cancellation free blocks within a step, the KV connector, idle without spinning, and a dead
engine thread turns in-flight requests into ERROR outputs instead of hangs."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.config import EngineConfig
from shared.engine import AsyncEngine, EngineDeadError, FinishReason, SamplingParams
from shared.engine.kv_connector import KVRequestOptions
from tests.support.engine import random_prompts, run_engine

PROMPTS = random_prompts([4, 18, 9, 33, 2, 25], seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture
async def engine(small_ckpt):
    eng = AsyncEngine(EngineConfig(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
                                   num_threads=1))
    await eng.start()
    yield eng
    await eng.shutdown()


async def collect(eng: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
    return [out async for out in eng.generate(rid, prompt, params)]


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def all_free(eng: AsyncEngine) -> bool:
    s = eng.stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0


async def test_start_exposes_model_facts(engine):
    assert engine.healthy and len(engine.engine_id) == 32 and len(engine.fingerprint) == 64
    assert engine.max_model_len > 0 and engine.model_config.vocab_size == 49152
    assert engine.tokenizer.eos_token_ids and engine.model_dir.is_dir()
    stats = engine.stats()
    assert stats.block_size == 16 and stats.prefix_cache_queries == 0  # warm-up forgotten


async def test_concurrent_generates_match_offline(engine, make_engine):
    streams = await asyncio.gather(*(collect(engine, f"c{i}", p, GREEDY)
                                     for i, p in enumerate(PROMPTS)))
    offline = run_engine(make_engine(), PROMPTS, [GREEDY] * len(PROMPTS))
    for i, outs in enumerate(streams):
        final = outs[-1]
        assert final.finished and final.finish_reason == FinishReason.LENGTH
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        assert "".join(o.new_text for o in outs) == final.text
        assert final.token_ids == offline[i].token_ids
        m = final.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    await wait_for(lambda: all_free(engine))


async def test_abort_frees_blocks_and_ends_the_stream(engine):
    gen = engine.generate("a", PROMPTS[3], LONG)
    first = await gen.__anext__()
    assert not first.finished and engine.stats().num_running == 1
    engine.abort("a")
    rest = [out async for out in gen]
    assert rest[-1].finished and rest[-1].finish_reason == FinishReason.ABORT
    assert len(rest[-1].token_ids) < 400
    await wait_for(lambda: all_free(engine))


async def test_consumer_cancellation_and_early_exit_abort(engine):
    async def consume(rid: str) -> None:
        async for _ in engine.generate(rid, PROMPTS[1], LONG):
            pass

    task = asyncio.create_task(consume("cancelled"))
    await wait_for(lambda: engine.stats().num_running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: all_free(engine))
    gen = engine.generate("closed", PROMPTS[1], LONG)
    async for _ in gen:
        break
    await gen.aclose()
    await wait_for(lambda: all_free(engine))


async def test_kv_connector_and_held_kv(engine):
    outs = [o async for o in engine.generate("h", PROMPTS[3], GREEDY, KVRequestOptions.hold())]
    assert outs[-1].finished
    held = await engine.kv_connector.held_block_ids("h")
    assert len(held) == 3 and engine.stats().num_held_blocks == 3
    assert await engine.kv_connector.release_held("h")
    await wait_for(lambda: engine.stats().num_held_blocks == 0 and all_free(engine))
    with pytest.raises(ZeroDivisionError):  # a failing engine-thread call reaches its caller
        await engine._run_in_engine(lambda e: 1 / 0)
    assert engine.healthy


async def test_invalid_requests_raise(engine):
    with pytest.raises(ValueError):
        await collect(engine, "bad", [], GREEDY)
    with pytest.raises(ValueError):
        await collect(engine, "bad", [49152 + 5], GREEDY)
    with pytest.raises(ValueError):
        await collect(engine, "bad", [1] * engine.max_model_len, GREEDY)


async def test_idle_engine_does_not_spin(engine):
    inner = engine.engine
    calls = 0
    original = inner.step

    def counting_step():
        nonlocal calls
        calls += 1
        return original()

    inner.step = counting_step
    await asyncio.sleep(0.5)
    assert calls <= 1


async def test_dead_engine_thread_fails_requests_instead_of_hanging(engine):
    gen = engine.generate("x", PROMPTS[0], LONG)
    await gen.__anext__()

    def boom(batch):
        raise RuntimeError("kaboom")

    engine.engine.runner.execute = boom
    rest = [out async for out in gen]
    assert rest[-1].finished and rest[-1].finish_reason == FinishReason.ERROR
    assert "kaboom" in rest[-1].error
    await wait_for(lambda: not engine.healthy)
    with pytest.raises(EngineDeadError):
        await collect(engine, "y", PROMPTS[0], GREEDY)


async def test_shutdown_aborts_streams_and_refuses_new_work(small_ckpt):
    eng = AsyncEngine(EngineConfig(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
                                   num_threads=1))
    await eng.start()
    first_id = eng.engine_id
    gen = eng.generate("s", PROMPTS[0], LONG)
    await gen.__anext__()
    await eng.shutdown()
    rest = [out async for out in gen]
    assert rest[-1].finish_reason == FinishReason.ABORT and not eng.healthy
    with pytest.raises(EngineDeadError):
        await eng._run_in_engine(lambda e: 1)
    eng.abort("s")  # never raises
    await eng.start()  # a restart reloads and gets a new id
    assert eng.healthy and eng.engine_id != first_id
    await eng.shutdown()


async def test_the_engine_thread_loads_the_model_and_a_failed_or_cancelled_start_ends_it(
        small_ckpt, tmp_path):
    """start() loads and warms up on the engine thread (one OpenMP pool: see
    kernels/dense/csrc/decode_team.cpp). A load that fails raises from start() and leaves no
    thread; a start() cancelled mid-load leaves none running once the load is done; either
    way a later start() works."""
    import threading

    config = EngineConfig(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20, num_threads=1)
    bad = AsyncEngine(EngineConfig(model=str(tmp_path / "missing"), num_threads=1))
    with pytest.raises(Exception, match="missing"):
        await bad.start()
    assert not bad.healthy and bad._thread is None

    eng = AsyncEngine(config)
    before = {t.ident for t in threading.enumerate()}
    task = asyncio.create_task(eng.start())
    await wait_for(lambda: eng._thread is not None)
    loading = eng._thread
    assert loading is not None and loading.ident not in before  # the load runs there
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(loading.join, 60)
    assert not loading.is_alive() and not eng.healthy
    await eng.start()
    try:
        assert eng.healthy
        assert eng._thread is not None and eng._thread.name == "pdmesh-engine"
        outs = await collect(eng, "after", PROMPTS[0], GREEDY)
        assert outs[-1].finish_reason == FinishReason.LENGTH
    finally:
        await eng.shutdown()
