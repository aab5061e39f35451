"""Start-up, SIGTERM drain and exit codes: in-process with the fake engine, and the real
`pdmesh serve` process on the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from services.common.runner import serve_until_signalled
from services.worker.app import create_app
from tests.support.fake_engine import FakeEngine
from tests.support.net import free_port
from tests.support.worker import factory_for, worker_config


async def wait_status(session: aiohttp.ClientSession, url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(url) as resp:
                if resp.status == status:
                    return
        except aiohttp.ClientConnectionError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        await asyncio.sleep(0.05)


async def test_sigterm_drains_in_flight_then_exits_0() -> None:
    engine = FakeEngine(gate=asyncio.Event())
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(serve_until_signalled(
        create_app(worker_config(), factory_for(engine)), "127.0.0.1", port, grace_seconds=10))
    async with aiohttp.ClientSession() as session:
        await wait_status(session, f"{base}/health", 200, 10)
        body = {"prompt": "hi", "max_tokens": 3}
        in_flight = asyncio.create_task(session.post(f"{base}/v1/completions", json=body))
        for _ in range(500):  # until the request is in the engine, as in the test below
            if engine.blocks:
                break
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.1)
        async with session.post(f"{base}/v1/completions", json=body) as late:
            assert late.status == 503
            assert (await late.json())["error"]["code"] == "draining"
        async with session.get(f"{base}/health") as health:
            assert health.status == 503
        engine.gate.set()
        first = await in_flight
        assert first.status == 200 and (await first.json())["usage"]["completion_tokens"] == 3
        assert await asyncio.wait_for(server, 10) == 0
    assert not engine.started, "the engine is shut down on exit"


async def test_grace_period_expiry_aborts_and_exits_0() -> None:
    engine = FakeEngine(gate=asyncio.Event())  # never opened: the request cannot finish
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(serve_until_signalled(
        create_app(worker_config(), factory_for(engine)), "127.0.0.1", port, grace_seconds=0.3))
    async with aiohttp.ClientSession() as session:
        await wait_status(session, f"{base}/health", 200, 10)
        stuck = asyncio.create_task(session.post(f"{base}/v1/completions", json={"prompt": "hi"}))
        for _ in range(500):  # until the request holds blocks (a fixed sleep raced a busy CI)
            if engine.blocks:
                break
            await asyncio.sleep(0.01)
        assert engine.blocks
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(server, 10) == 0
        stuck.cancel()
    assert engine.blocks == {}, "the cut-off request was aborted and its blocks freed"


class BrokenEngine(FakeEngine):
    async def start(self) -> None:
        raise RuntimeError("weights missing")


async def test_load_failure_exits_1() -> None:
    port = free_port()
    app = create_app(worker_config(), factory_for(BrokenEngine()))
    assert await asyncio.wait_for(serve_until_signalled(app, "127.0.0.1", port, 1.0), 10) == 1


def test_pdmesh_serve_process_drains_on_sigterm(tiny_dir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", str(tiny_dir), "--role", "mixed",
           "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", "16MiB",
           "--max-model-len", "256", "--served-model-name", "tiny", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2])
    try:
        async def scenario() -> None:
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:
                await wait_status(session, f"{base}/health", 200, 120)
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True}
                async with session.post(f"{base}/v1/completions", json=body) as resp:
                    await resp.content.readline()
                    proc.send_signal(signal.SIGTERM)
                    raw = await resp.read()
                assert raw.endswith(b"data: [DONE]\n\n")
                assert b'"finish_reason":"length"' in raw

        asyncio.run(scenario())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_bad_kv_settings() -> None:
    from services.cli import main

    assert main(["serve", "--role", "prefill", "--kv-lease-seconds", "0"]) == 2
    assert main(["serve", "--role", "decode", "--kv-port", "70000"]) == 2


@pytest.mark.parametrize("argv", [["serve", "--kv-cache-memory", "lots"], ["serve", "--max-queue", "-1"]])
def test_serve_rejects_bad_flags(argv: list[str]) -> None:
    from services.cli import main

    assert main(argv) == 2
