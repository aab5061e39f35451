"""Dense decode linear (kernels/dense) vs torch's F.linear, then end-to-end decode tok/s.

    .venv/bin/python benchmarks/dense.py [--threads 1,2] [--batches 1,16] [--no-engine]

GEMV: every SmolLM2-135M weight shape (the fused qkv 576->960 and gate_up 576->3072 included)
at each batch and thread count; ours (bf16 weight; bf16 x through vdpbf16ps and through the
FMA kernel, fp32 x) against torch bf16 and torch fp32 F.linear. Enough weight copies are
cycled to exceed the L3 cache, so every call streams its weights from DRAM as in decode.
Times are the best of several trials (the machine may be shared), GiB/s is the weight bytes
read per second, and `x` columns are torch's time over ours (> 1: we are faster).
Engine: single-stream greedy decode tok/s of the model in bf16 on three paths, alternating
runs: plain torch, plain-torch layers over the dense GEMV, and the native fused decoder layer
(what the engine uses).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F


def _import_dense() -> ModuleType:
    """kernels.dense, the project package: benchmarks/kernels.py would shadow `kernels` while
    this script's directory is sys.path[0], so that directory is dropped first."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    return importlib.import_module("kernels.dense")


dense = _import_dense()

GIB = 2**30
# (in, out) of SmolLM2-135M's linears: o_proj, k/v, q, down, qkv fused, up, gate_up fused, lm_head.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 960), (576, 3072),
          (576, 49152)]
STREAM_BYTES = 96 * 2**20  # > 2x L3: the rotated copies never stay cached


@dataclass(frozen=True)
class Case:
    """One GEMV measurement: a shape, a batch size and a thread count."""

    in_f: int
    out_f: int
    batch: int
    threads: int


def best_time(fns: dict[str, Callable[[int], object]], min_time: float) -> dict[str, float]:
    """Best per-call seconds of each fn(i) (i: the weight copy index), trials interleaved."""
    best = dict.fromkeys(fns, float("inf"))
    calls = 0
    deadline = time.perf_counter() + min_time * len(fns)
    while time.perf_counter() < deadline or calls < 3:
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(4):
                fn(calls)
                calls += 1
            best[name] = min(best[name], (time.perf_counter() - start) / 4)
    return best


def gemv_row(case: Case, min_time: float) -> dict[str, float]:
    torch.set_num_threads(case.threads)
    nbytes = case.in_f * case.out_f * 2
    copies = max(2, STREAM_BYTES // nbytes)
    wb = [torch.randn(case.out_f, case.in_f).to(torch.bfloat16) for _ in range(copies)]
    wf = [w.float() for w in wb[: max(2, copies // 2)]]  # fp32: twice the bytes per copy
    xb = torch.randn(case.batch, case.in_f).to(torch.bfloat16)
    xf = xb.float()
    paths = {b: dense.kernel_path(b) for b in dense.available_backends()}
    # The FMA kernel of this CPU's fastest tier (avx512, else avx2); none: nothing to measure.
    fma = next((paths[b] for b in ("avx512", "avx2") if b in paths), None)
    if fma is None:
        raise SystemExit(f"no compiled dense tier runs here: {dense.build_info(build=False)}")
    fns: dict[str, Callable[[int], object]] = {
        "torch_bf16": lambda i: F.linear(xb, wb[i % copies]),
        "torch_fp32": lambda i: F.linear(xf, wf[i % len(wf)]),
        "ours_fp32x": lambda i: fma.linear(xf, wb[i % copies]),
        "ours_bf16x_fma": lambda i: fma.linear(xb, wb[i % copies]),
    }
    if "avx512_bf16" in paths:
        fns["ours_bf16x_dp"] = lambda i: paths["avx512_bf16"].linear(xb, wb[i % copies])
    return best_time(fns, min_time)


def print_gemv(threads: list[int], batches: list[int], min_time: float) -> None:
    print(f"GEMV best-of times (us), GiB/s of weights; backends: {dense.available_backends()}")
    head = f"{'thr':>3} {'in->out':>11} {'m':>3}"
    print(f"{head} {'torch_bf16':>15} {'torch_fp32':>15} {'ours_fp32x':>15} "
          f"{'ours_bf16x_fma':>15} {'ours_bf16x_dp':>15}  bf16/ours fp32/ours")
    for th in threads:
        for in_f, out_f in SHAPES:
            for m in batches:
                t = gemv_row(Case(in_f, out_f, m, th), min_time)
                wbytes = in_f * out_f * 2

                def cell(name: str, t: dict[str, float] = t, wbytes: int = wbytes) -> str:
                    if name not in t:
                        return f"{'-':>15}"
                    scale = 2 if name == "torch_fp32" else 1
                    return f"{t[name] * 1e6:7.0f}/{wbytes * scale / t[name] / GIB:5.1f}G"

                ours = t.get("ours_bf16x_dp", t["ours_bf16x_fma"])
                print(f"{th:>3} {f'{in_f}->{out_f}':>11} {m:>3} "
                      + " ".join(cell(n) for n in ("torch_bf16", "torch_fp32", "ours_fp32x",
                                                   "ours_bf16x_fma", "ours_bf16x_dp"))
                      + f"  {t['torch_bf16'] / ours:8.2f}x {t['torch_fp32'] / t['ours_fp32x']:8.2f}x",
                      flush=True)


# ---- end to end ----------------------------------------------------------------------------
def load_engine(model: str, threads: int, path: str) -> object:
    """An LLMEngine in bf16 on one decode path: "torch" (plain-torch layers, F.linear),
    "dense" (plain-torch layers, dense GEMV linears) or "native" (what LLMEngine.from_config
    picks: dense GEMVs inside the fused native decoder layer)."""
    from shared.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.model.loader import load_model
    from shared.model.registry import resolve_model
    from shared.model.tokenizer import Tokenizer

    config = EngineConfig(model=model, dtype="bfloat16", num_threads=threads,
                          enable_prefix_caching=False)
    if path == "native":
        engine = LLMEngine.from_config(config)
    else:
        model_dir = resolve_model(model, config.resolved_cache_dir,
                                  revision=config.revision, hub_cache=config.hf_hub_cache)
        model_, model_config = load_model(model_dir, "bfloat16")
        if path == "dense":
            print(f"  accelerate_linears swapped {dense.accelerate_linears(model_)} linears")
        engine = LLMEngine.from_model(config, model_, model_config, Tokenizer(model_dir))
    engine.warmup()
    return engine


def decode_tok_s(engine: object, tokens: int, seed: int) -> float:
    """Greedy single-stream decode: (tokens - 1) over the first-to-last token time."""
    from shared.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 40000, (16,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(f"bench-{seed}-{time.monotonic_ns()}", prompt, params)  # type: ignore[attr-defined]
    stamps = []
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        if engine.step():  # type: ignore[attr-defined]
            stamps.append(time.perf_counter())
    return (len(stamps) - 2) / (stamps[-1] - stamps[1])


def print_engine(model: str, threads: int, tokens: int, rounds: int) -> None:
    print(f"\nEngine: {model} bf16, {threads} threads, single-stream decode of {tokens} tokens")
    engines = {name: load_engine(model, threads, name) for name in ("torch", "dense", "native")}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):  # alternate, so load from other processes hits both alike
        for name, engine in engines.items():
            rates[name].append(decode_tok_s(engine, tokens, seed=r))
    for name, xs in rates.items():
        xs.sort()
        print(f"  {name:>5}: best {xs[-1]:6.1f} tok/s  median {xs[len(xs) // 2]:6.1f} tok/s  "
              f"(runs: {', '.join(f'{x:.1f}' for x in xs)})")
    median = {name: sorted(xs)[rounds // 2] for name, xs in rates.items()}
    print(f"  speedup over torch (median): dense {median['dense'] / median['torch']:.2f}x, "
          f"native {median['native'] / median['torch']:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per GEMV candidate")
    p.add_argument("--no-gemv", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine-threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(dense.build_info())
    if not args.no_gemv:
        print_gemv([int(t) for t in args.threads.split(",")],
                   [int(b) for b in args.batches.split(",")], args.min_time)
    if not args.no_engine:
        try:
            import shared.engine  # noqa: F401
        except ImportError as exc:
            print(f"\nEngine: skipped (shared.engine unavailable: {exc})")
            return 0
        print_engine(args.model, args.engine_threads, args.decode_tokens, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
