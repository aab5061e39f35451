"""Per-step cost of the output parsers (shared/parsing) as a generation grows.

    .venv/bin/python benchmarks/parser_cost.py [--tokens 16000] [--chars-per-token 4]
                                               [--window 200] [--repeats 3]
                                               [--stat median|mean]

Each workload is a generation in one format, fed as ~4-character deltas (one token's worth)
through the request's ChatStreamParser, as the worker does. At each checkpoint (100 ...
16,000 tokens fed) the table gives the median (or mean) cost of one `feed` over the
`--window` steps just before it, in microseconds (best of `--repeats` runs: the machine may
be shared). A flat row is the point: a step costs O(len(delta)), never O(text so far). The
last column is the cost at the last checkpoint over that at the first: ~1 when flat, where a
per-step rescan of the whole text would grow in proportion to the text.

Workloads: `think` a long `<think>` reasoning; `hermes`, `llama3_json`, `mistral`, `channel`
many calls in a row (each call decoded once, when it closes); `hermes-1-call` and
`channel-1-call` one call whose single argument is the whole generation (the open structure
must not be rescanned each step); `pythonic` one long call list (closed only at the end).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

from shared.parsing import ChatStreamParser, get_reasoning_parser, get_tool_parser

CHECKPOINTS = (100, 500, 1000, 2000, 4000, 8000, 16000)
TOOLS = [{"name": "search", "parameters": {"type": "object",
                                           "properties": {"query": {"type": "string"}}}}]
_WORDS = "the quick brown fox jumps over the lazy dog while < and > and [ stay text "


def _repeat(head: str, unit: str, tail: str, chars: int) -> str:
    return head + unit * (chars // len(unit) + 1) + tail


def _atem_call(query: str) -> str:
    return ('<atem:function_calls><atem:invoke name="search"><atem:parameter name="query">'
            f"{query}</atem:parameter></atem:invoke></atem:function_calls>")


def workloads(chars: int) -> dict[str, tuple[Callable[[], ChatStreamParser], str]]:
    """name -> (a fresh request parser, the generation text of at least `chars` chars)."""
    def chain(reasoning: str | None, tools: str | None) -> Callable[[], ChatStreamParser]:
        return lambda: ChatStreamParser(
            get_reasoning_parser(reasoning)() if reasoning else None,
            get_tool_parser(tools)(TOOLS) if tools else None)

    hermes_call = '<tool_call>\n{"name": "search", "arguments": {"query": "fox"}}\n</tool_call>\n'
    channel_unit = (" to=self<|message|>" + _WORDS + "<|eom|><|start|>assistant to=search"
                    "<|message|>" + _atem_call("fox") + "<|eom|><|start|>assistant")
    return {
        "think": (chain("qwen3", None), _repeat("<think>\n", _WORDS, "</think>ok", chars)),
        "hermes": (chain("qwen3", "hermes"), _repeat("", _WORDS + hermes_call, "", chars)),
        "hermes-1-call": (chain(None, "hermes"), _repeat(
            '<tool_call>{"name": "search", "arguments": {"query": "', _WORDS, '"}}</tool_call>',
            chars)),
        "llama3_json": (chain(None, "llama3_json"), _repeat(
            "", '{"name": "search", "parameters": {"query": "fox jumps"}}; ', "", chars)),
        "mistral": (chain(None, "mistral"), _repeat(
            "", '[TOOL_CALLS]search[ARGS]{"query": "fox jumps over"}', "", chars)),
        "pythonic": (chain(None, "pythonic"), _repeat("[", 'search(query="fox jumps"), ',
                                                      "]", chars)),
        "channel": (chain(None, "channel"), _repeat("", channel_unit, "", chars)),
        "channel-1-call": (chain(None, "channel"), _repeat(
            " to=search<|message|>" + _atem_call("")[:-len("</atem:parameter></atem:invoke>"
                                                          "</atem:function_calls>")],
            _WORDS, "</atem:parameter></atem:invoke></atem:function_calls><|eom|>", chars)),
    }


def step_costs(make: Callable[[], ChatStreamParser], deltas: list[str]) -> list[float]:
    """Seconds of each feed, in order."""
    parser = make()
    costs = []
    clock = time.perf_counter
    for delta in deltas:
        start = clock()
        parser.feed(delta)
        costs.append(clock() - start)
    parser.finish()
    return costs


def profile(make: Callable[[], ChatStreamParser], text: str, args: argparse.Namespace,
            checkpoints: list[int]) -> list[float]:
    """Median microseconds per step before each checkpoint, best of the repeats."""
    size = args.chars_per_token
    deltas = [text[i:i + size] for i in range(0, args.tokens * size, size)]
    best = [float("inf")] * len(checkpoints)
    for _ in range(args.repeats):
        costs = step_costs(make, deltas)
        for i, n in enumerate(checkpoints):
            window = costs[max(0, n - args.window):n]
            stat = statistics.median if args.stat == "median" else statistics.fmean
            best[i] = min(best[i], stat(window) * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16000)
    parser.add_argument("--chars-per-token", type=int, default=4)
    parser.add_argument("--window", type=int, default=200, help="steps per median")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stat", choices=("median", "mean"), default="median",
                        help="mean shows amortised work too (a call decoded when it closes)")
    args = parser.parse_args(argv)
    # The feeding stops at --tokens, mid-structure: the parsers' "unfinished call" warnings at
    # finish() are expected here.
    logging.disable(logging.WARNING)
    checkpoints = [n for n in CHECKPOINTS if n <= args.tokens]
    print(f"us per feed() of a {args.chars_per_token}-char delta, {args.stat} of the "
          f"{args.window} steps before each point (best of {args.repeats})")
    print(f"{'workload':<15}" + "".join(f"{n:>8}" for n in checkpoints) + f"{'last/first':>12}")
    for name, (make, text) in workloads(args.tokens * args.chars_per_token).items():
        row = profile(make, text, args, checkpoints)
        cells = "".join(f"{us:>8.2f}" for us in row)
        print(f"{name:<15}{cells}{row[-1] / row[0]:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
