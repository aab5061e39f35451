"""Router overhead: the same requests through the router and straight to the worker(s), side by side.

Four paths in one run, requests interleaved so drift hits all of them alike:
  pd/router     the router running pull-mode P/D (prefill leg, then decode leg)
  pd/direct     this client doing the same two legs itself (prefill max_tokens=1, then decode)
  mixed/router  a second router in front of one mixed worker
  mixed/direct  that mixed worker
For each: non-streamed latency (median, p99), streamed TTFT and inter-token latency (median,
p99); "added" = router minus direct. Every process (routers, workers, this client) is separate.

    .venv/bin/python benchmarks/router.py                      # fake workers (tests/router/)
    .venv/bin/python benchmarks/router.py [--prefill URL --decode URL] [--mixed URL] --model M
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from shared.protocol.pd import PrefillLegParams

PULL_PREFILL = PrefillLegParams().to_wire()  # the prefill leg of a pull P/D request

ROOT = Path(__file__).resolve().parents[1]
FAKE_SERVE = "tests.support.fake_serve"  # run with -m from ROOT


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_fakes(token_delay: float, procs: list) -> dict[str, str]:
    urls = {}
    for role in ("prefill", "decode", "mixed"):
        port = _port()
        procs.append(_spawn([sys.executable, "-m", FAKE_SERVE, "--model", "fake-model",
                             "--role", role, "--transfer-mode", "pull", "--host", "127.0.0.1",
                             "--port", str(port), "--fake-token-delay", str(token_delay)]))
        urls[role] = f"http://127.0.0.1:{port}"
    return urls


def start_router(flags: list[str], procs: list) -> str:
    port = _port()
    procs.append(_spawn([sys.executable, "-m", "services.cli", "router", "--port", str(port),
                         "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                         "--log-level", "WARNING", *flags]))
    return f"http://127.0.0.1:{port}"


async def wait_healthy(session: aiohttp.ClientSession, urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not become healthy")
            await asyncio.sleep(0.2)


async def _events(resp: aiohttp.ClientResponse) -> list[float]:
    """Arrival time of every SSE event carrying text."""
    times = []
    async for line in resp.content:
        if line.startswith(b"data: {") and b'"text": ""' not in line and b'"text":""' not in line:
            times.append(time.perf_counter())
    return times


class Paths:
    """The four ways to run one request; each returns (latency) or (ttft, itls)."""

    def __init__(self, session: aiohttp.ClientSession, urls: dict[str, str], model: str) -> None:
        self.s = session
        self.urls = urls
        self.model = model

    async def _post(self, url: str, body: dict) -> dict:
        async with self.s.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def once(self, name: str, body: dict) -> float:
        start = time.perf_counter()
        if name == "pd/direct":
            pre = await self._post(self.urls["prefill"], {
                **body, "max_tokens": 1, "kv_transfer_params": PULL_PREFILL})
            await self._post(self.urls["decode"], {
                **body, "kv_transfer_params": pre.get("kv_transfer_params")})
        else:
            await self._post(self.urls[name], body)
        return time.perf_counter() - start

    async def stream(self, name: str, body: dict) -> tuple[float, list[float]]:
        body = {**body, "stream": True}
        start = time.perf_counter()
        url, skip = self.urls.get(name), 0
        if name == "pd/direct":
            pre = await self._post(self.urls["prefill"], {
                **body, "stream": False, "max_tokens": 1,
                "kv_transfer_params": PULL_PREFILL})
            first = time.perf_counter()  # the client holds the first token now
            body = {**body, "kv_transfer_params": pre.get("kv_transfer_params")}
            url, skip = self.urls["decode"], 1
        async with self.s.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            times = (await _events(resp))[skip:]
        if name == "pd/direct":
            times = [first, *times]
        return times[0] - start, [b - a for a, b in zip(times, times[1:], strict=False)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def measure(paths: Paths, names: list[str], args: argparse.Namespace) -> dict:
    lat = {n: [] for n in names}
    ttft = {n: [] for n in names}
    itl = {n: [] for n in names}
    words = " ".join(f"w{i}" for i in range(args.prompt_words))
    for i in range(args.warmup + args.requests):
        body = {"model": paths.model, "prompt": f"{i} {words}", "max_tokens": args.max_tokens,
                "ignore_eos": True, "temperature": 0}
        for name in names:
            latency = await paths.once(name, body)
            first, gaps = await paths.stream(name, body)
            if i >= args.warmup:
                lat[name].append(latency)
                ttft[name].append(first)
                itl[name].extend(gaps)
    return {n: {"latency_ms": _summary(lat[n]), "ttft_ms": _summary(ttft[n]),
                "itl_ms": _summary(itl[n])} for n in names}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values) * 1000, 3),
            "p99": round(_pct(values, 99) * 1000, 3), "n": len(values)}


def report(results: dict) -> None:
    print(f"{'path':<14}{'latency p50':>12}{'p99':>9}{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}"
          "   (ms)")
    for name, r in results.items():
        print(f"{name:<14}{r['latency_ms']['median']:>12.2f}{r['latency_ms']['p99']:>9.2f}"
              f"{r['ttft_ms']['median']:>10.2f}{r['itl_ms']['median']:>9.2f}"
              f"{r['itl_ms']['p99']:>9.2f}")
    for kind in ("pd", "mixed"):
        via, direct = results.get(f"{kind}/router"), results.get(f"{kind}/direct")
        if via and direct:
            added = {m: {s: round(via[m][s] - direct[m][s], 3) for s in ("median", "p99")}
                     for m in ("latency_ms", "ttft_ms", "itl_ms")}
            results[f"{kind}/added"] = added
            print(f"{kind + ' added':<14}{added['latency_ms']['median']:>12.2f}"
                  f"{added['latency_ms']['p99']:>9.2f}{added['ttft_ms']['median']:>10.2f}"
                  f"{added['itl_ms']['median']:>9.2f}{added['itl_ms']['p99']:>9.2f}")


async def run(args: argparse.Namespace) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        if args.prefill or args.mixed:
            urls = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode),
                                      ("mixed", args.mixed)) if v}
        else:
            urls = start_fakes(args.token_delay, procs)
        names = []
        if "prefill" in urls:
            urls["pd/router"] = start_router(["--prefill", urls["prefill"],
                                              "--decode", urls["decode"]], procs)
            names += ["pd/router", "pd/direct"]
        if "mixed" in urls:
            urls["mixed/router"] = start_router(["--worker", urls["mixed"]], procs)
            urls["mixed/direct"] = urls["mixed"]
            names += ["mixed/router", "mixed/direct"]
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, [u for n, u in urls.items() if n != "mixed/direct"],
                               args.ready_timeout)
            results = await measure(Paths(session, urls, args.model), names, args)
        report(results)
        return results
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", help="real prefill worker URL (default: fake workers)")
    parser.add_argument("--decode", help="real decode worker URL")
    parser.add_argument("--mixed", help="real mixed worker URL")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--token-delay", type=float, default=0.005, help="fake workers' ITL (s)")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--save", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if bool(args.prefill) != bool(args.decode):
        parser.error("--prefill and --decode go together")
    results = asyncio.run(run(args))
    if args.save:
        args.save.write_text(json.dumps({"args": vars(args) | {"save": str(args.save)},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
