"""Fixtures: a router app in front of in-process fake workers (tests/support/fake_worker.py), and
two real tiny workers in process. The real SmolLM2 worker processes that the slow end-to-end
tests share are in fleet/conftest.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import BreakerConfig, RouterConfig
from services.router.state import STATE_KEY, RouterState
from tests.support.fake_worker import FakeWorker

TINY_READY_S = 60.0  # six SmolLM2 loads at once on a loaded 2-core machine


@dataclasses.dataclass
class Mesh:
    client: TestClient
    workers: list[FakeWorker]

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    @property
    def state(self) -> RouterState:
        return self.client.app[STATE_KEY]

    def role(self, role: str) -> list[FakeWorker]:
        return [w for w in self.workers if w.role == role]

    async def metadata(self) -> dict[str, Any]:
        resp = await self.client.get("/v1/router/metadata")
        assert resp.status == 200
        return await resp.json()

    async def health_round(self) -> None:
        await self.state.rt.checker.check_all()

    async def wait_servable(self, timeout: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while (await self.client.get("/health")).status != 200:
            assert asyncio.get_running_loop().time() < deadline, "router never became servable"
            await asyncio.sleep(0.02)


MeshFactory = Callable[..., Awaitable[Mesh]]


def router_config(workers: list[FakeWorker], **overrides: Any) -> RouterConfig:
    urls = {role: tuple(w.url for w in workers if w.role == role)
            for role in ("prefill", "decode", "mixed")}
    base = RouterConfig(
        prefill_urls=urls["prefill"], decode_urls=urls["decode"], mixed_urls=urls["mixed"],
        health_interval_s=0.05, health_timeout_s=1.0,
        breaker=BreakerConfig(failures=3, window_s=10.0, cooldown_s=60.0, successes=1))
    return dataclasses.replace(base, **overrides)


@pytest.fixture
async def make_mesh() -> AsyncIterator[MeshFactory]:
    created: list[Mesh] = []

    async def make(workers: list[FakeWorker], *, wait: bool = True, **overrides: Any) -> Mesh:
        for w in workers:
            if w.server is None:
                await w.start()
        client = TestClient(TestServer(create_app(router_config(workers, **overrides)),
                                       host="127.0.0.1"))
        await client.start_server()
        mesh = Mesh(client, workers)
        created.append(mesh)
        if wait:
            await mesh.wait_servable()
        return mesh

    yield make
    for mesh in created:
        await mesh.client.close()
        for w in mesh.workers:
            await w.close()


@pytest.fixture
async def tiny_workers(make_checkpoint: Callable[..., Any]) -> AsyncIterator[list[TestClient]]:
    """Two real mixed workers in process on the tiny random model (fp32, served as "tiny"),
    healthy; a test may break their engines (runner.fault_hook)."""
    from services.worker.app import create_app as create_worker
    from services.worker.config import WorkerConfig
    from shared.config import EngineConfig

    engine = EngineConfig(model=str(make_checkpoint(preset="tiny", seed=0)), dtype="float32",
                          kv_cache_memory_bytes=8 << 20, num_threads=1, max_model_len=256)
    clients = []
    for _ in range(2):
        app = create_worker(WorkerConfig(engine=engine, served_model_names=("tiny",)))
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
    for client in clients:
        for _ in range(int(TINY_READY_S / 0.05)):
            if (await client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("a tiny worker never became healthy")
    yield clients
    for client in clients:
        await client.close()
