"""Soak: `pdmesh up` under mixed load for a set time, watching every process for leaks.

The load (`--clients` loops, back to back) mixes short and long prompts, streamed and not,
clients that abort after two tokens, and n=2 requests. Every `--interval` each process of the
mesh (the router and every worker, found as children of `pdmesh up`) is sampled: RSS, open
file descriptors, asyncio tasks (`pdmesh:asyncio_tasks` on /metrics) and, for workers, KV
blocks in use. Two idle samples decide the verdict, each taken `--settle` after the load
paused and in-flight requests drained: one when warm-up ends and one at the end. Every pool
of keep-alive connections (this client's, the router's to workers, the workers' KV links) is
told to close an idle connection after `--keepalive`, so neither sample counts pooled
sockets, whose number follows the recent peak concurrency and not a leak:

  RSS drift   final / warm-up - 1, per process        goal < 5%
  fds, tasks  final - warm-up, per process             goal <= 2 (flat)
  blocks      KV blocks in use at the end, per worker  goal 0

    .venv/bin/python benchmarks/soak.py --duration 30m
    .venv/bin/python benchmarks/soak.py --duration 90s --warmup 20s --interval 10s --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import procstat
from chaos import machine
from chaos_mesh import ROOT, free_port
from chaos_traffic import Outcome, completion_body, stream_request

SHORT = "Name three colours."
LONG = "Here is a short history of the printing press and what came after it. " * 12


@dataclass
class Sample:
    """One process at one moment (None: not readable)."""

    name: str
    rss_mb: float | None
    fds: int | None
    tasks: float | None
    blocks: int | None


@dataclass
class SoakResult:
    samples: list[list[Sample]] = field(default_factory=list)  # one list per interval
    warm: list[Sample] = field(default_factory=list)
    final: list[Sample] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)


class UpMesh:
    """`pdmesh up` as a child; its processes are found through /proc (router, workers)."""

    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "services.cli", "up", "--model", args.model,
               "--prefill", "1", "--decode", "1", "--port", str(self.port), "--threads", "1",
               "--router-arg=--health-interval=0.5",
               f"--router-arg=--upstream-keepalive-seconds={args.keepalive}",
               f"--worker-arg=--kv-keepalive-seconds={args.keepalive}"]
        with log.open("ab") as out:
            self.popen = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def processes(self) -> dict[str, tuple[int, str]]:
        """name -> (pid, its HTTP URL): `router`, `prefill-<port>`, `decode-<port>`."""
        out = {}
        for pid in procstat.children(self.popen.pid):
            argv = procstat.cmdline(pid)
            port = argv[argv.index("--port") + 1] if "--port" in argv else "?"
            if "router" in argv:
                out["router"] = (pid, f"http://127.0.0.1:{port}")
            elif "--role" in argv:
                out[f"{argv[argv.index('--role') + 1]}-{port}"] = (pid,
                                                                    f"http://127.0.0.1:{port}")
        return out

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"pdmesh up exited with {self.popen.returncode}")
            try:
                async with session.get(self.url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"pdmesh up not healthy after {timeout:.0f}s")

    def stop(self) -> None:
        os.killpg(self.popen.pid, signal.SIGINT)  # `up` stops its children in order
        try:
            self.popen.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


# A sample must not wait on a stuck process: it reads as None (and fails the verdict).
_SAMPLE_TIMEOUT = aiohttp.ClientTimeout(total=10)


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    try:
        async with session.get(url + "/metrics", timeout=_SAMPLE_TIMEOUT) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


async def _blocks(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(url + "/v1/metadata", timeout=_SAMPLE_TIMEOUT) as resp:
            return (await resp.json()).get("kv_cache", {}).get("num_used_blocks")
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def sample_all(mesh: UpMesh, session: aiohttp.ClientSession) -> list[Sample]:
    out = []
    for name, (pid, url) in sorted(mesh.processes().items()):
        proc = procstat.sample(pid)
        blocks = None if name == "router" else await _blocks(session, url)
        out.append(Sample(name, round(proc.rss_bytes / 2**20, 1) if proc else None,
                          proc.open_fds if proc else None,
                          await _metric(session, url, "pdmesh:asyncio_tasks"), blocks))
    return out


def _request(rng: random.Random, i: int) -> tuple[dict[str, Any], int | None]:
    """One mixed request: (body, close after this many tokens or None)."""
    kind = rng.choice(["short", "long", "plain", "abort", "n2"])
    prompt = f"{i}: " + (LONG if kind == "long" else SHORT)
    if kind == "plain":
        return completion_body(prompt, 8, stream=False), None
    if kind == "n2":
        return completion_body(prompt, 8, stream=False, n=2), None
    return completion_body(prompt, 16), (2 if kind == "abort" else None)


async def _load(session: aiohttp.ClientSession, url: str, seed: int, running: asyncio.Event,
                stop: asyncio.Event, counts: Counter[str], active: list[int]) -> None:
    rng, i = random.Random(seed), 0
    while not stop.is_set():
        await running.wait()
        body, close_after = _request(rng, i)
        i += 1
        active[0] += 1
        try:
            out: Outcome = await stream_request(session, url, body, 120.0, close_after)
        finally:
            active[0] -= 1
        counts[out.kind.value] += 1


async def _drain(active: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while active[0] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def soak(args: argparse.Namespace, log_dir: Path) -> SoakResult:
    result, counts, active = SoakResult(), Counter[str](), [0]
    mesh = UpMesh(args, log_dir / "up.log")
    try:
        connector = aiohttp.TCPConnector(keepalive_timeout=args.keepalive)
        async with aiohttp.ClientSession(connector=connector) as session:
            await mesh.wait_ready(session, args.ready_timeout)
            running, stop = asyncio.Event(), asyncio.Event()
            running.set()
            url = mesh.url + "/v1/completions"
            loops = [asyncio.ensure_future(_load(session, url, s, running, stop, counts, active))
                     for s in range(args.clients)]
            start = time.monotonic()
            await asyncio.sleep(args.warmup)
            running.clear()
            await _drain(active, 120)
            await asyncio.sleep(args.settle)
            result.warm = await sample_all(mesh, session)
            running.set()
            while time.monotonic() - start < args.duration:
                await asyncio.sleep(min(args.interval, args.duration - (time.monotonic() - start)))
                result.samples.append(await sample_all(mesh, session))
                print(json.dumps([asdict(s) for s in result.samples[-1]]), flush=True)
            stop.set()
            await asyncio.gather(*loops)
            await asyncio.sleep(args.settle)  # leases of aborted legs expire, pools empty
            result.final = await sample_all(mesh, session)
    finally:
        mesh.stop()
    result.outcomes = dict(counts)
    result.missed = verdict(result)
    return result


def verdict(r: SoakResult) -> list[str]:
    missed = []
    warm = {s.name: s for s in r.warm}
    for s in r.final:
        w = warm.get(s.name)
        if w is None or None in (w.rss_mb, s.rss_mb):
            missed.append(f"{s.name}: not sampled at both ends (restarted?)")
            continue
        assert w.rss_mb is not None and s.rss_mb is not None
        if s.rss_mb / w.rss_mb - 1 >= 0.05:
            missed.append(f"{s.name}: RSS {w.rss_mb} -> {s.rss_mb} MB")
        for what, a, b in (("fds", w.fds, s.fds), ("asyncio tasks", w.tasks, s.tasks)):
            if a is None or b is None or b - a > 2:
                missed.append(f"{s.name}: {what} {a} -> {b}")
        if s.name != "router" and s.blocks != 0:
            missed.append(f"{s.name}: {s.blocks} KV blocks held at the end")
    for bad in ("hung", "broken"):
        if r.outcomes.get(bad):
            missed.append(f"{r.outcomes[bad]} requests {bad}")
    return missed


def duration(text: str) -> float:
    """`90`, `90s`, `30m`, `1h` -> seconds."""
    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:], None)
    return float(text[:-1]) * scale if scale else float(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--duration", type=duration, default=duration("30m"))
    p.add_argument("--warmup", type=duration, default=duration("2m"))
    p.add_argument("--interval", type=duration, default=duration("1m"))
    p.add_argument("--settle", type=duration, default=duration("35s"),
                   help="idle time before the final sample (past the KV lease, 30 s)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--keepalive", type=duration, default=duration("2s"),
                   help="idle keep-alive of every connection pool in the mesh (aiohttp closes "
                        "an idle connection within twice this; keep it under --settle / 2)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.warmup >= args.duration:
        p.error("--warmup must be shorter than --duration")
    if not 0 < 2 * args.keepalive < args.settle:
        p.error("--keepalive must be > 0 and under --settle / 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(soak(args, log_dir))
    print(json.dumps({"warm": [asdict(s) for s in result.warm],
                      "final": [asdict(s) for s in result.final],
                      "outcomes": result.outcomes, "missed": result.missed}, indent=2))
    print(f"{machine()}; logs in {log_dir}")
    return 1 if result.missed else 0


if __name__ == "__main__":
    sys.exit(main())
