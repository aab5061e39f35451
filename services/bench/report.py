"""A BenchResult as a printed table (vLLM's layout plus pdmesh's sections) and as JSON.

The JSON written by `result_to_json` is the one documented format (see its docstring); the
plot lives in services.bench.plot.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from services.bench.client import RequestRecord
from services.bench.config import BenchConfig
from services.bench.metrics import LATENCY_METRICS, BenchResult
from services.bench.spec_decode import SpecDecodeSummary
from shared.protocol.pd import ApiKind

SCHEMA = "pdmesh.bench.result"
SCHEMA_VERSION = 1
TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def _rate(value: float) -> float | str:
    return "inf" if math.isinf(value) else value  # JSON has no infinity


def config_to_json(config: BenchConfig) -> dict[str, object]:
    return {
        "base_url": config.base_url, "endpoint": config.endpoint.path, "model": config.model,
        "dataset": config.dataset.kind.value,
        "dataset_path": str(config.dataset.path) if config.dataset.path else None,
        "input_len": config.input_len, "output_len": config.output_len,
        "num_prompts": config.num_prompts, "prefix_len": config.prefix_len,
        "num_prefixes": config.num_prefixes, "prompt_format": config.wire_format.value,
        "max_concurrency": config.max_concurrency, "request_rate": _rate(config.request_rate),
        "burstiness": config.burstiness, "ignore_eos": config.ignore_eos, "seed": config.seed,
        "goodput_slos_ms": dict(config.goodput), "percentiles": list(config.percentiles),
        "tokenizer_model": config.tokenizer_model, "extra_body": dict(config.extra_body),
    }


def record_to_json(record: RequestRecord) -> dict[str, object]:
    out = asdict(record)
    out["status"] = record.status.value
    out["itl_s"] = list(record.itl_s)
    return out


def result_to_json(result: BenchResult, config: BenchConfig) -> dict[str, object]:
    """The saved result. Schema `pdmesh.bench.result`, version 1:

    - `schema`, `version`, `date` (ISO 8601, UTC), `partial` (true when SIGINT cut the run:
      figures cover the requests finished by then), `config` (the flags, resolved).
    - vLLM `bench serve --save-result` keys, same names and units: `backend`, `model_id`,
      `num_prompts`, `request_rate` ("inf" or req/s), `burstiness`, `max_concurrency`,
      `duration` (s), `completed`, `failed`, `total_input_tokens`, `total_output_tokens`,
      `request_throughput`, `request_goodput` (null without SLOs), `output_throughput`,
      `total_token_throughput`, and for m in ttft/tpot/itl/e2el: `mean_{m}_ms`,
      `median_{m}_ms`, `std_{m}_ms`, `p{P}_{m}_ms` per requested percentile.
    - pdmesh additions: `cancelled` (in flight at SIGINT), `not_sent`, `unknown_input_lens`,
      `errors_by_type` {type: count}, `phases` {phase: {count, mean_ms, median_ms, p99_ms,
      total_s}}, `kv_transfer` {requests, total_bytes, total_s, gib_per_s},
      `disagg_decisions` {decision: count}, `retries` {total, requests_retried},
      `client` {cpu_s, user_s, sys_s, wall_s, percent_of_core, high}, `spec_decode` (null
      when the server exports no spec_decode_* counters) {drafts, draft_tokens,
      accepted_tokens, acceptance_rate, mean_acceptance_length, per_position_acceptance_rate},
      `requests` [one object per sent request: RequestRecord's fields, seconds].
    """
    out: dict[str, object] = {
        "schema": SCHEMA, "version": SCHEMA_VERSION,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "partial": result.partial, "config": config_to_json(config),
        "backend": "openai-chat" if config.endpoint is ApiKind.CHAT else "openai",
        "model_id": config.model, "num_prompts": result.completed + result.failed
        + result.cancelled + result.not_sent,
        "request_rate": _rate(config.request_rate), "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency, "duration": result.duration_s,
        "completed": result.completed, "failed": result.failed,
        "total_input_tokens": result.total_input_tokens,
        "total_output_tokens": result.total_output_tokens,
        "request_throughput": result.request_throughput,
        "request_goodput": result.request_goodput,
        "output_throughput": result.output_throughput,
        "total_token_throughput": result.total_token_throughput,
    }
    for name in LATENCY_METRICS:
        stats = result.latency[name]
        out[f"mean_{name}_ms"] = stats.mean_ms
        out[f"median_{name}_ms"] = stats.median_ms
        out[f"std_{name}_ms"] = stats.std_ms
        for label, value in stats.percentiles_ms.items():
            out[f"p{label}_{name}_ms"] = value
    out.update({
        "cancelled": result.cancelled, "not_sent": result.not_sent,
        "unknown_input_lens": result.unknown_input_lens,
        "errors_by_type": dict(result.errors_by_type),
        "phases": {k: asdict(v) for k, v in result.phases.items()},
        "kv_transfer": asdict(result.kv_transfer),
        "disagg_decisions": dict(result.disagg_decisions),
        "retries": {"total": result.retries_total, "requests_retried": result.requests_retried},
        "client": asdict(result.client_cpu),
        "spec_decode": asdict(result.spec_decode) if result.spec_decode else None,
        "requests": [record_to_json(r) for r in result.records],
    })
    return out


def save_json(result: BenchResult, config: BenchConfig, path: Path) -> None:
    """Written to a temporary name and renamed, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result_to_json(result, config), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


class _Table:
    """vLLM's fixed-width rows: a 40-column label and a value."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def row(self, label: str, value: object) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"
        self.line(f"{label:<40} {text}")

    def rule(self, title: str = "", fill: str = "-") -> None:
        self.line(f"{title:{fill}^50}")

    def line(self, text: str) -> None:
        print(text, file=self.out)


def print_table(result: BenchResult, config: BenchConfig, out: TextIO) -> None:
    t = _Table(out)
    t.rule(" Serving Benchmark Result " + ("(PARTIAL) " if result.partial else ""), "=")
    t.row("Successful requests:", result.completed)
    t.row("Failed requests:", result.failed)
    if result.partial:
        t.row("Cancelled (in flight at Ctrl-C):", result.cancelled)
        t.row("Not sent:", result.not_sent)
    if config.max_concurrency:
        t.row("Maximum request concurrency:", config.max_concurrency)
    t.row("Benchmark duration (s):", result.duration_s)
    t.row("Total input tokens:", result.total_input_tokens)
    t.row("Total generated tokens:", result.total_output_tokens)
    t.row("Request throughput (req/s):", result.request_throughput)
    if result.request_goodput is not None:
        t.row("Request goodput (req/s):", result.request_goodput)
    t.row("Output token throughput (tok/s):", result.output_throughput)
    t.row("Total Token throughput (tok/s):", result.total_token_throughput)
    for name in LATENCY_METRICS:
        stats, label = result.latency[name], LABELS[name]
        t.rule(TITLES[name])
        t.row(f"Mean {label} (ms):", stats.mean_ms)
        t.row(f"Median {label} (ms):", stats.median_ms)
        t.row(f"Std {label} (ms):", stats.std_ms)
        for p, value in stats.percentiles_ms.items():
            t.row(f"P{p} {label} (ms):", value)
    _print_pdmesh(result, t)
    if result.spec_decode is not None:
        _print_spec_decode(result.spec_decode, t)
    t.rule("Load generator")
    cpu = result.client_cpu
    t.row("Client CPU (% of one core):", cpu.percent_of_core)
    t.rule(fill="=")
    if result.unknown_input_lens:
        t.line(f"note: {result.unknown_input_lens} requests had no known prompt length "
               "(no tokenizer, no usage): input token totals are low")
    if cpu.high:
        t.line(f"warning: the load generator used {cpu.percent_of_core:.0f}% of a core; on a "
               "small machine it competes with the server and skews these figures")


def _print_pdmesh(result: BenchResult, t: _Table) -> None:
    """The sections only pdmesh's router fills: phases, KV transfer, routing; and errors."""
    if result.phases:
        t.rule("Phase breakdown (ms: mean / median / p99)")
        for name, st in result.phases.items():
            t.line(f"{name + ':':<24} {st.mean_ms:>8.2f} / {st.median_ms:>8.2f} / "
                   f"{st.p99_ms:>8.2f}  (n={st.count})")
    kv = result.kv_transfer
    if kv.requests:
        t.row("KV transferred (MiB):", kv.total_bytes / 2**20)
        if kv.gib_per_s is not None:
            t.row("KV transfer rate (GiB/s):", kv.gib_per_s)
    if result.disagg_decisions or result.retries_total:
        t.rule("Routing")
        for decision, count in result.disagg_decisions.items():
            t.row(f"Disagg decision {decision}:", count)
        t.row("Retries (total):", result.retries_total)
        t.row("Requests retried:", result.requests_retried)
    if result.errors_by_type:
        t.rule("Errors by type")
        for kind, count in result.errors_by_type.items():
            t.row(f"{kind}:", count)


def _print_spec_decode(spec: SpecDecodeSummary, t: _Table) -> None:
    """vLLM's `bench serve` section, from the server's counters over the run."""
    t.rule("Speculative Decoding")
    if spec.acceptance_rate is not None:
        t.row("Acceptance rate (%):", 100.0 * spec.acceptance_rate)
    if spec.mean_acceptance_length is not None:
        t.row("Acceptance length:", spec.mean_acceptance_length)
    t.row("Drafts:", spec.drafts)
    t.row("Draft tokens:", spec.draft_tokens)
    t.row("Accepted tokens:", spec.accepted_tokens)
    if spec.per_position_acceptance_rate:
        t.line("Per-position acceptance (%):")
        for i, rate in enumerate(spec.per_position_acceptance_rate):
            t.row(f"  Position {i}:", 100.0 * rate)
