"""Prefill attention per layer: our flash kernel against torch's CPU flash kernel.

    .venv/bin/python benchmarks/prefill_attention.py [--lengths 32,200,2000,8000]
        [--cached 0] [--heads 9 --kv-heads 3 --head-dim 64] [--reps 5] [--threads 2]
        [--kernel avx512_bf16|avx2]

One layer's causal attention of a prompt of L tokens (after --cached tokens already in the
paged cache), SmolLM2-135M's heads by default, on both implementations of the op
pdmesh_dense::prefill_attention, alternating in one process on the same inputs: torch's
_scaled_dot_product_flash_attention_for_cpu over the gathered K / V (what every prefill ran
before), and one of ours: kernels/dense/csrc/flash_avx512bf16.cpp (bf16 dot products; the
default where the CPU has avx512_bf16) or flash_avx2.cpp (fp32 FMA; the default elsewhere).
Prints the median ms per call of --reps (after one warm-up each), the ratio torch / ours, the
effective GMAC/s of ours (the causal QK^T and PV multiply-adds), and the largest difference
between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernels.dense as dense  # noqa: E402
from benchmarks.peers_plot import cpu_kind  # noqa: E402

BLOCK = 16


def inputs(length: int, cached: int, heads: int, kv_heads: int, d: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    ctx = cached + length
    nblk = -(-ctx // BLOCK)
    g = torch.Generator().manual_seed(length)
    kv = torch.randn(2, nblk + 1, BLOCK, kv_heads, d, generator=g).to(torch.bfloat16)
    q = torch.randn(length, heads * d, generator=g).to(torch.bfloat16)
    table = torch.randperm(nblk, generator=g).to(torch.int32) + 1
    return q, kv, table, ctx


def causal_macs(length: int, cached: int, heads: int, d: int) -> float:
    """Multiply-adds of QK^T plus PV over the visible (row, key) pairs."""
    pairs = length * cached + length * (length + 1) / 2
    return 2 * pairs * heads * d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="32,200,2000,8000")
    p.add_argument("--cached", type=int, default=0)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernel", choices=("avx512_bf16", "avx2"), default=None,
                   help="ours to time (default: avx512_bf16 where the CPU has it, else avx2)")
    args = p.parse_args()
    info = dense.build_info()
    if info.state != "ready" or "avx2" not in info.available:
        sys.exit(f"needs the dense library on an AVX2 CPU (state {info.state}, "
                 f"tiers {info.available})")
    kernel = args.kernel or ("avx512_bf16" if "avx512_bf16" in info.available else "avx2")
    if kernel not in info.available:
        sys.exit(f"this CPU cannot run the {kernel} kernel (tiers {info.available})")
    torch.set_num_threads(args.threads)
    op = torch.ops.pdmesh_dense.prefill_attention
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    print(f"# {cpu_kind()}, {args.threads} threads; heads {h} / {kvh} kv, head_dim {d}, "
          f"{args.cached} cached tokens; ours: the {kernel} kernel")
    print(f"| prompt tokens | torch flash (ms) | {kernel} kernel (ms) | torch / ours "
          "| ours GMAC/s | max abs diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in (int(x) for x in args.lengths.split(",")):
        q, kv, table, ctx = inputs(length, args.cached, h, kvh, d)

        def run(ours: bool, q: torch.Tensor = q, kv: torch.Tensor = kv,
                table: torch.Tensor = table, ctx: int = ctx) -> torch.Tensor:
            return op(q, kv, table, ctx, h, kvh, d ** -0.5, kernel if ours else "torch")

        diff = (run(True).float() - run(False).float()).abs().max().item()
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.reps):
            for ours in (False, True):  # alternate, so drift falls on both
                start = time.perf_counter()
                run(ours)
                times[ours].append(time.perf_counter() - start)
        ours, theirs = statistics.median(times[True]), statistics.median(times[False])
        gmacs = causal_macs(length, args.cached, h, d) / ours / 1e9
        print(f"| {length:,} | {theirs * 1e3:.2f} | {ours * 1e3:.2f} | {theirs / ours:.2f}x "
              f"| {gmacs:.0f} | {diff:.4f} |", flush=True)


if __name__ == "__main__":
    main()
