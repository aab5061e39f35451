"""Running the worker app in tests: in the test's loop (aiohttp TestClient), on a thread of the
test process (`WorkerThread`), or as a `pdmesh serve` child process (`SubprocessWorker`).

In-process servers use the production runner settings (handler cancellation on, so a client
disconnect cancels its handler). A `WorkerThread` has its own event loop, so one test process
can hold several engines (P/D meshes) and synchronous clients (the openai SDK) can call it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.common.limits import runner_options
from services.worker.app import create_app
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from shared.config import EngineConfig
from tests.support.net import free_port

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "fake-model"

EngineFactory = Callable[[EngineConfig], EngineClient]


def worker_config(**overrides: Any) -> WorkerConfig:
    """A fake-model worker configuration (`engine=` replaces the default EngineConfig)."""
    engine = overrides.pop("engine", None) or EngineConfig(model=MODEL, max_num_seqs=8)
    values: dict[str, Any] = {"engine": engine, "served_model_names": (MODEL,),
                              "drain_grace_seconds": 5.0}
    values.update(overrides)
    return WorkerConfig(**values)


def factory_for(engine: EngineClient) -> EngineFactory:
    return lambda _config: engine


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout: float = 120.0,
                     alive: Callable[[], bool] = lambda: True,
                     ssl_context: ssl.SSLContext | None = None) -> None:
    """Until GET `url`/health is 200; TimeoutError past `timeout` or once `alive()` is False.
    An https `url` is verified with `ssl_context`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(f"{url}/health", ssl=ssl_context or True) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        if time.monotonic() > deadline or not alive():
            raise TimeoutError(f"worker {url} never became ready")
        await asyncio.sleep(0.05)


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
    client = TestClient(TestServer(app, handler_cancellation=True, **runner_options(app)))
    await client.start_server()
    await wait_healthy(client)
    return client


class WorkerThread:
    """One worker app on 127.0.0.1 (or `host`) in a daemon thread with its own event loop.

    `start()` returns once it listens; `start(ready_timeout=...)` also waits for /health 200.
    `call` runs a function on the server's loop (to inspect or poke the engine safely) and
    `freeze` blocks that loop for a while (a stalled peer). A config with a TLS certificate
    serves HTTPS, as `pdmesh serve` does; `client_ssl` then verifies it.
    """

    def __init__(self, config: WorkerConfig, engine_factory: EngineFactory | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        self.app = create_app(config, engine_factory)
        self.loop = asyncio.new_event_loop()
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.config.tls.enabled else 'http'}://{self.host}:{self.port}"

    @property
    def client_ssl(self) -> ssl.SSLContext | None:
        """A client context trusting this worker's CA (None: plain HTTP)."""
        return self.config.tls.client_context() if self.config.tls.enabled else None

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=1.0,
                                     **runner_options(self.app))
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port,
                           ssl_context=self.config.tls.server_context())
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _wait_ready(self, timeout: float) -> None:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, self.url, timeout, ssl_context=self.client_ssl)

    def start(self, ready_timeout: float | None = None) -> WorkerThread:
        """Listening on return; with `ready_timeout`, also healthy (else call `wait_ready`)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        if ready_timeout is not None:
            asyncio.run_coroutine_threadsafe(self._wait_ready(ready_timeout),
                                             self.loop).result(ready_timeout + 5)
        return self

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run `fn` on the server's loop thread and return its result."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def freeze(self, seconds: float) -> None:
        """Block this worker's event loop (HTTP and KV service) for `seconds`: a stalled peer."""
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def start_workers(configs: dict[str, WorkerConfig], timeout: float = 120.0
                  ) -> dict[str, WorkerThread]:
    """Start one WorkerThread per configuration, all loading at once, and wait until every one
    is ready; on failure the started ones are stopped. The caller stops them (`stop_all`)."""
    workers = {name: WorkerThread(cfg).start() for name, cfg in configs.items()}

    async def ready() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_ready(session, w.url, timeout, ssl_context=w.client_ssl)
                                   for w in workers.values()))

    try:
        asyncio.run(ready())
    except BaseException:
        stop_all(workers)
        raise
    return workers


def stop_all(workers: dict[str, WorkerThread]) -> None:
    for worker in workers.values():
        worker.stop()


class SubprocessWorker:
    """`pdmesh serve ...` in its own process (so a test can SIGSTOP or SIGKILL it)."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        cmd = [sys.executable, "-m", "services.worker", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "WARNING", *args]
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
