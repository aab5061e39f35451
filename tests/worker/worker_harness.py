"""Running the worker app in tests: in the test's loop (aiohttp TestClient) or on a thread.

Both use the production runner settings (handler cancellation on, so a client disconnect
cancels its handler) and wait for /health before returning.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.worker.app import create_app
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from shared.config import EngineConfig

API_KEY = "test-key"
MODEL = "fake-model"


def worker_config(**overrides: Any) -> WorkerConfig:
    engine = overrides.pop("engine", None) or EngineConfig(model=MODEL, max_num_seqs=8)
    values: dict[str, Any] = {"engine": engine, "served_model_names": (MODEL,),
                              "drain_grace_seconds": 5.0}
    values.update(overrides)
    return WorkerConfig(**values)


def factory_for(engine: EngineClient) -> Callable[[EngineConfig], EngineClient]:
    return lambda _config: engine


async def wait_healthy(client: TestClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        resp = await client.get("/health")
        if resp.status == 200:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker not healthy: {resp.status} {await resp.text()}")
        await asyncio.sleep(0.02)


async def start_client(config: WorkerConfig, engine: EngineClient | None = None) -> TestClient:
    """A TestClient on a fresh app (fake engine if given, else the real factory); ready."""
    app = create_app(config, factory_for(engine) if engine is not None else None)
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    await wait_healthy(client)
    return client


class ThreadedServer:
    """The app on 127.0.0.1 in a thread with its own loop, for synchronous clients (openai)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(f"{self.base_url}/health") as resp:
                    if resp.status == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError("worker not healthy")
                await asyncio.sleep(0.02)

    def start(self, timeout: float = 120.0) -> ThreadedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout)
        asyncio.run_coroutine_threadsafe(self._wait_healthy(timeout), self.loop).result(timeout + 5)
        return self

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run `fn` on the server's loop thread (to inspect or poke the engine safely)."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
