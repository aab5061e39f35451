"""What `--disagg-min-tokens auto` learns on this box, and whether its break-even holds.

One pull prefill and one decode `pdmesh serve` (SmolLM2-135M bf16, one torch thread each) and
three routers in front of them: `auto`, `0` (every prompt disaggregated) and a huge fixed
threshold (every prompt served whole on the decode worker).
1. Learning: `--rounds` requests of cycling prompt lengths through the `auto` router; the
   estimate (p, a, x, B and the threshold) is read back from /v1/router/metadata.
2. Check: while one long greedy stream decodes on the decode worker (the batch a local
   prefill stalls), probes of several prompt lengths go through the always-P/D and the
   always-whole routers. For each: the probe's latency, and the background stream's longest
   gap between two tokens during the probe (the stall the model charges to serving whole).

    .venv/bin/python benchmarks/disagg_threshold.py [--rounds 30] [--lengths 8,32,128,512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
LEARN_LENGTHS = (24, 48, 96, 192, 384)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child on a fresh port, logging to a temp file; `ready` polls `probe`."""

    def __init__(self, name: str, argv: list[str], port: int) -> None:
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"disagg-{name}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

    async def ready(self, session: aiohttp.ClientSession, probe: str) -> None:
        for _ in range(2400):
            try:
                async with session.get(self.url + probe) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            await asyncio.sleep(0.25)
        raise TimeoutError(f"{self.name} never became ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.log.close()


def worker(role: str) -> Proc:
    port = _port()
    return Proc(role, ["serve", "--model", MODEL, "--role", role, "--port", str(port),
                       "--dtype", "bfloat16", "--threads", "1", "--log-level", "WARNING",
                       "--transfer-mode", "pull", "--kv-port", str(_port())], port)


def router(name: str, threshold: str, prefill: Proc, decode: Proc) -> Proc:
    port = _port()
    return Proc(name, ["router", "--port", str(port), "--prefill", prefill.url, "--decode",
                       decode.url, "--disagg-min-tokens", threshold, "--health-interval",
                       "0.5"], port)


def body(rng: random.Random, length: int, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": [rng.randrange(100, 40000) for _ in range(length)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


async def complete(session: aiohttp.ClientSession, url: str, doc: dict) -> dict[str, Any]:
    start = time.monotonic()
    async with session.post(url + "/v1/completions", json=doc) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data}")
        phases = json.loads(resp.headers.get("x-pdmesh-phases", "{}"))
    return {"seconds": time.monotonic() - start, "decision": phases.get("decision")}


async def background(session: aiohttp.ClientSession, url: str, doc: dict,
                     stamps: list[float]) -> None:
    """One long stream straight to the decode worker; `stamps`: when each chunk arrived."""
    async with session.post(url + "/v1/completions", json=doc) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())


def max_gap(stamps: list[float], start: float, end: float) -> float:
    inside = [t for t in stamps if start <= t <= end + 0.5]
    before = [t for t in stamps if t < start][-1:]
    ts = before + inside
    return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=float("nan"))


async def check(session: aiohttp.ClientSession, decode: Proc, routers: dict[str, Proc],
                lengths: list[int], rng: random.Random) -> list[dict[str, Any]]:
    stamps: list[float] = []
    bg = asyncio.create_task(background(session, decode.url, body(rng, 16, 4000, True),
                                        stamps))
    rows = []
    try:
        while len(stamps) < 10:  # the background stream is decoding
            await asyncio.sleep(0.05)
        for length in lengths:
            for path in ("pd", "whole", "pd", "whole"):
                start = time.monotonic()
                got = await complete(session, routers[path].url, body(rng, length, 4))
                rows.append({"length": length, "path": path, **got,
                             "bg_max_gap_s": max_gap(stamps, start, time.monotonic())})
                await asyncio.sleep(0.3)
    finally:
        bg.cancel()
        await asyncio.gather(bg, return_exceptions=True)
    return rows


async def run(rounds: int, lengths: list[int]) -> dict[str, Any]:
    rng = random.Random(0)
    prefill, decode = worker("prefill"), worker("decode")
    procs = [prefill, decode]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            for p in (prefill, decode):
                await p.ready(s, "/v1/metadata")
            routers = {"auto": router("auto", "auto", prefill, decode),
                       "pd": router("pd", "0", prefill, decode),
                       "whole": router("whole", "1000000", prefill, decode)}
            procs += routers.values()
            for r in routers.values():
                await r.ready(s, "/health")
            for i in range(rounds):
                await complete(s, routers["auto"].url,
                               body(rng, LEARN_LENGTHS[i % len(LEARN_LENGTHS)], 4))
            async with s.get(routers["auto"].url + "/v1/router/metadata") as resp:
                learned = (await resp.json())["router"]["disagg_threshold"]
            print("learned:", json.dumps(learned), flush=True)
            rows = await check(s, decode, routers, lengths, rng)
    finally:
        for p in procs:
            p.stop()
    return {"learned": learned, "check": rows}


def report(result: dict[str, Any]) -> None:
    est = result["learned"]
    print(f"threshold {est['threshold_tokens']} tokens ({est['source']}): "
          f"p={est['prefill_s_per_token']} s/token, a={est['prefill_overhead_s']} s, "
          f"x={est['transfer_s_per_token']} s/token, B={est['decode_batch']}")
    print(" length  path   probe_s  bg_max_gap_s")
    for row in result["check"]:
        print(f" {row['length']:6d}  {row['path']:5s}  {row['seconds']:7.3f}  "
              f"{row['bg_max_gap_s']:7.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--lengths", default="8,32,128,512")
    args = ap.parse_args()
    result = asyncio.run(run(args.rounds, [int(v) for v in args.lengths.split(",")]))
    report(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
