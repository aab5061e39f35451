"""The screened greedy head against the full LM head, per dense tier and batch rows.

    .venv/bin/python benchmarks/greedy_head.py [--rows 1,2,4,8,16,32] [--tiers avx512_bf16,...]
        [--reps 9] [--threads 2]

SmolLM2-135M's tied head (49,152 x 576 bf16) on decode hidden states of the real model (greedy
decodes of random prompts, recorded at the head). Each timing starts with the last-level cache
flushed (a 96 MiB read), as in a decode step, where the 30 decoder layers have streamed 212 MB
through it just before the head. Prints the median of --reps per (tier, rows), the ratio, and
checks every screened token against the full head's argmax. kernels/dense/greedy_head.py's
SCREEN_MAX_ROWS comes from this table: the screen's integer work grows with the rows, the full
head's cost stays one weight stream until its GEMV turns compute-bound.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels.dense import DenseLinear, available_backends, kernel_path  # noqa: E402
from kernels.dense.greedy_head import GreedyHead  # noqa: E402


def decode_states(threads: int, n: int = 160) -> tuple[torch.Tensor, torch.nn.Parameter]:
    """[n, 576] bf16 final-normed hidden states of greedy SmolLM2 decodes (random prompts),
    and the model's LM head weight [49152, 576]."""
    from shared.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(
        model="smollm2-135m-instruct", dtype="bfloat16", num_threads=threads,
        enable_prefix_caching=False, greedy_screen=False))
    seen: list[torch.Tensor] = []
    model = engine.runner.model
    full = model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.clone())
        return full(hidden)

    model.compute_logits = record  # type: ignore[method-assign]
    for i in range(4):
        rng = random.Random(i)
        engine.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(16)],
                           SamplingParams(temperature=0.0, max_tokens=n // 4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    weight = torch.nn.Parameter(model.lm_head.weight.detach(), requires_grad=False)
    return torch.cat(seen), weight


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--tiers", default=None, help="default: every dense tier this CPU runs")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    states, weight = decode_states(args.threads)
    tiers = (args.tiers.split(",") if args.tiers
             else [b for b in available_backends() if b != "reference"])
    flush = torch.ones(96 << 20, dtype=torch.uint8)
    print(f"{'tier':<12}{'rows':>5}{'screen ms':>11}{'full ms':>9}{'full/screen':>13}")
    for tier in tiers:
        full = DenseLinear(weight, None, kernel_path(tier))
        screen = GreedyHead(full)
        for rows in (int(r) for r in args.rows.split(",")):
            if rows > 32:
                continue
            x = states[torch.randperm(len(states), generator=torch.Generator().manual_seed(rows))
                       [:rows]].contiguous()
            picked = screen(x)
            assert picked == full(x).float().argmax(-1).tolist()
            times: dict[str, list[float]] = {"screen": [], "full": []}
            for _ in range(args.reps):
                for name, fn in (("screen", screen), ("full", full)):
                    flush.sum()
                    t0 = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - t0)
            s, f = (statistics.median(times[k]) * 1e3 for k in ("screen", "full"))
            print(f"{tier:<12}{rows:>5}{s:>11.2f}{f:>9.2f}{f / s:>12.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
