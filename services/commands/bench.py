"""`pdmesh bench`: load-test any OpenAI-compatible server and report vLLM's serving metrics.

Thin CLI over services.bench: flags -> BenchConfig -> runner.run -> report. Exit status:
0 done, 1 no request completed (or the plot failed), 2 bad flags, 130 interrupted (partial).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.bench.config import (
    BenchConfig,
    PromptFormat,
    parse_dataset,
    parse_goodput,
    parse_percentiles,
    parse_rate,
)

# stdlib-only module: cheap enough for every `pdmesh` start (the CLI imports all commands)
from shared.protocol.pd import ApiKind

HELP = "Benchmark an OpenAI-compatible server (TTFT/TPOT/ITL/E2EL, goodput, pdmesh phases)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (no /v1)")
    add("--model", required=True, help="model name sent in each request")
    add("--endpoint", default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"])
    add("--dataset", default="random", help="random | prefix-repetition | jsonl:PATH "
        '(lines {"prompt": text or token ids, "output_len"?: N})')
    add("--input-len", type=int, default=1024, help="prompt tokens (random, prefix-repetition)")
    add("--output-len", type=int, default=128, help="max_tokens per request")
    add("--num-prompts", type=int, default=None,
        help="requests to send (default 1000; jsonl: every line)")
    add("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens")
    add("--num-prefixes", type=int, default=10, help="prefix-repetition: number of groups")
    add("--prompt-format", default="auto", choices=["auto", "ids", "text"],
        help="auto: token ids for /v1/completions, text for chat")
    add("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    add("--request-rate", default="inf", help="requests/s (Poisson/gamma arrivals) or inf")
    add("--burstiness", type=float, default=1.0,
        help="gamma shape of the arrivals: 1 Poisson, <1 burstier, >1 steadier")
    add("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/pdmesh extension)")
    add("--seed", type=int, default=0)
    add("--goodput", nargs="+", default=[], metavar="KEY:MS",
        help="SLOs for request goodput: ttft:MS tpot:MS e2el:MS")
    add("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    add("--save-result", type=Path, default=None, help="write the JSON result here")
    add("--plot", type=Path, default=None, help="write latency CDFs and phases as PNG")
    add("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    add("--tokenizer-model", default=None,
        help="local tokenizer (tokenizer.json, its directory, or a pdmesh model name) "
             "instead of the server's /tokenize")
    add("--extra-body", default="{}", help="JSON object merged into every request body")
    add("--request-timeout", type=float, default=600.0, help="seconds per request")
    add("--no-progress", action="store_true", help="no progress bar")


def build_config(args: argparse.Namespace) -> BenchConfig:
    extra = json.loads(args.extra_body)
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=ApiKind.from_path(args.endpoint),
        dataset=parse_dataset(args.dataset), input_len=args.input_len,
        output_len=args.output_len, num_prompts=args.num_prompts, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, prompt_format=PromptFormat(args.prompt_format),
        max_concurrency=args.max_concurrency, request_rate=parse_rate(args.request_rate),
        burstiness=args.burstiness, ignore_eos=args.ignore_eos, seed=args.seed,
        goodput=parse_goodput(args.goodput), percentiles=parse_percentiles(args.percentiles),
        save_result=args.save_result, plot=args.plot, api_key=args.api_key,
        tokenizer_model=args.tokenizer_model, extra_body=extra,
        request_timeout_s=args.request_timeout, progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError too
        print(f"pdmesh bench: error: {exc}", file=sys.stderr)
        return 2
    from services.bench import report, runner
    from services.bench.datasets import DatasetError
    from services.bench.plot import PlotUnavailable, write_plot
    from services.bench.tokenizer import TokenizerError

    try:
        result = runner.run(config)
    except (DatasetError, TokenizerError) as exc:
        print(f"pdmesh bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the load started (or a second Ctrl-C): nothing to save
        print("pdmesh bench: interrupted", file=sys.stderr)
        return 130
    report.print_table(result, config, sys.stdout)
    if config.save_result:
        report.save_json(result, config, config.save_result)
        print(f"saved {config.save_result}" + (" (partial)" if result.partial else ""))
    status = 130 if result.partial else (0 if result.completed else 1)
    if config.plot:
        try:
            write_plot(result, config.plot, f"{config.model} @ {config.base_url}")
            print(f"plot {config.plot}")
        except PlotUnavailable as exc:
            print(f"pdmesh bench: {exc}", file=sys.stderr)
            status = status or 1
    return status
