"""Memory: a worker's RSS against what it allocates for weights and KV cache.

For each configuration (bf16, and bf16 with MXFP4 weights) a `pdmesh serve` process is started
on the model; /v1/metadata says how many bytes its weights and KV cache take (`memory`). Its
RSS is read from /proc when idle after start-up, at the peak of a load (`--concurrency`
streams of `--prompt-len`-token prompts that fill the KV cache), and idle again after it:

  ratio      RSS / (weights + KV cache)                     goal <= 1.3x
  runtime    RSS of a process that imports the worker and loads the native kernels, no model
  ratio-rt   (RSS - runtime) / (weights + KV cache)          what the model side costs

The KV cache is allocated with zeros at start-up, so it is resident from the first sample;
a row over 1.3x is explained by the `runtime` column (Python, torch, the kernels) when
`ratio-rt` is near 1.0x, and is a leak or a copy to fix when it is not.

    .venv/bin/python benchmarks/memory.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

import aiohttp
import procstat
from serve import ROOT, free_port, start_server, stop_server

MiB = 2**20
# What a worker imports before it loads a model; the kernels are built and loaded as a
# worker loads them for its tier (dense bf16 and MXFP4).
RUNTIME_PROBE = ("import os, torch, aiohttp, services.worker.app, shared.engine.engine; "
                 "from kernels import dense, mxfp4; dense.kernel_path(); mxfp4.kernel_path(); "
                 "print(open(f'/proc/{os.getpid()}/statm').read().split()[1], flush=True)")


@dataclass
class Row:
    name: str
    weights_mb: float
    kv_mb: float
    idle_mb: float
    peak_mb: float
    after_mb: float


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=900, help="words per prompt (about tokens)")
    p.add_argument("--max-tokens", type=int, default=32)
    return p.parse_args()


def runtime_mb() -> float:
    out = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return int(out[-1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def rss_mb(pid: int) -> float:
    sample = procstat.sample(pid)
    if sample is None:
        raise RuntimeError(f"worker {pid} is gone")
    return sample.rss_bytes / MiB


async def _load(base: str, args: argparse.Namespace) -> None:
    words = " ".join(f"w{i}" for i in range(args.prompt_len))
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {"model": args.model, "prompt": f"{i} {words}", "max_tokens": args.max_tokens,
                    "ignore_eos": True, "temperature": 0}
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                await resp.read()

        await asyncio.gather(*(one(i) for i in range(args.concurrency)))


async def _metadata(base: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/metadata") as resp:
        return await resp.json()


def measure(name: str, extra: list[str], args: argparse.Namespace) -> Row:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", args.model, "--port",
           str(port), "--threads", str(args.threads), "--dtype", "bfloat16",
           "--kv-cache-memory", args.kv_cache_memory, "--log-level", "WARNING", *extra]
    proc = start_server(cmd, base)
    try:
        mem = asyncio.run(_metadata(base))["memory"]
        idle = rss_mb(proc.pid)
        peak, done = [idle], threading.Event()

        def watch() -> None:  # RSS every 50 ms while the load runs
            while not done.wait(0.05):
                peak[0] = max(peak[0], rss_mb(proc.pid))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        asyncio.run(_load(base, args))
        done.set()
        watcher.join()
        return Row(name, mem["weights_bytes"] / MiB, mem["kv_cache_bytes"] / MiB, idle,
                   peak[0], rss_mb(proc.pid))
    finally:
        stop_server(proc)


def report(rows: list[Row], runtime: float) -> None:
    print(f"runtime (imports + native kernels, no model): {runtime:.0f} MB")
    print("| config | weights MB | KV MB | RSS idle | RSS peak | RSS after | ratio idle | "
          "ratio peak | ratio-rt peak | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        alloc = r.weights_mb + r.kv_mb
        ratio_rt = (r.peak_mb - runtime) / alloc
        verdict = "ok" if r.peak_mb / alloc <= 1.3 else (
            "over 1.3x: the runtime" if ratio_rt <= 1.3 else "over 1.3x: the model side")
        print(f"| {r.name} | {r.weights_mb:.0f} | {r.kv_mb:.0f} | {r.idle_mb:.0f} | "
              f"{r.peak_mb:.0f} | {r.after_mb:.0f} | {r.idle_mb / alloc:.2f}x | "
              f"{r.peak_mb / alloc:.2f}x | {ratio_rt:.2f}x | {verdict} |")


def main() -> None:
    args = parse_args()
    print(f"model {args.model}, {args.threads} threads, KV budget {args.kv_cache_memory}, "
          f"load {args.concurrency} x {args.prompt_len}-word prompts; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    runtime = runtime_mb()
    rows = [measure("bf16", [], args), measure("mxfp4", ["--quantization", "mxfp4"], args)]
    report(rows, runtime)


if __name__ == "__main__":
    main()
