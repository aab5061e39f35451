"""Push overlaps compute, through a real engine: chunked prefill reports full blocks per step
(KVStreamTracker), the push stream writes them into the decode while the rest of the prompt
is still computing, and the result equals the engine's own KV. Also: AsyncEngine delivers
the reports and runs step listeners, which reap expired leases once per engine step.

The engine is a small random-weight checkpoint; the overlap test drives `LLMEngine.step()`
itself, so its event log is ordered by construction (no wall-clock thresholds).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.kv_transfer.app import start_server
from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.service import KVTransferService
from services.kv_transfer.store import EngineBlockStore, InMemoryBlockStore, block_major
from shared.config import EngineConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import LLMEngine
from shared.engine.kv_connector import KVRequestOptions
from shared.engine.kv_spec import kv_spec_of
from shared.engine.sampling_params import SamplingParams
from shared.protocol.compat import ModelKVSpec
from shared.protocol.messages import TokenLogprobWire
from tests.support.kv import Node, same_bits

PROMPT = [(13 * i + 5) % 4000 + 3 for i in range(150)]  # 9 full blocks of 16 and a partial one
CHUNK = 32  # tokens per step: two blocks per step
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def engine_config(ckpt: Path) -> EngineConfig:
    return EngineConfig(model=str(ckpt), kv_cache_memory_bytes=8 << 20, num_threads=1,
                        max_num_batched_tokens=CHUNK, enable_chunked_prefill=True)


def spec_of(engine: LLMEngine | AsyncEngine, cfg: EngineConfig) -> ModelKVSpec:
    return kv_spec_of("small-random", engine.fingerprint, cfg, engine.model_config)


class DirectStore:
    """The KVBlockStore protocol straight over an LLMEngine driven on this thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.kv_cache = engine.runner.kv_cache

    async def allocate(self, num_tokens: int) -> list[int] | None:
        return self.engine.allocate_blocks(num_tokens)

    async def free(self, block_ids: list[int]) -> None:
        self.engine.free_blocks(block_ids)

    async def release_held(self, request_id: str) -> None:
        self.engine.release_held(request_id)


async def start(store, spec: ModelKVSpec, role: str, **config) -> Node:
    cfg = KVTransferConfig(role=role, mode=config.pop("mode", "push"), port=0, **config)
    registry = CollectorRegistry()
    service = KVTransferService(cfg, spec, store, registry)
    return Node(service, store, await start_server(cfg, service), registry)


def test_tracker_reports_full_prompt_blocks_per_step(ckpt: Path) -> None:
    engine = LLMEngine.from_config(engine_config(ckpt))
    engine.add_request("r", PROMPT, ONE_TOKEN, hold_kv=True, stream_kv=True)
    engine.add_request("other", PROMPT[:40], ONE_TOKEN)  # not streamed: never reported
    reports = []
    while engine.has_unfinished_requests():
        engine.step()
        reports.append(engine.take_kv_progress())
    held = engine.held_block_ids("r")
    flat = [r for step in reports for r in step]
    assert {r.request_id for r in flat} == {"r"} and all(r.epoch == 0 for r in flat)
    counts = [len(r.block_ids) for r in flat]
    assert counts == sorted(set(counts)) and counts[-1] < len(held)  # grows; partial never
    assert all(r.block_ids == tuple(held[:len(r.block_ids)]) for r in flat)
    assert counts[-1] == (len(PROMPT) // CHUNK * CHUNK) // 16  # all before the last step
    assert engine.kv_stream.num_tracked == 0
    with pytest.raises(ValueError, match="hold_kv"):
        engine.add_request("bad", PROMPT, ONE_TOKEN, stream_kv=True)
    engine.add_request("gone", PROMPT[::-1], ONE_TOKEN, hold_kv=True, stream_kv=True)
    engine.step()
    assert [len(r.block_ids) for r in engine.take_kv_progress()] == [CHUNK // 16]
    engine.abort_request("gone")  # an aborted request is forgotten at once
    assert engine.kv_stream.num_tracked == 0


async def test_push_writes_blocks_into_the_decode_while_the_prompt_computes(
        ckpt: Path) -> None:
    cfg = engine_config(ckpt)
    engine = LLMEngine.from_config(cfg)
    spec = spec_of(engine, cfg)
    geo = engine.runner.kv_cache.shape
    d_store = InMemoryBlockStore(geo[0], 64, geo[3], geo[4], geo[5], engine.runner.kv_cache.dtype)
    p, d = await start(DirectStore(engine), spec, "prefill"), await start(d_store, spec, "decode")
    try:
        stream = p.service.push.prefill.open("t", len(PROMPT))
        receive = asyncio.ensure_future(d.service.push.decode.receive("t", p.address, len(PROMPT)))
        engine.add_request("r", PROMPT, ONE_TOKEN, hold_kv=True, stream_kv=True)
        log: list[tuple[int, bool, int]] = []  # (step, prompt finished, blocks at the decode)
        outputs = []
        for step in range(1, 100):
            outputs += engine.step()
            for report in engine.take_kv_progress():
                stream.feed(report)
            await stream.flushed()  # every reported block is in the decode's cache now
            req = engine.scheduler.requests.get("r")
            log.append((step, req is None, stream.written_blocks))
            if req is None:
                break
            # The early blocks are exact in the decode's cache, before the prompt finished.
            n = stream.written_blocks
            mine = block_major(engine.runner.kv_cache)[torch.tensor(req.block_table[:n])]
            theirs = block_major(d_store.kv_cache)[
                torch.tensor(stream.registration.block_ids[:n])]
            assert same_bits(mine, theirs)
        unfinished = [entry for entry in log if not entry[1]]
        assert len(unfinished) >= 3 and unfinished[-1][2] == 2 * len(unfinished)
        assert not receive.done()
        held = engine.held_block_ids("r")
        first = TokenLogprobWire(outputs[-1].token_ids[0])
        await p.service.push.prefill.send("t", "r", held, len(PROMPT), first, stream=stream)
        kv = await receive
        # Written early: everything the unfinished steps computed; late: the last step's.
        early = unfinished[-1][2]
        assert (stream.stats.early_blocks, stream.stats.late_blocks) == (early, len(held) - early)
        assert same_bits(block_major(d_store.kv_cache)[torch.tensor(kv.block_ids)],
                         block_major(engine.runner.kv_cache)[torch.tensor(held)])
        assert engine.stats().num_held_blocks == 0
        await d_store.free(kv.block_ids)
    finally:
        await p.runner.cleanup()
        await d.runner.cleanup()


async def test_async_engine_delivers_progress_and_reaps_leases_every_step(
        ckpt: Path) -> None:
    cfg = engine_config(ckpt)
    engine = AsyncEngine(cfg)
    await engine.start()
    now = [0.0]
    try:
        connector = engine.kv_connector
        store = EngineBlockStore(connector, await connector.cache_view())
        service = KVTransferService(KVTransferConfig(role="prefill", port=0),
                                    spec_of(engine, cfg), store,
                                    CollectorRegistry(), clock=lambda: now[0])
        detach = connector.add_step_listener(service.transfer.reap)
        reports = []
        async for out in engine.generate("held", PROMPT, ONE_TOKEN,
                                         KVRequestOptions.hold(on_progress=reports.append)):
            first = out.token_ids[0] if out.finished else None
        held = await connector.held_block_ids("held")
        assert [len(r.block_ids) for r in reports][-1] == 8 and held is not None
        await service.pull.prefill.offer("held", held, len(PROMPT), TokenLogprobWire(first or 0))
        now[0] = 1000.0  # the lease ran out; no timer runs (the service is not started)
        assert service.pull.prefill.leases.status("held").state == "held"  # not reaped yet
        async for _ in engine.generate("next", PROMPT[:20], ONE_TOKEN):  # engine steps
            pass
        assert service.pull.prefill.leases.status("held").state == "expired"
        await service.ctx.drain()
        assert (await engine._run_in_engine(lambda e: e.stats())).num_held_blocks == 0
        detach()
    finally:
        await engine.shutdown()
