"""P/D through real engines: prefill on one engine, KV moved by the KV services, decode on
another; the tokens equal a single (mixed) engine's, and no block stays held or allocated.

Uses a small random-weight checkpoint (not the real SmolLM2), so it stays fast.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.kv_transfer.app import start_server
from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.context import PulledKV
from services.kv_transfer.service import KVTransferService
from services.kv_transfer.store import EngineBlockStore
from shared.config import EngineConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.kv_connector import AdoptOutcome, KVRequestOptions
from shared.engine.kv_spec import kv_spec_of
from shared.engine.request import PrefilledKV
from shared.engine.sampling_params import SamplingParams
from shared.protocol.messages import TokenLogprobWire

PROMPT = [(7 * i + 11) % 4000 + 3 for i in range(45)]  # 45 tokens: 3 blocks of 16, partial last
GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Worker:
    """An engine plus its KV service, as a prefill or decode worker would hold them."""

    def __init__(self, engine: AsyncEngine, service: KVTransferService, runner) -> None:
        self.engine, self.service, self.runner = engine, service, runner

    async def run(self, request_id: str, max_tokens: int,
                  kv: KVRequestOptions | None = None) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        final = None
        async for out in self.engine.generate(request_id, PROMPT, params, kv):
            final = out
        assert final is not None and final.error is None, final
        return final.token_ids

    async def decode(self, request_id: str, max_tokens: int, kv: PulledKV) -> list[int]:
        """The decode leg's flow: a request waits for remote KV, then adopts `kv`."""
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        stream = self.engine.generate(request_id, PROMPT, params, KVRequestOptions.await_remote())
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the request is submitted before the adoption (FIFO commands)
        adopted = await self.engine.kv_connector.adopt(request_id, PrefilledKV(
            tuple(kv.block_ids), kv.num_tokens, kv.first_token.token_id))
        assert adopted.outcome is AdoptOutcome.ADOPTED, adopted
        final = await first
        async for out in stream:
            final = out
        assert final.finished and final.error is None, final
        return final.token_ids

    async def blocks(self) -> tuple[int, int, int]:
        s = await self.engine._run_in_engine(lambda e: e.stats())  # fresh, not the snapshot
        return s.num_total_blocks - s.num_free_blocks, s.num_held_blocks, s.num_running


async def start_worker(ckpt: Path, role: str, mode: str) -> Worker:
    cfg = EngineConfig(model=str(ckpt), kv_cache_memory_bytes=8 << 20, num_threads=1)
    engine = AsyncEngine(cfg)
    await engine.start()
    spec = kv_spec_of("small-random", engine.fingerprint, cfg, engine.model_config)
    kv_cfg = KVTransferConfig(role=role, mode=mode, port=0)
    service = KVTransferService(kv_cfg, spec, EngineBlockStore(engine.kv_connector,
                                                             await engine.kv_connector.cache_view()),
                                CollectorRegistry())
    return Worker(engine, service, await start_server(kv_cfg, service))


@pytest.fixture
async def workers(ckpt: Path):
    started: list[Worker] = []

    async def make(role: str, mode: str) -> Worker:
        started.append(await start_worker(ckpt, role, mode))
        return started[-1]

    yield make
    for w in started:
        await w.runner.cleanup()
        await w.engine.shutdown()


async def prefill(p: Worker, request_id: str) -> tuple[int, list[int]]:
    first = (await p.run(request_id, 1, KVRequestOptions.hold()))[0]
    held = await p.engine.kv_connector.held_block_ids(request_id)
    assert held is not None
    return first, held


async def test_pull_pd_equals_mixed(workers) -> None:
    p, d = await workers("prefill", "pull"), await workers("decode", "pull")
    mixed = await p.run("mixed", 8)
    first, held = await prefill(p, "req")
    params = await p.service.pull.prefill.offer("req", held, len(PROMPT), TokenLogprobWire(first))
    kv = await d.service.pull.decode.fetch(params)
    tokens = await d.decode("req", 8, kv)
    assert tokens == mixed
    await asyncio.gather(p.service.ctx.drain(), d.service.ctx.drain())
    await p.service.ctx.drain()
    assert await p.blocks() == (0, 0, 0) and await d.blocks() == (0, 0, 0)


async def test_push_pd_equals_mixed(workers) -> None:
    p, d = await workers("prefill", "push"), await workers("decode", "push")
    mixed = await d.run("mixed", 8)
    receive = asyncio.ensure_future(d.service.push.decode.receive("t1", p.service.identity.node.address,
                                                           len(PROMPT)))
    first, held = await prefill(p, "req")
    await p.service.push.prefill.send("t1", "req", held, len(PROMPT), TokenLogprobWire(first))
    kv = await receive
    tokens = await d.decode("req", 8, kv)
    assert tokens == mixed
    await asyncio.gather(p.service.ctx.drain(), d.service.ctx.drain())
    assert await p.blocks() == (0, 0, 0) and await d.blocks() == (0, 0, 0)
