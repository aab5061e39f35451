"""Pipeline parallelism on SmolLM2: async vs blocking token hand-off, and PP=2 vs PP=1.

    .venv/bin/python benchmarks/pipeline.py [--requests 8] [--prompt-len 64] [--max-tokens 64]
                                            [--rounds 2] [--partition 19,11] [--dtype float32]

Sides, each in its own subprocess, on the machine's 2 cores:
  pp1         one process, 2 threads (the plain LLMEngine)
  pp2-block   2 stages, 1 thread each; stage 0 waits for a step's tokens right after sending
              it (PipelineConfig.blocking_handoff: the same code, the wait moved)
  pp2-async   2 stages, 1 thread each; the tokens are awaited only when that microbatch's
              next input ids are prepared, so the other microbatch runs meanwhile
Workload: `--requests` concurrent greedy requests (ignore_eos) of `--prompt-len` random
plain-text tokens, `--max-tokens` each, submitted at once after a warm-up. Figures:
  agg     generated tokens / wall time from submission to the last token (prefill included)
  decode  tokens after each request's first / time from the last first token to the end
Rounds alternate the sides and keep each side's best (the machine is shared with other work).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

SIDES = ("pp1", "pp2-block", "pp2-async")
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain-text token ids of SmolLM2's vocabulary


def run_side(args: argparse.Namespace) -> dict[str, float]:
    from shared.engine.sampling_params import SamplingParams
    from shared.pipeline.config import PipelineConfig, parse_partition
    from shared.pipeline.facades import PipelineLLM

    pp = 1 if args.side == "pp1" else 2
    pipeline = PipelineConfig(pp_size=pp, layer_partition=parse_partition(args.partition)
                              if pp > 1 else None, blocking_handoff=args.side == "pp2-block")
    llm = PipelineLLM(model=args.model, dtype=args.dtype, num_threads=2 // pp,
                      enable_prefix_caching=False, pipeline=pipeline)
    try:
        engine = llm.engine
        engine.warmup()
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.requests):
            prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.prompt_len)]
            engine.add_request(f"bench-{i}", prompt, params)
        start, first, total = time.perf_counter(), {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                total += len(out.new_token_ids)
                if out.new_token_ids:
                    first.setdefault(out.request_id, time.perf_counter())
        end = time.perf_counter()
    finally:
        llm.close()
    decode_tokens = total - args.requests
    return {"agg": total / (end - start),
            "decode": decode_tokens / (end - max(first.values())), "tokens": total}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--partition", default=None, help="layers per stage, e.g. 19,11 (PP=2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args: argparse.Namespace, side: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--side", side, "--model", args.model, "--dtype", args.dtype,
           "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
           "--max-tokens", str(args.max_tokens)]
    if args.partition:
        cmd += ["--partition", args.partition]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        print(json.dumps(run_side(args)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            runs[side].append(child(args, side))
    best = {side: {k: max(r[k] for r in rs) for k in ("agg", "decode")}
            for side, rs in runs.items()}
    print(f"SmolLM2 ({args.model}), {args.dtype}, {args.requests} concurrent requests, "
          f"prompt {args.prompt_len}, {args.max_tokens} tokens each, partition "
          f"{args.partition or 'even'}, best of {args.rounds}")
    print(f"{'side':<10} {'agg tok/s':>10} {'decode tok/s':>13}")
    for side, fig in best.items():
        print(f"{side:<10} {fig['agg']:>10.1f} {fig['decode']:>13.1f}")
    for label, num, den in (("async / blocking hand-off", "pp2-async", "pp2-block"),
                            ("PP=2 async / PP=1", "pp2-async", "pp1")):
        print(f"{label:<26} agg x{best[num]['agg'] / best[den]['agg']:.2f}   "
              f"decode x{best[num]['decode'] / best[den]['decode']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
