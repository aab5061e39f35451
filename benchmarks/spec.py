"""Speculative decoding (n-gram prompt lookup) vs speculation off, side by side, one process.

    .venv/bin/python benchmarks/spec.py [--threads 2] [--k 4] [--tokens 160] [--json OUT.json]

Input-grounded workload: the embedded SmolLM2 chat model is asked to repeat or lightly edit a
given passage, so its output copies spans of the prompt. Each mode builds its own engine
(same model, dtype, threads) and measures:
  decode   single-stream greedy decode tok/s ((N-1) tokens over first-to-last token time)
  agg16    aggregate tok/s of 16 concurrent greedy requests (wall time, prefill included)
and the greedy tokens of both modes are compared (they must be identical). The ngram side
also reports its acceptance rate (accepted / proposed draft tokens) and mean acceptance
length (tokens emitted per speculating step: 1 + accepted / drafts).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

PASSAGES = [
    "The river rises in the northern hills and runs south through farmland for two hundred "
    "miles before it reaches the sea. Its valley was settled early, and the old market towns "
    "along its banks still hold a weekly fair.",
    "To install the tool, download the archive, unpack it into a directory of your choice, "
    "and add that directory to your PATH. Then run the setup command once to create the "
    "configuration file in your home directory.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    return sum((v - m) ** 2 for v in values) / len(values)\n",
    "Our quarterly report shows revenue up eight percent, driven by the new subscription "
    "plans. Costs rose three percent, mostly from hiring in support and engineering. We "
    "expect the second half of the year to follow the same trend.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this text and fix any typos (there may be none):\n\n{}",
    "Rewrite the following text exactly as it is, keeping every line:\n\n{}",
    "Here is a passage. Write it out again verbatim.\n\n{}",
]


def grounded_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = INSTRUCTIONS[(i // len(PASSAGES)) % len(INSTRUCTIONS)].format(
            PASSAGES[i % len(PASSAGES)])
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


def run_mode(args: argparse.Namespace, spec: dict[str, Any] | None) -> dict[str, Any]:
    from shared.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads,
        enable_prefix_caching=False, speculative_config=spec))  # type: ignore[arg-type]
    engine.warmup()
    prompts = grounded_prompts(engine.tokenizer, 16)

    def timed(batch: list[list[int]], max_tokens: int) -> tuple[int, list[float], list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(batch))]
        for rid, p in zip(ids, batch, strict=True):
            engine.add_request(rid, p, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        start, stamps = time.perf_counter(), []
        while engine.has_unfinished_requests():
            outs = engine.step()
            for o in outs:
                tokens[o.request_id] += o.new_token_ids
            if any(o.new_token_ids for o in outs):
                stamps.append(time.perf_counter())
        return sum(map(len, tokens.values())), [start, *stamps], [tokens[r] for r in ids]

    timed(prompts[:1], 8)
    n, stamps, single = timed(prompts[:1], args.tokens)
    # (n - 1) tokens after the first, over the time from the first to the last token.
    decode = (n - 1) / (stamps[-1] - stamps[1])
    before = engine.stats()
    total, stamps, batch = timed(prompts, args.agg_tokens)
    agg = total / (stamps[-1] - stamps[0])
    s = engine.stats()
    return {"decode": decode, "decode_tokens": n, "agg16": agg, "single": single[0],
            "batch": batch, "single_draft_tokens": before.spec_num_draft_tokens,
            "single_accepted": before.spec_num_accepted_tokens,
            "single_drafts": before.spec_num_drafts,
            "agg_draft_tokens": s.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "agg_accepted": s.spec_num_accepted_tokens - before.spec_num_accepted_tokens}


def main() -> None:
    from shared.config import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--disable-by-batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160, help="single-stream max_tokens")
    ap.add_argument("--agg-tokens", type=int, default=64, help="max_tokens of each of the 16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max,
            "disable_by_batch_size": args.disable_by_batch_size}
    off = run_mode(args, None)
    on = run_mode(args, spec)
    rate = on["single_accepted"] / max(on["single_draft_tokens"], 1)
    mean_len = 1 + on["single_accepted"] / max(on["single_drafts"], 1)
    report = {
        "spec": spec, "threads": args.threads,
        "decode_off": off["decode"], "decode_ngram": on["decode"],
        "decode_speedup": on["decode"] / off["decode"],
        "agg16_off": off["agg16"], "agg16_ngram": on["agg16"],
        "agg16_ratio": on["agg16"] / off["agg16"],
        "single_acceptance_rate": rate, "single_mean_acceptance_length": mean_len,
        "agg16_acceptance_rate": on["agg_accepted"] / max(on["agg_draft_tokens"], 1),
        "decode_tokens": on["decode_tokens"],
        "greedy_identical_single": off["single"] == on["single"],
        "greedy_identical_agg16": off["batch"] == on["batch"],
    }
    for key, value in report.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
