"""Decode on the serving engine thread against the same engine on the main thread, one run.

    .venv/bin/python benchmarks/engine_thread.py [--threads 2] [--tokens 160] [--rounds 2]
        [--reps 3] [--quantization mxfp4] [--json OUT.json]

A worker decodes on its engine thread (shared/engine/async_engine.py), while other threads
(KV transfer's digests; before 2026-12-06, the model loader) run parallel torch ops too. Every such thread keeps an OpenMP
pool, and once a process has more OpenMP threads than CPUs libgomp stops spinning at its
barriers: a waiter sleeps on a futex and the last arrival wakes it. The decode team crosses
~180 barriers a step, so it has its own spinning barrier (kernels/dense/csrc/decode_team.cpp).
This script shows what the serving thread gets: single-stream decode tok/s of one LLMEngine
stepped on the main thread (the only OpenMP master, as an offline script has it) and through
an AsyncEngine (stepped on its engine thread, as `pdmesh serve` runs it), each in fresh
processes alternating ABBA, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.config import EngineConfig  # noqa: E402
from shared.engine.async_engine import AsyncEngine  # noqa: E402
from shared.engine.engine import LLMEngine  # noqa: E402
from shared.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT = list(range(1000, 1016))  # 16 plain-text token ids of SmolLM2's vocabulary


def params(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def main_thread_rate(engine: LLMEngine, tokens: int, rid: str) -> float:
    engine.add_request(rid, PROMPT, params(tokens))
    times = []
    while engine.has_unfinished_requests():
        if engine.step():
            times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


async def engine_thread_rate(engine: AsyncEngine, tokens: int, rid: str) -> float:
    times = [time.perf_counter() async for _ in engine.generate(rid, PROMPT, params(tokens))]
    return (len(times) - 1) / (times[-1] - times[0])


def side(args: argparse.Namespace) -> list[float]:
    """One process's rates: `main` steps an LLMEngine on the main thread (its only OpenMP
    master); `engine` runs an AsyncEngine (its engine thread loads, warms up and steps it,
    as `pdmesh serve` runs it)."""
    config = EngineConfig(dtype="bfloat16", num_threads=args.threads,
                          quantization=args.quantization, enable_prefix_caching=False)
    if args.side == "main":
        engine = LLMEngine.from_config(config)
        engine.warmup()
        return [main_thread_rate(engine, args.tokens, f"r{i}") for i in range(args.reps)]

    async def serve() -> list[float]:
        serving = AsyncEngine(config)
        await serving.start()
        try:
            return [await engine_thread_rate(serving, args.tokens, f"r{i}")
                    for i in range(args.reps)]
        finally:
            await serving.shutdown()

    return asyncio.run(serve())


def child(args: argparse.Namespace, which: str) -> list[float]:
    argv = [sys.executable, __file__, "--side", which, "--threads", str(args.threads),
            "--tokens", str(args.tokens), "--reps", str(args.reps)]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=2, help="fresh process pairs, order ABBA")
    p.add_argument("--reps", type=int, default=3, help="decodes per process")
    p.add_argument("--quantization", default=None, choices=["mxfp4"])
    p.add_argument("--side", choices=["main", "engine"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.side:
        print(json.dumps(side(args)))
        return
    rates: dict[str, list[float]] = {"main": [], "engine": []}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for which in ("main", "engine") if r % 2 == 0 else ("engine", "main"):
            rates[which] += child(args, which)
            print(f"round {r} {which}: {' '.join(f'{x:.1f}' for x in rates[which][-args.reps:])}"
                  " tok/s", flush=True)
    load.append(os.getloadavg()[0])
    m, t = statistics.median(rates["main"]), statistics.median(rates["engine"])
    print(f"median: main thread {m:.1f} tok/s, serving engine thread {t:.1f} tok/s, "
          f"engine thread / main thread {t / m:.2f}x (load {load[0]:.2f} -> {load[1]:.2f})")
    if args.json:
        args.json.write_text(json.dumps({
            "threads": args.threads, "quantization": args.quantization, "tokens": args.tokens,
            "main_thread_tok_s": m, "engine_thread_tok_s": t, "ratio": t / m, "rates": rates,
            "load_average": load}, indent=2))


if __name__ == "__main__":
    main()
