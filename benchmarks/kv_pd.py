"""P/D against a mixed worker on SmolLM2 (bf16): TTFT and total latency in pull and push
mode, and how much push overlaps the transfer with the prompt's compute.

Five `pdmesh serve` processes on 127.0.0.1 (mixed; pull prefill + decode; push prefill +
decode), one torch thread each, the same chunked-prefill budget everywhere (`--chunk`, so a
2,000-token prompt is computed over several steps and push can stream its blocks). Requests
are interleaved across the three paths, each with a fresh random prompt (no prefix-cache
hits). This client plays the router:
  mixed  one streamed request: TTFT = first token chunk, total = end of stream;
  pull   prefill leg (max_tokens 1) then decode leg: TTFT = prefill answer, total = decode's;
  push   both legs at once with one transfer id: TTFT = prefill answer, total = decode's.
Overlap (push): blocks written before the prompt finished / all blocks, and the transfer time
left exposed after it (`push_overlap` in the prefill's kv_transfer_params); the pull decode's
own transfer time (x-pdmesh-phases kv_transfer_ms) is shown next to it.

    .venv/bin/python benchmarks/kv_pd.py [--iters 2] [--tokens 2000] [--chunk 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from shared.protocol.pd import PrefillLegParams, PushDecodeParams, TransferMode

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
PATH = "/v1/completions"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, role: str, chunk: int, mode: str | None = None) -> None:
        self.port = _port()
        argv = [sys.executable, "-m", "services.worker", "--model", MODEL, "--role", role,
                "--port", str(self.port), "--dtype", "bfloat16", "--threads", "1",
                "--max-num-batched-tokens", str(chunk), "--log-level", "WARNING"]
        if mode is not None:
            argv += ["--transfer-mode", mode, "--kv-port", str(_port())]
        self.log = tempfile.NamedTemporaryFile(prefix=f"kv_pd-{role}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    async def ready(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        for _ in range(1200):
            try:
                async with session.get(self.url + "/v1/metadata") as resp:
                    if resp.status == 200:
                        return await resp.json()
            except aiohttp.ClientConnectionError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker on {self.port} exited; see {self.log.name}")
            await asyncio.sleep(0.25)
        raise TimeoutError(f"worker on {self.port} never became ready")

    def stop(self) -> None:
        if self.proc.poll() is None:  # a worker that died keeps its log for the error above
            self.proc.terminate()
            self.proc.wait(20)
            Path(self.log.name).unlink(missing_ok=True)
        self.log.close()


async def _json(session: aiohttp.ClientSession, url: str,
                body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    async with session.post(url + PATH, json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data}")
        return data, json.loads(resp.headers.get("x-pdmesh-phases", "{}"))


async def mixed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict:
    start, first = time.perf_counter(), None
    async with session.post(url + PATH, json={**body, "stream": True}) as resp:
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    assert first is not None
    return {"ttft": first - start, "total": time.perf_counter() - start}


async def pull(session: aiohttp.ClientSession, p: str, d: str, body: dict[str, Any]) -> dict:
    start = time.perf_counter()
    pre, _ = await _json(session, p, {**body, "max_tokens": 1,
                                      "kv_transfer_params": PrefillLegParams().to_wire()})
    ttft = time.perf_counter() - start
    _, phases = await _json(session, d, {**body, "kv_transfer_params": pre["kv_transfer_params"]})
    return {"ttft": ttft, "total": time.perf_counter() - start,
            "transfer_ms": phases["kv_transfer_ms"]}


async def push(session: aiohttp.ClientSession, p: str, d: str, meta: dict[str, Any],
               body: dict[str, Any]) -> dict:
    tid = uuid.uuid4().hex
    to_p = PrefillLegParams(TransferMode.PUSH, tid).to_wire()
    to_d = PushDecodeParams(tid, meta["kv_host"], meta["kv_port"], meta["engine_id"]).to_wire()
    start, stamps = time.perf_counter(), {}

    async def leg(url: str, leg_body: dict[str, Any]) -> dict[str, Any]:
        answer, _ = await _json(session, url, leg_body)
        stamps[url] = time.perf_counter() - start
        return answer

    pre, _ = await asyncio.gather(
        leg(p, {**body, "max_tokens": 1, "kv_transfer_params": to_p}),
        leg(d, {**body, "kv_transfer_params": to_d}))
    overlap = pre["kv_transfer_params"]["push_overlap"]
    return {"ttft": stamps[p], "total": stamps[d],
            "early_fraction": overlap["early_blocks"] / overlap["blocks"],
            "exposed_ms": overlap["exposed_ms"]}


def summary(rows: list[dict]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


async def run(iters: int, tokens: int, chunk: int, max_tokens: int) -> dict[str, dict]:
    # The first worker builds the native kernels once; the others start from that cache.
    workers = {"mixed": Worker("mixed", chunk)}
    rng = random.Random(0)
    out: dict[str, list[dict]] = {"mixed": [], "P/D pull": [], "P/D push": []}
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await workers["mixed"].ready(s)
            workers.update(pull_p=Worker("prefill", chunk, "pull"),
                           pull_d=Worker("decode", chunk, "pull"),
                           push_p=Worker("prefill", chunk, "push"),
                           push_d=Worker("decode", chunk, "push"))
            metas = {n: await w.ready(s) for n, w in workers.items()}
            u = {n: w.url for n, w in workers.items()}
            for i in range(iters + 1):  # round 0 warms every path up: not counted
                def body() -> dict[str, Any]:
                    return {"model": MODEL, "prompt": [rng.randrange(100, 40000)
                                                       for _ in range(tokens)],
                            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                one = {"mixed": await mixed(s, u["mixed"], body()),
                       "P/D pull": await pull(s, u["pull_p"], u["pull_d"], body()),
                       "P/D push": await push(s, u["push_p"], u["push_d"], metas["push_p"],
                                              body())}
                print(f"round {i}: " + json.dumps(one), flush=True)
                for name, row in one.items():
                    out[name] += [row] if i else []
    finally:
        for w in workers.values():
            w.stop()
    return {name: summary(rows) for name, rows in out.items()}


def report(results: dict[str, dict], tokens: int, chunk: int, max_tokens: int) -> None:
    print(f"P/D vs mixed, SmolLM2-135M bf16, {tokens}-token prompts, {max_tokens} output "
          f"tokens, prefill chunk {chunk} tokens, 1 thread per worker (medians):")
    for name, r in results.items():
        extra = ""
        if "transfer_ms" in r:
            extra = f"; KV transfer {r['transfer_ms']:.1f} ms (after the prompt)"
        if "early_fraction" in r:
            extra = (f"; {r['early_fraction']:.0%} of blocks written before the prompt "
                     f"finished, {r['exposed_ms']:.1f} ms of transfer left after it")
        print(f"  {name:9s} TTFT {r['ttft'] * 1000:7.1f} ms, total {r['total'] * 1000:7.1f} ms"
              f"{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    results = asyncio.run(run(args.iters, args.tokens, args.chunk, args.max_tokens))
    report(results, args.tokens, args.chunk, args.max_tokens)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
