"""Single-stream decode tok/s: pdmesh (bf16, MXFP4) against llama.cpp (Q4_1, bf16), one run.

    .venv/bin/python benchmarks/llamacpp_decode.py [--rounds 3] [--threads 2]
        [--systems pdmesh-bf16,pdmesh-mxfp4,pdmesh-mxfp4-head,pdmesh-mxfp4-a8,pdmesh-mxfp4-a8-head,
                   llamacpp-q4_1,llamacpp-bf16,
                   pdmesh-bf16-noscreen,pdmesh-mxfp4-noscreen]
        [--cache ~/.cache/pdmesh/peers] [--decode-tokens 128] [--json out.json]

Issue #7's end-to-end figure. Every system runs in its own fresh subprocess per round (pdmesh
in this venv, llama.cpp through `llama_cpp.Llama` in the peer venv that benchmarks/peers.py
sets up), all with the same thread count, the same 16 random prompt token ids and greedy
decoding with EOS ignored. Rounds alternate the order ABBA (forward, then reversed), so a slow
drift of a shared machine falls evenly on every system. Decode tok/s = (N - 1) tokens over the
time from the first generated token to the last, i.e. prefill excluded, as benchmarks/engine.py
measures it. Each child decodes `--reps` times after one warm-up; the driver reports the median
and the best over all rounds and reps, plus the load average before and after.
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
# pdmesh-mxfp4-head: the LM head in MXFP4 too (llama.cpp's Q4_1 file keeps its head at Q8_0).
# pdmesh-mxfp4-a8*: int8 activations in the MXFP4 linears (EngineConfig.quant_activations), as
# llama.cpp's Q4_1 kernels run (Q8_1 activations): the like-for-like comparison on AVX2 CPUs.
# *-noscreen: greedy tokens from the whole bf16 head (EngineConfig.greedy_screen off), not from
# its int8 screen (kernels/dense/greedy_head.py); the tokens are the same. Not in the default.
SYSTEMS = ("pdmesh-bf16", "pdmesh-mxfp4", "pdmesh-mxfp4-head", "pdmesh-mxfp4-a8",
           "pdmesh-mxfp4-a8-head", "llamacpp-q4_1", "llamacpp-bf16")
ALL_SYSTEMS = (*SYSTEMS, "pdmesh-bf16-noscreen", "pdmesh-mxfp4-noscreen")
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain-text token ids of SmolLM2's vocabulary
PROMPT_LEN = 16


def prompt_ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(PROMPT_LEN)]


def decode_rate(stamps: list[float]) -> float:
    """stamps[i]: when token i arrived. Rate over tokens 1..N-1 (token 0 closes the prefill)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


# ---- children: one system each, printing one JSON line ---------------------------------------
def child_pdmesh(args: argparse.Namespace, quantization: str | None, head: bool,
                 screen: bool, activations: str = "float") -> list[float]:
    sys.path.insert(0, str(ROOT))
    from shared.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(
        model="smollm2-135m-instruct", dtype="bfloat16", num_threads=args.threads,
        quantization=quantization, quantize_lm_head=head, enable_prefix_caching=False,
        greedy_screen=screen, quant_activations=activations))
    engine.warmup()

    def once(seed: int, n: int) -> list[float]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"d{seed}", prompt_ids(seed), params)
        stamps = []
        while engine.has_unfinished_requests():
            if any(o.new_token_ids for o in engine.step()):
                stamps.append(time.perf_counter())
        return stamps

    once(0, 8)
    return [decode_rate(once(1 + r, args.decode_tokens)) for r in range(args.reps)]


def child_llama(args: argparse.Namespace, gguf: Path) -> list[float]:
    from llama_cpp import Llama  # only in the peer venv

    # One token per batch: on CPUs with AMX, ggml's AMX path (weights repacked at load, its
    # fastest decode) segfaults on any batch of 2+ tokens (llama-cpp-python 0.3.36, Q4_1 file,
    # Intel Xeon). Decode is one token per batch anyway; only the 16-token prompt, which is not
    # timed, goes in 16 steps.
    llm = Llama(model_path=str(gguf), n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=512, n_batch=1, n_ubatch=1, verbose=False)

    def once(seed: int, n: int) -> list[float]:
        stamps = []
        # generate() never stops on EOS by itself: exactly n tokens, greedy at temp 0
        for _ in llm.generate(prompt_ids(seed), temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == n:
                break
        return stamps

    once(0, 8)
    return [decode_rate(once(1 + r, args.decode_tokens)) for r in range(args.reps)]


def gguf_path(args: argparse.Namespace, system: str) -> Path:
    sys.path.insert(0, str(HERE))
    import peer_servers as ps

    return ps.bf16_gguf(args.cache) if system.endswith("bf16") else ps.find_q4_gguf()


def run_child(args: argparse.Namespace, system: str) -> list[float]:
    common = ["--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens),
              "--reps", str(args.reps)]
    if system.startswith("pdmesh"):
        cmd = [sys.executable, __file__, "--side", system, *common]
    else:
        sys.path.insert(0, str(HERE))
        import peer_servers as ps

        python = ps.llama_venv(args.cache) / "bin" / "python"
        cmd = [str(python), __file__, "--side", system, "--gguf", str(gguf_path(args, system)),
               *common]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{system} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="measured decodes per child")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pdmesh" / "peers")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--side", choices=ALL_SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(ALL_SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        if args.side.startswith("pdmesh"):
            rates = child_pdmesh(args, "mxfp4" if "mxfp4" in args.side else None,
                                 args.side.endswith("-head"), not args.side.endswith("-noscreen"),
                                 "int8" if "-a8" in args.side else "float")
        else:
            rates = child_llama(args, args.gguf)
        print(json.dumps(rates))
        return 0
    systems = args.systems.split(",")
    load_before = os.getloadavg()
    rates: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            got = run_child(args, system)
            rates[system] += got
            print(f"round {r} {system:<18} " + " ".join(f"{v:6.1f}" for v in got)
                  + f"  load {os.getloadavg()[0]:.2f}", flush=True)
    load_after = os.getloadavg()
    print(f"\nsingle-stream decode tok/s, {args.threads} threads, {args.decode_tokens} tokens, "
          f"{args.rounds} rounds x {args.reps} reps; load {load_before[0]:.2f} -> "
          f"{load_after[0]:.2f}")
    print(f"{'system':<20}{'median':>8}{'best':>8}")
    summary = {s: {"median": statistics.median(v), "best": max(v), "all": v}
               for s, v in rates.items()}
    for s, v in summary.items():
        print(f"{s:<20}{v['median']:>8.1f}{v['best']:>8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": args.threads,
            "decode_tokens": args.decode_tokens, "rounds": args.rounds, "reps": args.reps,
            "loadavg_before": load_before, "loadavg_after": load_after, "systems": summary},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
