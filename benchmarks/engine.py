"""Our engine vs HF transformers `generate`, side by side, same model, dtype and threads.

    .venv/bin/python benchmarks/engine.py [--dtype bfloat16|float32] [--threads 2]
                                          [--quantization mxfp4] [--model NAME_OR_DIR]
                                          [--kernel-tier auto|avx2|...] [--json OUT.json]
                                          [--moe]

Each side runs in its own subprocess (so peak RSS is its own) and measures:
  decode   single-stream decode tok/s: (N-1) tokens over the time from first to last token
  agg16    aggregate tok/s of 16 concurrent requests (wall time, prefill included);
           HF runs them as one padded batch through `generate`
  ttft200  time to first token of a 200-token prompt on an idle engine (median of 3)
The parent prints both sides and the ratios (ours / HF; for TTFT, HF / ours, so > 1 is
better for us everywhere), and which kernel tier our side ran (--kernel-tier caps it, default
$PDMESH_KERNEL_TIER, else auto); --json also writes all of it to a file.

--moe benchmarks a random Qwen3-MoE instead of --model (make_model's `medium` preset: 8 layers,
hidden 512, 32 experts of width 256, top-4, renormalised; ~150M parameters, ~35M active per
token), written once into a temporary directory and read by both sides. Its layers decline the
native fused path (QK-norm, routed experts), so our side runs plain torch with the GEMV swap.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain-text token ids of SmolLM2's vocabulary


METRICS = ("decode", "agg16", "ttft200", "rss")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(n)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- our engine --------------------------------------------------------------------------
def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from shared.config import EngineConfig, kernel_tier_from_env
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams
    from shared.kernel_tiers import kernel_tiers

    engine = LLMEngine.from_config(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads,
        quantization=args.quantization, enable_prefix_caching=False,
        kernel_tier=args.kernel_tier or kernel_tier_from_env()))
    engine.warmup()
    kernels = {**kernel_tiers().to_dict(), "requested": engine.config.kernel_tier}

    def timed(batch: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(batch):
            engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
        start, stamps, total = time.perf_counter(), [], 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            total += sum(len(o.new_token_ids) for o in outs)
            if outs:
                stamps.append(time.perf_counter())
        return total, [start, *stamps]

    timed(prompts(1, 16, 0), 8)  # warm the shapes used below
    _, stamps = timed(prompts(1, 16, 1), args.decode_tokens)
    decode = (len(stamps) - 2) / (stamps[-1] - stamps[1])
    total, stamps = timed(prompts(16, args.agg_prompt_len, 2), args.agg_tokens)
    agg = total / (stamps[-1] - stamps[0])
    ttfts = []
    for seed in range(3):
        _, stamps = timed(prompts(1, 200, 10 + seed), 1)
        ttfts.append(stamps[1] - stamps[0])
    return {"decode": decode, "agg16": agg, "ttft200": statistics.median(ttfts),
            "rss": peak_rss_mib(), "kernels": kernels}


# ---- HF transformers -------------------------------------------------------------------------
def run_hf(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from shared.model.registry import resolve_model

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype).eval()

    def gen(batch: list[list[int]], n: int) -> float:
        ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    gen(prompts(1, 16, 0), 8)
    one = gen(prompts(1, 16, 1), 1)
    full = gen(prompts(1, 16, 1), args.decode_tokens)
    decode = (args.decode_tokens - 1) / (full - one)
    agg = 16 * args.agg_tokens / gen(prompts(16, args.agg_prompt_len, 2), args.agg_tokens)
    ttft = statistics.median(gen(prompts(1, 200, 10 + s), 1) for s in range(3))
    return {"decode": decode, "agg16": agg, "ttft200": ttft, "rss": peak_rss_mib()}


# ---- driver ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kernels.tier import TIER_CHOICES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default=None, help="passed to EngineConfig (ours only)")
    p.add_argument("--kernel-tier", default=None, choices=TIER_CHOICES,
                   help="cap on our kernel tier (default: $PDMESH_KERNEL_TIER, else auto)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--agg-tokens", type=int, default=32)
    p.add_argument("--agg-prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate ours/HF this many times and keep each side's best figures "
                        "(steadier on a machine shared with other work)")
    p.add_argument("--moe", action="store_true",
                   help="benchmark a random Qwen3-MoE (32 experts, top-4) instead of --model")
    p.add_argument("--side", choices=("ours", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--write-moe", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args: argparse.Namespace, side: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--side", side, "--model", args.model, "--dtype", args.dtype,
           "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens),
           "--agg-tokens", str(args.agg_tokens), "--agg-prompt-len", str(args.agg_prompt_len)]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    if args.kernel_tier:
        cmd += ["--kernel-tier", args.kernel_tier]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_moe(out_dir: Path, dtype: str) -> Path:
    """The --moe checkpoint: random weights, SmolLM2's tokenizer (see the module docstring)."""
    from shared.model.make_model import ModelSpec, write_checkpoint
    from shared.model.registry import resolve_model

    spec = ModelSpec(arch="qwen3_moe", preset="medium", tie_word_embeddings=False, seed=0,
                     num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                     dtype=dtype)
    return write_checkpoint(out_dir, spec, resolve_model("smollm2-135m-instruct", progress=False))


def best(results: list[dict[str, Any]]) -> dict[str, float]:
    """Per metric, the best round: highest throughput, lowest TTFT and RSS."""
    return {k: (max if k in ("decode", "agg16") else min)(r[k] for r in results)
            for k in METRICS}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))  # the repository's packages, for both sides' imports
    args = parse_args(argv)
    if args.side:
        result = run_ours(args) if args.side == "ours" else run_hf(args)
        print(json.dumps(result))
        return 0
    if args.write_moe:
        write_moe(args.write_moe, args.dtype)
        return 0
    if not args.moe:
        return compare(args)
    with tempfile.TemporaryDirectory(prefix="pdmesh-bench-moe-") as tmp:
        # In a child: a process's peak RSS survives exec, so the sides must not inherit ours.
        subprocess.run([sys.executable, __file__, "--write-moe", tmp, "--dtype", args.dtype],
                       cwd=ROOT, check=True)
        args.model = tmp
        return compare(args, title="random Qwen3-MoE (32 experts, top-4)")


def compare(args: argparse.Namespace, title: str | None = None) -> int:
    """Run both sides (alternating, --rounds times) and print / write the comparison."""
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "hf": []}
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    for _ in range(args.rounds):
        for side in runs:
            runs[side].append(child(args, side))
    ours, hf = best(runs["ours"]), best(runs["hf"])
    kernels = runs["ours"][-1]["kernels"]
    quant = f", quantization={args.quantization}" if args.quantization else ""
    load_after = os.getloadavg()[0]
    print(f"{title or args.model}, {args.dtype}, {args.threads} threads{quant}, best of {args.rounds}, "
          f"load average {load_before:.2f} before / {load_after:.2f} after")
    ran = ", ".join(f"{lib} {backend} ({kernels[lib]})" if backend else f"{lib} unused"
                    for lib, backend in kernels["backends"].items())
    print(f"kernel tier: cpu {kernels['cpu_tier']}, cap {kernels['max_tier']} (requested "
          f"{kernels['requested']}); ran {ran}")
    print(f"{'metric':<28}{'ours':>10}{'HF':>10}{'ratio':>8}")
    rows = [("decode tok/s (1 stream)", "decode", False), ("aggregate tok/s (16 conc.)", "agg16", False),
            ("TTFT 200-token prompt (ms)", "ttft200", True), ("peak RSS (MiB)", "rss", True)]
    for label, key, lower_better in rows:
        scale = 1000 if key == "ttft200" else 1
        ratio = hf[key] / ours[key] if lower_better else ours[key] / hf[key]
        print(f"{label:<28}{ours[key] * scale:>10.1f}{hf[key] * scale:>10.1f}{ratio:>7.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": title or args.model, "dtype": args.dtype, "threads": args.threads,
            "quantization": args.quantization, "rounds": args.rounds, "kernels": kernels,
            "load_average": [load_before, load_after], "ours": ours, "hf": hf}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
