"""Could the prefill and decode engines on one box lend each other threads? The three figures
that decide it, with plain torch work shaped like SmolLM2-135M steps (bf16 GEMMs: a decode
step is 30 layers of [batch, 576] x [576, 1536]-class products, a prefill chunk the same with
256 rows).

1. gain: one process alone, 1 thread vs all cores (what a lender's idle cores are worth);
2. collision: two processes busy at once, each on cores/2 threads (today's split) vs each on
   all cores (both borrowed at the same moment: oversubscribed OpenMP teams);
3. switch: the cost of `torch.set_num_threads` between two steps (what lending per step adds).

Each process runs its loop for `--seconds` and reports steps per second.

    .venv/bin/python benchmarks/thread_lending.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

HIDDEN, INTER, LAYERS = 576, 1536, 30


def _loop(threads: int, rows: int, seconds: float, start: float, out: mp.Queue) -> None:
    import torch

    torch.set_num_threads(threads)
    x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
    up = torch.randn(HIDDEN, INTER, dtype=torch.bfloat16)
    down = torch.randn(INTER, HIDDEN, dtype=torch.bfloat16)
    for _ in range(3):  # warm the team and the kernels
        (x @ up) @ down
    while time.time() < start:
        time.sleep(0.001)
    steps, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        for _ in range(LAYERS):
            (x @ up) @ down
        steps += 1
    out.put(steps / (time.perf_counter() - begin))


def together(specs: list[tuple[int, int]], seconds: float) -> list[float]:
    """Steps/s of each (threads, rows) loop, all started at the same instant."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start = time.time() + 3.0  # after every child imported torch
    procs = [ctx.Process(target=_loop, args=(t, r, seconds, start, out)) for t, r in specs]
    for p in procs:
        p.start()
    rates = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return sorted(rates)


def switch_cost(cores: int, rounds: int = 2000) -> float:
    """Seconds per `set_num_threads` flip followed by one small product (so the team resizes)."""
    import torch

    a = torch.randn(8, HIDDEN, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, INTER, dtype=torch.bfloat16)
    torch.set_num_threads(cores)
    a @ w
    begin = time.perf_counter()
    for i in range(rounds):
        torch.set_num_threads(1 if i % 2 else cores)
        a @ w
    flipping = time.perf_counter() - begin
    begin = time.perf_counter()
    for _ in range(rounds):
        a @ w
    steady = time.perf_counter() - begin
    return (flipping - steady) / rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    half = max(1, cores // 2)
    s = args.seconds
    result: dict[str, Any] = {"cores": cores}
    for name, rows in (("decode_b8", 8), ("prefill_256", 256)):
        result[name] = {
            "alone_1_thread": together([(1, rows)], s)[0],
            "alone_all_cores": together([(cores, rows)], s)[0],
            "pair_split": together([(half, rows), (half, rows)], s),
            "pair_both_borrow": together([(cores, rows), (cores, rows)], s),
        }
    result["set_num_threads_flip_s"] = switch_cost(cores)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
