"""Speculative decoding (n-gram prompt lookup) vs speculation off, side by side, one process.

    .venv/bin/python benchmarks/spec.py [--threads 2] [--k 4] [--tokens 160] [--json OUT.json]

Input-grounded workload: the embedded SmolLM2 chat model is asked to repeat or edit a given
text, list or piece of code (ASKS), so its output copies spans of the prompt. Each mode builds its own engine
(same model, dtype, threads) and measures:
  decode   single-stream greedy decode tok/s, each ask alone ((N-1) tokens over the time
           from the first to the last token, summed over the asks)
  agg16    aggregate tok/s of 16 concurrent greedy requests (wall time, prefill included)
and the greedy tokens of both modes are compared (they must be identical). With --never the
draft model is a tiny random checkpoint sharing the tokenizer, so (almost) no draft is ever
accepted: the run measures what the per-request off switch leaves of speculation's cost
(goal: within 5% of speculation off). The speculating
side (n-gram, or a draft model with --draft-model, e.g. the MXFP4 self-draft) also reports
its acceptance rate (accepted / proposed draft tokens) and mean acceptance length (tokens
emitted per speculating step: 1 + accepted / drafts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
        "    return sum((v - m) ** 2 for v in values) / len(values)\n")
PASSAGE = ("To install the tool, download the archive, unpack it into a directory of your choice, "
           "and add that directory to your PATH. Then run the setup command once to create the "
           "configuration file in your home directory.")
# Edits of a given text or code: the answer copies spans of the prompt.
ASKS = [
    "Add type hints to this Python code and print the whole code:\n\n```python\n" + CODE + "```",
    "Rename the function `mean` to `average` in this code and show the full result:\n\n"
    "```python\n" + CODE + "```",
    "Translate this list to uppercase, keeping the same order: apple, banana, cherry, date, "
    "elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya",
    "Fix the spelling in this sentence and write it out again: The quik brown fox jumpd over "
    "the lazzy dog while the farmer watchd from the barn door.",
    "Repeat the following text exactly, word for word:\n\n" + PASSAGE,
    "Rewrite this text with numbered steps:\n\n" + PASSAGE,
    "Add a docstring to each function and print the whole code:\n\n```python\n" + CODE + "```",
    "Write this list again in reverse order: red, orange, yellow, green, blue, indigo, violet, "
    "black, white, grey",
]


def grounded_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": ASKS[i % len(ASKS)]}])
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


class Side:
    """One engine (speculation off or on) and the two measurements on it."""

    def __init__(self, args: argparse.Namespace, spec: dict[str, Any] | None) -> None:
        from shared.config import EngineConfig
        from shared.engine.engine import LLMEngine

        self.args = args
        self.engine = LLMEngine.from_config(EngineConfig(
            model=args.model, dtype=args.dtype, num_threads=args.threads,
            enable_prefix_caching=False, speculative_config=spec))  # type: ignore[arg-type]
        self.engine.warmup()
        self.prompts = grounded_prompts(self.engine.tokenizer, 16)
        self.timed([self.prompts[0]], [8])

    def timed(self, batch: list[list[int]], max_tokens: list[int]
              ) -> tuple[int, list[float], list[list[int]]]:
        from shared.engine.sampling_params import SamplingParams

        engine = self.engine
        ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(batch))]
        for rid, p, n in zip(ids, batch, max_tokens, strict=True):
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=n))
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        start, stamps = time.perf_counter(), []
        while engine.has_unfinished_requests():
            outs = engine.step()
            for o in outs:
                tokens[o.request_id] += o.new_token_ids
            if any(o.new_token_ids for o in outs):
                stamps.append(time.perf_counter())
        return sum(map(len, tokens.values())), [start, *stamps], [tokens[r] for r in ids]

    def single(self) -> tuple[float, int, list[list[int]], tuple[int, int, int]]:
        """Each ask alone: (n - 1) tokens after the first over first-to-last time, summed."""
        before = self.engine.stats()
        n, seconds, out = 0, 0.0, []
        for p in self.prompts[:len(ASKS)]:
            count, stamps, toks = self.timed([p], [self.args.tokens])
            n, seconds = n + count - 1, seconds + stamps[-1] - stamps[1]
            out += toks
        return n / seconds, n, out, _spec_delta(before, self.engine.stats())

    def agg16(self) -> tuple[float, list[list[int]], tuple[int, int, int]]:
        """16 concurrent asks with max_tokens 32..88: the tail runs below the batch limit."""
        before = self.engine.stats()
        lengths = [32 + 8 * (i % 8) for i in range(16)]
        total, stamps, out = self.timed(self.prompts, lengths)
        return total / (stamps[-1] - stamps[0]), out, _spec_delta(before, self.engine.stats())


def _spec_delta(before: Any, after: Any) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) between two EngineStats."""
    return (after.spec_num_drafts - before.spec_num_drafts,
            after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)


def random_draft(model: str) -> str:
    """A 2-layer random checkpoint with the target's tokenizer, in a temporary directory."""
    import tempfile

    from shared.model.make_model import ModelSpec, write_checkpoint
    from shared.model.registry import resolve_model

    out = Path(tempfile.mkdtemp(prefix="spec-never-")) / "draft"
    write_checkpoint(out, ModelSpec(arch="llama", preset="tiny", seed=1),
                     resolve_model(model, progress=False))
    return str(out)


def parse_args() -> argparse.Namespace:
    from shared.config import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--disable-by-batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=200, help="single-stream max_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-model", default=None,
                    help="method draft_model with this checkpoint (default: ngram)")
    ap.add_argument("--draft-quantization", default=None, choices=["mxfp4"],
                    help="with --draft-model: quantise the draft (--draft-model = --model: the "
                         "quantised self-draft)")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="with --draft-model: the draft's LM head scores ids below this only")
    ap.add_argument("--draft-quantize-lm-head", action="store_true",
                    help="with --draft-quantization: quantise the draft's LM head too")
    ap.add_argument("--never", action="store_true",
                    help="draft with a tiny random model (nothing accepted): the off switch's cost")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def main() -> None:
    # The repository's packages first: benchmarks/kernels.py would shadow the kernels package.
    sys.path.insert(0, str(ROOT))
    args = parse_args()
    if args.never:
        args.draft_model = random_draft(args.model)
    spec: dict[str, Any] = {"num_speculative_tokens": args.k,
                            "disable_by_batch_size": args.disable_by_batch_size}
    if args.draft_model:
        spec.update(method="draft_model", model=args.draft_model,
                    quantization=args.draft_quantization, draft_vocab_size=args.draft_vocab_size,
                    quantize_lm_head=args.draft_quantize_lm_head)
    else:
        spec.update(method="ngram", prompt_lookup_min=args.lookup_min,
                    prompt_lookup_max=args.lookup_max)
    off, on = Side(args, None), Side(args, spec)
    runs: dict[str, list[Any]] = {k: [] for k in ("s_off", "s_on", "a_off", "a_on")}
    for _ in range(args.repeats):  # alternated, so drift on a shared machine hits both
        runs["s_off"].append(off.single())
        runs["s_on"].append(on.single())
        runs["a_off"].append(off.agg16())
        runs["a_on"].append(on.agg16())
    med = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
    _, n, s_on_tokens, (drafts, proposed, accepted) = runs["s_on"][0]
    _, a_on_tokens, (_, a_proposed, a_accepted) = runs["a_on"][0]
    report = {
        "spec": spec, "threads": args.threads, "dtype": on.engine.config.dtype,
        "repeats": args.repeats, "decode_tokens": n,
        "decode_off": med["s_off"], "decode_spec": med["s_on"],
        "decode_speedup": med["s_on"] / med["s_off"],
        "agg16_off": med["a_off"], "agg16_spec": med["a_on"],
        "agg16_ratio": med["a_on"] / med["a_off"],
        "single_acceptance_rate": accepted / max(proposed, 1),
        "single_mean_acceptance_length": 1 + accepted / max(drafts, 1),
        "agg16_draft_tokens": a_proposed,
        "agg16_acceptance_rate": a_accepted / max(a_proposed, 1),
        "greedy_identical_single": runs["s_off"][0][2] == s_on_tokens,
        "greedy_identical_agg16": runs["a_off"][0][1] == a_on_tokens,
    }
    for key, value in report.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
