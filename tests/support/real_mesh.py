"""Real processes for the router's end-to-end tests: `pdmesh serve` workers on the embedded
SmolLM2 and `pdmesh router`, all on loopback ports.

`Service` is one child process (`python -m services.cli <command> ... --port P`) that keeps its
port, so a test can SIGKILL it and restart it on the same address, or freeze it (SIGSTOP).
`Fleet` is the set of workers every real-process router test shares: started once per session,
all at once (each load is ~10 s of CPU), by the `fleet` fixture in conftest.py. Each test module
starts its own routers in front of the workers it needs (a router starts in about a second).
A test that kills or freezes a shared worker restores it before it ends.

Readiness polling comes from tests.support.worker; block accounting and the client side from
tests.support.pd.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.net import free_port
from tests.support.worker import wait_ready

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
ADMIN_TOKEN = "admin-secret"
# fp32, not the bf16 that `--dtype auto` picks on a CPU with a native tier: these tests compare
# greedy text across workers and prefix-cache states token for token, and in bf16 a cached
# prefix moves prompt rows from torch's GEMM to the GEMV, whose rounding can flip a near-tie.
WORKER_FLAGS = ("--threads", "1", "--kv-cache-memory", "32MiB", "--log-level", "WARNING",
                "--drain-grace-seconds", "1", "--dtype", "float32")
# Short health rounds so failures and recoveries are seen within a fraction of a second.
ROUTER_FLAGS = ("--health-interval", "0.2", "--health-timeout", "2", "--admin-token",
                ADMIN_TOKEN, "--log-level", "WARNING", "--drain-grace-seconds", "1")


class Service:
    """One `pdmesh <command>` child process on a fixed loopback port (own process group)."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Service:
        cmd = [sys.executable, "-m", "services.cli", *self.args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        with self.log_path.open("ab") as log:  # appended: a restart keeps the first life's log
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout: float) -> None:
        """Until GET /health is 200 (a router: some group is servable)."""
        try:
            await wait_ready(session, self.url, timeout, alive=self.alive)
        except TimeoutError as exc:
            raise AssertionError(f"{self.name} never became healthy:\n{self.log_tail()}") from exc

    async def first_start(self, session: aiohttp.ClientSession, timeout: float,
                          tries: int = 3) -> None:
        """Start and wait until healthy, on a fresh port when the one picked was taken in the
        meantime: workers started together bind `--kv-port 0`, and the OS may hand one of
        them a port picked (free then) for another's HTTP server."""
        for attempt in range(tries):
            if attempt:
                self.port = free_port()
            self.start()
            try:
                await self.wait_healthy(session, timeout)
                return
            except AssertionError:
                if self.alive() or "address already in use" not in self.log_tail():
                    raise
        raise AssertionError(f"{self.name}: no free port in {tries} tries:\n{self.log_tail()}")

    def _signal(self, sig: signal.Signals) -> None:
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP: the socket still accepts connections, nothing answers."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def restart(self) -> Service:
        """Kill (if alive) and start again on the same port, with the same flags."""
        self.kill()
        return self.start()

    def terminate(self) -> None:
        """SIGTERM (after SIGCONT, should it be frozen); `stop` also waits for the exit."""
        self.thaw()
        self._signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        if self.proc is not None:
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def worker(name: str, role: str, log_dir: Path, mode: str = "pull") -> Service:
    args = ["serve", "--model", MODEL, "--role", role, *WORKER_FLAGS]
    if role != "mixed":
        args += ["--transfer-mode", mode, "--kv-port", "0"]
    return Service(name, args, log_dir)


@dataclass
class Fleet:
    """The shared workers: one mixed, a pull pair, a push pair, and a spare pull prefill."""

    mixed: Service
    prefill: Service
    decode: Service
    push_prefill: Service
    push_decode: Service
    spare_prefill: Service  # the kill test's victim

    @staticmethod
    def create(log_dir: Path) -> Fleet:
        return Fleet(mixed=worker("mixed", "mixed", log_dir),
                     prefill=worker("prefill", "prefill", log_dir),
                     decode=worker("decode", "decode", log_dir),
                     push_prefill=worker("push-prefill", "prefill", log_dir, "push"),
                     push_decode=worker("push-decode", "decode", log_dir, "push"),
                     spare_prefill=worker("spare-prefill", "prefill", log_dir))

    @property
    def services(self) -> list[Service]:
        return list(vars(self).values())

    def start(self, timeout: float) -> Fleet:
        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(s.first_start(session, timeout) for s in self.services))

        asyncio.run(ready())
        return self

    def stop(self) -> None:
        for service in self.services:  # all drain at once
            service.terminate()
        for service in self.services:
            service.stop()


async def _router_up(router: Service, servable: bool, timeout: float) -> None:
    """Until /health is 200 or, unless `servable`, until /live answers."""
    async with aiohttp.ClientSession() as session:
        if servable:
            await router.wait_healthy(session, timeout)
        else:
            await until(lambda: has_status(session, router.url + "/live", 200), timeout,
                        f"{router.name} never answered /live:\n{router.log_tail()}")


@contextmanager
def running_router(name: str, log_dir: Path, *flags: str, servable: bool = True,
                   timeout: float = 60.0) -> Iterator[Service]:
    """A `pdmesh router` process with ROUTER_FLAGS plus `flags` (for module fixtures); waits
    for /health 200 unless `servable` is False (then only for /live)."""
    router = Service(name, ["router", *ROUTER_FLAGS, *flags], log_dir).start()
    try:
        asyncio.run(_router_up(router, servable, timeout))
        yield router
    finally:
        router.stop()


@asynccontextmanager
async def router_in_test(name: str, log_dir: Path, *flags: str,
                         timeout: float = 60.0) -> AsyncIterator[Service]:
    """`running_router` for use inside an async test."""
    router = Service(name, ["router", *ROUTER_FLAGS, *flags], log_dir).start()
    try:
        await _router_up(router, True, timeout)
        yield router
    finally:
        router.stop()


async def has_status(session: aiohttp.ClientSession, url: str, status: int) -> bool:
    """Whether GET `url` answers `status` now (no answer: False)."""
    try:
        async with session.get(url) as resp:
            return resp.status == status
    except aiohttp.ClientError:
        return False


async def until(check: Callable[[], Awaitable[Any]], timeout: float, message: str,
                interval: float = 0.05) -> Any:
    """Poll the async `check` until it returns something truthy (returned); else fail."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message)
        await asyncio.sleep(interval)


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def metric(session: aiohttp.ClientSession, url: str, name: str,
                 labels: str = "") -> float:
    """One sample of a Prometheus text exposition (`labels` as written: `{result="x"}`), or 0."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
