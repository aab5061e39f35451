"""MXFP4 CPU kernels: dequantisation bandwidth and the fused decode GEMV against torch.

    .venv/bin/python benchmarks/kernels.py [--threads N] [--min-time 0.3] [--backend avx2]

dequant   GB/s of output written, against a memcpy of the same output size: `clone()`
          (allocates, as dequantize() does) and `copy_` into a preallocated tensor (as
          dequantize(..., out=) does). Ratio = dequant speed / memcpy speed (target >= 0.6).
gemv      y = x @ W.T on SmolLM2-135M's shapes at batch 1 and 16: the fused MXFP4 kernel with
          fp32 and bf16 activations, against torch matmul with W in fp32 and in bf16. Ratios =
          torch time / fused time (> 1: fused is faster): torch fp32 / fused fp32-x, torch bf16 /
          fused fp32-x, and (last column) torch bf16 / fused bf16-x.
Weights rotate through copies totalling >= 2x the L3 size, so every call reads them from
DRAM as in a real decode step (the lm_head in MXFP4, 15 MB, would otherwise sit in L3).
Times are medians of torch.utils.benchmark blocks; the candidates of one row are measured in
alternation for --rounds rounds and each keeps its best median, so that load from other
processes (the machine is shared) hits every candidate alike.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer


def _import_mxfp4() -> ModuleType:
    """kernels.mxfp4, the project package: this script is itself named kernels.py, so its own
    directory (sys.path[0] when run as a script) must not shadow the package."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    return importlib.import_module("kernels.mxfp4")


mxfp4 = _import_mxfp4()

SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out)
COLD_BYTES = 64 << 20  # weights touched per rotation: 2x a 32 MiB L3


def median_seconds(fn: Callable[[], object], min_time: float) -> float:
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_time).median


def best_of(fns: dict[str, Callable[[], object]], min_time: float, rounds: int) -> dict[str, float]:
    """Each candidate's best median over `rounds` alternating rounds."""
    for fn in fns.values():
        fn()  # warm up (the first call builds / loads the library)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], median_seconds(fn, min_time))
    return best


def rotating(fn: Callable[..., object], args: list[tuple]) -> Callable[[], object]:
    """A call of fn on the next argument tuple, cycling; the copies keep caches cold."""
    cycle = itertools.cycle(args)
    return lambda: fn(*next(cycle))


def copies(nbytes: int) -> int:
    return max(1, -(-COLD_BYTES // max(nbytes, 1)))


def random_packed(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (out_f, in_f // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 124, (out_f, in_f // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def bench_dequant(backend: str, min_time: float, rounds: int) -> None:
    print(f"\n== dequantize ({backend}) vs memcpy of the output; ratio = dequant / memcpy speed")
    print(f"{'shape (out, in)':>16} {'dtype':>9} {'MB':>7} | {'alloc GB/s':>10} {'clone':>7} "
          f"{'ratio':>6} | {'out= GB/s':>10} {'copy_':>7} {'ratio':>6}")
    for in_f, out_f in SMOLLM2_SHAPES:
        blocks, scales = random_packed(out_f, in_f, seed=out_f)
        for dtype in (torch.float32, torch.bfloat16):
            out = mxfp4.dequantize(blocks, scales, dtype, backend=backend)
            src = out.clone()
            t = best_of({
                "alloc": partial(mxfp4.dequantize, blocks, scales, dtype, backend),
                "clone": src.clone,
                "out": partial(mxfp4.dequantize, blocks, scales, dtype, backend, out=out),
                "copy": partial(out.copy_, src),
            }, min_time, rounds)
            gb = out.numel() * out.element_size() / 1e9
            print(f"{f'({out_f}, {in_f})':>16} {str(dtype)[6:]:>9} {gb * 1e3:7.1f} | "
                  f"{gb / t['alloc']:10.1f} {gb / t['clone']:7.1f} {t['clone'] / t['alloc']:6.2f} | "
                  f"{gb / t['out']:10.1f} {gb / t['copy']:7.1f} {t['copy'] / t['out']:6.2f}")


def bench_gemv(backend: str, min_time: float, rounds: int) -> None:
    print(f"\n== fused linear ({backend}) vs torch matmul, cold weights; times in us, "
          "ratio = torch / fused")
    print(f"{'shape (in, out)':>16} {'batch':>5} | {'fused32':>8} {'fusedbf16':>9} | "
          f"{'torch32':>8} {'ratio':>6} | {'torchbf16':>9} {'ratio':>6} | {'bf16/bf16':>9}")
    for in_f, out_f in SMOLLM2_SHAPES:
        packed = [random_packed(out_f, in_f, seed=i) for i in range(copies(out_f * in_f * 17 // 32))]
        dense = mxfp4.dequantize(*packed[0])
        w32 = [(dense.clone(),) for _ in range(copies(dense.numel() * 4))]
        w16 = [(dense.bfloat16(),) for _ in range(copies(dense.numel() * 2))]
        for batch in (1, 16):
            x = torch.randn(batch, in_f)
            xb = x.bfloat16()
            # Each call: fn(*next tuple), e.g. linear(x, blocks, scales) / F.linear(x, w) = x @ w.T
            t = best_of({
                "fused32": rotating(partial(mxfp4.linear, x, backend=backend), packed),
                "fused16": rotating(partial(mxfp4.linear, xb, backend=backend), packed),
                "torch32": rotating(partial(F.linear, x), w32),
                "torch16": rotating(partial(F.linear, xb), w16),
            }, min_time, rounds)
            print(f"{f'({in_f}, {out_f})':>16} {batch:5d} | {t['fused32'] * 1e6:8.1f} "
                  f"{t['fused16'] * 1e6:9.1f} | {t['torch32'] * 1e6:8.1f} "
                  f"{t['torch32'] / t['fused32']:6.2f} | {t['torch16'] * 1e6:9.1f} "
                  f"{t['torch16'] / t['fused32']:6.2f} | {t['torch16'] / t['fused16']:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (best kept)")
    parser.add_argument("--backend", default=None, help="reference | scalar | avx2 | avx512 | "
                        "avx512_bf16 (default: the fastest under the tier cap)")
    parser.add_argument("--only", choices=("dequant", "gemv"), default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = str(mxfp4.kernel_path(args.backend).backend)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {mxfp4.build_info()}")
    if args.only in (None, "dequant"):
        bench_dequant(backend, args.min_time, args.rounds)
    if args.only in (None, "gemv"):
        bench_gemv(backend, args.min_time, args.rounds)


if __name__ == "__main__":
    main()
