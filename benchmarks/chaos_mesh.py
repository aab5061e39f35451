"""A mesh of real processes for the chaos and load benchmarks: one router, N prefills and N
decodes of one model on loopback, started as `pdmesh up` starts them (`services.cli serve` and
`services.cli router`, one random KV secret in every child's environment), with the handles a
fault injector needs: kill -9, SIGSTOP/SIGCONT, restart with other flags, and a fault-injecting
KV proxy (benchmarks/kv_proxy.py) in front of the first prefill's KV listener.

It also reads what the mesh says about itself: KV blocks in use on every worker
(/v1/metadata kv_cache.num_used_blocks) and which workers the router would route to
(/v1/router/metadata: healthy, active, breaker not open).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kv_proxy import KVProxy

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class MeshSpec:
    """What to start. `worker_flags`/`router_flags` are appended to every worker/the router."""

    model: str
    prefills: int = 2
    decodes: int = 2
    threads: int = 1
    dtype: str = "bfloat16"
    lease_s: float = 10.0
    proxy_first_prefill: bool = True
    worker_flags: tuple[str, ...] = ()
    router_flags: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0


class Proc:
    """One child (`python -m services.cli <args>`) on a fixed port, in its own process group."""

    def __init__(self, name: str, role: str, args: list[str], port: int, log_dir: Path,
                 env: dict[str, str]) -> None:
        self.name, self.role, self.args, self.port = name, role, args, port
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None
        self.extra: tuple[str, ...] = ()  # flags of the current life (restart_with)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self, extra: tuple[str, ...] = ()) -> Proc:
        self.extra = extra
        cmd = [sys.executable, "-m", "services.cli", *self.args, *extra]
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, env=self.env)
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(30)

    def stop(self) -> None:
        """SIGCONT then SIGTERM; SIGKILL after 15 s."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.popen is not None:
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


class Mesh:
    """The processes of one mesh, plus the proxy; `async with Mesh(spec, log_dir)`."""

    def __init__(self, spec: MeshSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        # One secret for the whole mesh, in the environment only (never on a command line).
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "PDMESH_KV_SECRET": secrets.token_hex(32)}
        self.workers: list[Proc] = []
        self.router: Proc | None = None
        self.proxy: KVProxy | None = None

    async def __aenter__(self) -> Mesh:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def by_role(self, role: str) -> list[Proc]:
        return [w for w in self.workers if w.role == role]

    def worker_args(self, role: str, port: int, kv_port: int, advertise: int | None) -> list[str]:
        s = self.spec
        args = ["serve", "--model", s.model, "--role", role, "--host", "127.0.0.1",
                "--port", str(port), "--threads", str(s.threads), "--dtype", s.dtype,
                "--transfer-mode", "pull", "--kv-port", str(kv_port),
                "--kv-lease-seconds", str(s.lease_s), "--log-level", "WARNING",
                "--drain-grace-seconds", "1", *s.worker_flags]
        if advertise is not None:
            args += ["--kv-advertise-port", str(advertise)]
        return args

    async def start(self) -> None:
        s = self.spec
        for role, count in (("prefill", s.prefills), ("decode", s.decodes)):
            for i in range(count):
                port, kv_port = free_port(), free_port()
                advertise = None
                if role == "prefill" and i == 0 and s.proxy_first_prefill:
                    self.proxy = await KVProxy(kv_port).start()
                    advertise = self.proxy.port
                args = self.worker_args(role, port, kv_port, advertise)
                self.workers.append(Proc(f"{role}-{i}", role, args, port, self.log_dir,
                                         self.env).start())
        rport = free_port()
        router = ["router", "--host", "127.0.0.1", "--port", str(rport), "--health-interval",
                  "0.2", "--health-timeout", "2", "--log-level", "WARNING", *s.router_flags]
        for w in self.workers:
            router += [f"--{w.role}", w.url]
        self.router = Proc("router", "router", router, rport, self.log_dir, self.env).start()
        async with aiohttp.ClientSession() as session:
            await self.wait_all_usable(session, s.ready_timeout_s)

    async def close(self) -> None:
        procs = ([self.router] if self.router else []) + self.workers
        for p in procs:
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        for p in procs:
            p.stop()
        if self.proxy is not None:
            await self.proxy.close()

    # ---- what the mesh says -------------------------------------------------------------

    async def router_usable(self, session: aiohttp.ClientSession) -> dict[str, bool]:
        """Worker URL -> whether the router would route to it now: healthy, active, breaker
        not open, and in a servable compatibility group."""
        doc = await _get_json(session, self.url + "/v1/router/metadata") or {}
        servable = {wid for g in doc.get("groups", []) if g.get("servable")
                    for role in ("prefill", "decode", "mixed") for wid in g.get(role, [])}
        return {w["url"].rstrip("/"): (w.get("health") == "healthy"
                                       and w.get("membership") == "active"
                                       and w.get("circuit_breaker") != "open"
                                       and w["id"] in servable)
                for w in doc.get("workers", [])}

    async def busiest(self, session: aiohttp.ClientSession, role: str) -> Proc:
        """The worker of `role` with the most requests of the router on it now (the first on a
        tie): the victim whose fault hits the streams in flight."""
        doc = await _get_json(session, self.url + "/v1/router/metadata") or {}
        load = {w["url"].rstrip("/"): (w.get("load") or {}).get("router_inflight", 0)
                for w in doc.get("workers", [])}
        return max(self.by_role(role), key=lambda w: load.get(w.url, 0))

    async def wait_usable(self, session: aiohttp.ClientSession, proc: Proc, usable: bool,
                          timeout: float, since: float | None = None) -> float | None:
        """Seconds (from `since`, default now) until the router's view of `proc` is `usable`;
        None if it is not within `timeout`."""
        since = time.monotonic() if since is None else since
        while time.monotonic() - since < timeout:
            if (await self.router_usable(session)).get(proc.url, False) == usable:
                return time.monotonic() - since
            await asyncio.sleep(0.05)
        return None

    async def wait_all_usable(self, session: aiohttp.ClientSession, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for p in [self.router, *self.workers]:
                if p is not None and not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.log_tail()}")
            view = await self.router_usable(session)
            if view and all(view.get(w.url) for w in self.workers):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"mesh not ready after {timeout:.0f}s: {view}")
            await asyncio.sleep(0.2)

    async def used_blocks(self, session: aiohttp.ClientSession) -> dict[str, int | None]:
        """Worker name -> KV blocks in use (None: no answer)."""
        docs = await asyncio.gather(*(_get_json(session, w.url + "/v1/metadata")
                                      for w in self.workers))
        return {w.name: (d or {}).get("kv_cache", {}).get("num_used_blocks") if d else None
                for w, d in zip(self.workers, docs, strict=True)}

    async def wait_blocks_freed(self, session: aiohttp.ClientSession,
                                timeout: float) -> tuple[dict[str, int | None], float]:
        """Poll until every worker reports 0 blocks in use (or `timeout`); the last reading and
        the seconds it took."""
        start = time.monotonic()
        while True:
            blocks = await self.used_blocks(session)
            if all(b == 0 for b in blocks.values()) or time.monotonic() - start > timeout:
                return blocks, time.monotonic() - start
            await asyncio.sleep(0.25)


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
