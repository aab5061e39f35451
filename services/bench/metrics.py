"""Pure functions from RequestRecords to a BenchResult, with vLLM's benchmark definitions.

Only completed requests enter the latency figures and token totals (as in vLLM):
- TPOT = (e2el - ttft) / (output_tokens - 1), for requests with more than one output token.
  For goodput a request with one token counts as TPOT 0 (vLLM's rule).
- ITL: every inter-chunk gap of every completed request, pooled.
- goodput: completed requests meeting every given SLO (value <= SLO), per second of run.
- Throughputs divide by the run duration. Statistics: numpy mean, population std, median and
  linear-interpolated percentiles; an empty sample reports 0 like vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.bench.client import RequestRecord, RequestStatus
from services.bench.config import percentile_label
from services.bench.spec_decode import SpecDecodeSummary

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PHASE_ORDER = ("queue", "prefill", "handshake", "kv_transfer", "first_token", "decode")


@dataclass(frozen=True)
class LatencyStats:
    """One metric's distribution in milliseconds; percentiles keyed by vLLM's label ("99")."""

    count: int
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[str, float]


@dataclass(frozen=True)
class PhaseStats:
    count: int
    mean_ms: float
    median_ms: float
    p99_ms: float
    total_s: float


@dataclass(frozen=True)
class ClientCpu:
    """The load generator's own CPU use over the run; percent is of one core."""

    cpu_s: float
    user_s: float
    sys_s: float
    wall_s: float
    percent_of_core: float
    high: bool


@dataclass(frozen=True)
class KvTransfer:
    requests: int
    total_bytes: int
    total_s: float
    gib_per_s: float | None  # total bytes over summed kv_transfer seconds


@dataclass(frozen=True)
class BenchResult:
    """Everything a run reports; report.result_to_json is its one serialisation."""

    duration_s: float
    partial: bool
    completed: int
    failed: int
    cancelled: int
    not_sent: int
    total_input_tokens: int
    unknown_input_lens: int  # completed requests whose prompt length nobody reported
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    latency: dict[str, LatencyStats]  # keys: LATENCY_METRICS
    errors_by_type: dict[str, int]
    phases: dict[str, PhaseStats]
    kv_transfer: KvTransfer
    disagg_decisions: dict[str, int]
    retries_total: int
    requests_retried: int
    client_cpu: ClientCpu
    records: tuple[RequestRecord, ...] = field(repr=False, default=())
    # From the server's spec_decode_* counters (None: not exposed; see bench.spec_decode).
    spec_decode: SpecDecodeSummary | None = None


def tpot_s(record: RequestRecord) -> float | None:
    if record.output_tokens <= 1 or record.e2el_s is None or record.ttft_s is None:
        return None
    return (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return LatencyStats(0, 0.0, 0.0, 0.0, {percentile_label(p): 0.0 for p in percentiles})
    return LatencyStats(
        count=int(arr.size), mean_ms=float(arr.mean()), median_ms=float(np.median(arr)),
        std_ms=float(arr.std()),
        percentiles_ms={percentile_label(p): float(np.percentile(arr, p)) for p in percentiles})


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Seconds per metric over completed requests; ITL pools every request's gaps."""
    ok = [r for r in records if r.status is RequestStatus.OK]
    return {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for t in map(tpot_s, ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok if r.e2el_s is not None],
    }


def good_requests(records: Sequence[RequestRecord], slos_ms: dict[str, float]) -> int:
    """Completed requests meeting every SLO given (ttft, tpot, e2el in ms)."""
    good = 0
    for r in records:
        if r.status is not RequestStatus.OK:
            continue
        observed = {"ttft": r.ttft_s, "tpot": tpot_s(r) or 0.0, "e2el": r.e2el_s}
        if all(_within_slo(observed[k], slo, k) for k, slo in slos_ms.items()):
            good += 1
    return good


def _within_slo(seconds: float | None, slo_ms: float, metric: str) -> bool:
    if seconds is None:  # a completed request always has its ttft and e2el
        raise ValueError(f"completed request without a {metric} timing")
    return seconds * 1000.0 <= slo_ms


def phase_stats(records: Sequence[RequestRecord]) -> dict[str, PhaseStats]:
    """Per phase over completed requests that reported it; pdmesh's order first, then others."""
    samples: dict[str, list[float]] = {}
    for r in records:
        if r.status is RequestStatus.OK:
            for name, seconds in r.pdmesh.phases.items():
                samples.setdefault(name, []).append(seconds)
    names = [p for p in PHASE_ORDER if p in samples] + sorted(set(samples) - set(PHASE_ORDER))
    out = {}
    for name in names:
        arr = np.asarray(samples[name]) * 1000.0
        out[name] = PhaseStats(int(arr.size), float(arr.mean()), float(np.median(arr)),
                               float(np.percentile(arr, 99)), float(arr.sum() / 1000.0))
    return out


def kv_transfer(records: Sequence[RequestRecord]) -> KvTransfer:
    done = [r for r in records if r.status is RequestStatus.OK and r.pdmesh.kv_bytes is not None]
    total_bytes = sum(r.pdmesh.kv_bytes or 0 for r in done)
    total_s = sum(r.pdmesh.phases.get("kv_transfer", 0.0) for r in done)
    rate = total_bytes / total_s / 2**30 if total_s > 0 else None
    return KvTransfer(len(done), total_bytes, total_s, rate)


def compute(records: Sequence[RequestRecord], duration_s: float, *, slos_ms: dict[str, float],
            percentiles: Sequence[float], partial: bool, not_sent: int,
            client_cpu: ClientCpu) -> BenchResult:
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in records if r.status is RequestStatus.OK]
    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    values = latency_samples(records)
    failed = [r for r in records if r.status is RequestStatus.FAILED]
    return BenchResult(
        duration_s=duration_s, partial=partial, completed=len(ok), failed=len(failed),
        cancelled=sum(r.status is RequestStatus.CANCELLED for r in records), not_sent=not_sent,
        total_input_tokens=total_in,
        unknown_input_lens=sum(r.prompt_len is None for r in ok),
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        request_goodput=good_requests(ok, slos_ms) / duration_s if slos_ms else None,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        latency={m: latency_stats(values[m], percentiles) for m in LATENCY_METRICS},
        errors_by_type=dict(Counter(r.error_type or "unknown" for r in failed).most_common()),
        phases=phase_stats(records),
        kv_transfer=kv_transfer(records),
        disagg_decisions=dict(Counter(r.pdmesh.disagg_decision for r in ok
                                      if r.pdmesh.disagg_decision is not None).most_common()),
        retries_total=sum(r.pdmesh.retries or 0 for r in records),
        requests_retried=sum(bool(r.pdmesh.retries) for r in records),
        client_cpu=client_cpu,
        records=tuple(records),
    )


def client_cpu(cpu_s: float, user_s: float, sys_s: float, wall_s: float,
               warn_percent: float) -> ClientCpu:
    percent = 100.0 * cpu_s / wall_s if wall_s > 0 else 0.0
    return ClientCpu(cpu_s, user_s, sys_s, wall_s, percent, percent > warn_percent)
