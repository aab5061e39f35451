"""Prefill GEMMs with and without row buckets: memory held and speed on lengths never seen.

torch's bf16 GEMM (oneDNN) builds and caches a primitive per shape. This script runs the
prefill products of a model's linear shapes (SmolLM2-135M's by default) for a sweep of
distinct row counts, once as they come (`plain`) and once padded to their bucket
(`bucketed`, kernels.dense.bucketed_linear), each in a fresh process so that neither inherits
the other's cache, and prints tokens/s and the RSS each left behind, then the ratios. A
third phase repeats a few lengths, where both run from a warm cache.

    .venv/bin/python benchmarks/gemm_buckets.py
    .venv/bin/python benchmarks/gemm_buckets.py --threads 2 --lengths 33:2000:9
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (in_features, out_features) of SmolLM2-135M's decoder linears (fused qkv and gate_up)
SMOLLM2 = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def rss_mb() -> float:
    """Resident set after returning the C heap's free pages (so only what is held counts)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run(mode: str, lengths: list[int], repeats: list[int], threads: int) -> dict[str, float]:
    """One process's measurement: the sweep of new lengths, then the repeated ones."""
    # benchmarks/kernels.py shadows the `kernels` package while this directory leads sys.path
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    dense = importlib.import_module("kernels.dense")

    torch.set_num_threads(threads)
    linear = dense.bucketed_linear if mode == "bucketed" else F.linear
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) / k**0.5).bfloat16() for k, n in SMOLLM2]
    widest = max(k for k, _ in SMOLLM2)

    def tokens_per_s(rows_list: list[int]) -> float:
        elapsed, tokens = 0.0, 0
        for rows in rows_list:
            x = torch.randn(rows, widest, generator=g).bfloat16()
            inputs = [x[:, :w.shape[1]].contiguous() for w in weights]
            start = time.perf_counter()
            for xi, w in zip(inputs, weights, strict=True):
                linear(xi, w)
            elapsed += time.perf_counter() - start
            tokens += rows
        return tokens / elapsed

    before = rss_mb()
    fresh = tokens_per_s(lengths)
    held = rss_mb() - before
    warm = tokens_per_s(repeats)
    return {"new_lengths_tok_s": fresh, "rss_held_mb": held, "repeated_tok_s": warm}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="33:2000:9", help="start:stop:step of new row counts")
    p.add_argument("--child", choices=["plain", "bucketed"], help=argparse.SUPPRESS)
    args = p.parse_args()
    start, stop, step = (int(v) for v in args.lengths.split(":"))
    lengths = list(range(start, stop, step))
    repeats = [100, 300, 700, 1500, 2000] * 10
    if args.child:
        print(json.dumps(run(args.child, lengths, repeats, args.threads)))
        return
    results = {}
    for mode in ("plain", "bucketed"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--threads",
                              str(args.threads), "--lengths", args.lengths],
                             check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    print(f"{len(lengths)} new row counts {args.lengths}, {args.threads} threads, "
          f"SmolLM2-135M shapes {SMOLLM2}")
    print(f"{'':10} {'new lengths tok/s':>18} {'RSS held MB':>12} {'repeated tok/s':>15}")
    for mode, r in results.items():
        print(f"{mode:10} {r['new_lengths_tok_s']:18.0f} {r['rss_held_mb']:12.1f} "
              f"{r['repeated_tok_s']:15.0f}")
    plain, bucketed = results["plain"], results["bucketed"]
    print(f"bucketed/plain: new lengths {bucketed['new_lengths_tok_s'] / plain['new_lengths_tok_s']:.2f}x, "
          f"RSS held {bucketed['rss_held_mb'] / max(plain['rss_held_mb'], 1e-9):.2f}x, "
          f"repeated {bucketed['repeated_tok_s'] / plain['repeated_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
