"""Metric definitions against values computed independently (statistics, hand formulas)."""

from __future__ import annotations

import math
import statistics

import pytest

from services.bench.client import PdmeshInfo, RequestRecord, RequestStatus, parse_pdmesh_info
from services.bench.metrics import client_cpu, compute

OK, FAILED, CANCELLED = RequestStatus.OK, RequestStatus.FAILED, RequestStatus.CANCELLED
CPU = client_cpu(0.5, 0.4, 0.1, 2.0, 50.0)


def pct(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (R type 7), written out by hand."""
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rec(index: int, status: RequestStatus = OK, *, ttft: float | None = None,
        e2el: float | None = None, out: int = 0, itl: tuple[float, ...] = (),
        prompt: int | None = 10, error: str | None = None,
        info: PdmeshInfo | None = None) -> RequestRecord:
    return RequestRecord(index, status, 0.0, prompt, 16, output_tokens=out, ttft_s=ttft,
                         e2el_s=e2el, itl_s=itl, error_type=error,
                         pdmesh=info or PdmeshInfo())


def sample() -> list[RequestRecord]:
    return [
        rec(0, ttft=0.100, e2el=0.500, out=5, itl=(0.1, 0.1, 0.1, 0.1), prompt=10),
        rec(1, ttft=0.200, e2el=1.400, out=9, itl=(0.1, 0.2) * 4, prompt=20),
        rec(2, ttft=0.050, e2el=0.050, out=1, prompt=30),  # one token: no TPOT
        rec(3, FAILED, error="http_503:ServiceUnavailableError", prompt=40),
        rec(4, FAILED, error="timeout", prompt=50),
        rec(5, CANCELLED, prompt=60),
    ]


def test_counts_and_throughputs() -> None:
    r = compute(sample(), 2.0, slos_ms={}, percentiles=[99], partial=False, not_sent=0,
                client_cpu=CPU)
    assert (r.completed, r.failed, r.cancelled) == (3, 2, 1)
    assert r.total_input_tokens == 10 + 20 + 30  # completed requests only, like vLLM
    assert r.total_output_tokens == 5 + 9 + 1
    assert r.request_throughput == pytest.approx(3 / 2.0)
    assert r.output_throughput == pytest.approx(15 / 2.0)
    assert r.total_token_throughput == pytest.approx((60 + 15) / 2.0)
    assert r.request_goodput is None
    assert r.errors_by_type == {"http_503:ServiceUnavailableError": 1, "timeout": 1}


def test_latency_statistics() -> None:
    percentiles = [50, 90, 99, 99.9]
    r = compute(sample(), 2.0, slos_ms={}, percentiles=percentiles, partial=False,
                not_sent=0, client_cpu=CPU)
    ttft = [100.0, 200.0, 50.0]
    tpot = [(500 - 100) / 4, (1400 - 200) / 8]  # (e2el - ttft) / (out - 1), ms
    itl = [100.0] * 4 + [100.0, 200.0] * 4
    e2el = [500.0, 1400.0, 50.0]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        stats = r.latency[name]
        assert stats.count == len(values)
        assert stats.mean_ms == pytest.approx(statistics.fmean(values))
        assert stats.median_ms == pytest.approx(statistics.median(values))
        assert stats.std_ms == pytest.approx(statistics.pstdev(values))
        assert stats.percentiles_ms["50"] == pytest.approx(statistics.median(values))
        assert stats.percentiles_ms["90"] == pytest.approx(
            statistics.quantiles(values, n=10, method="inclusive")[8])
        assert stats.percentiles_ms["99"] == pytest.approx(pct(values, 99))
        assert stats.percentiles_ms["99.9"] == pytest.approx(pct(values, 99.9))


def test_goodput_needs_every_slo() -> None:
    records = sample()
    # ttft <= 150 and tpot <= 120: request 0 (100, 100) and request 2 (50, TPOT counted as 0).
    r = compute(records, 2.0, slos_ms={"ttft": 150, "tpot": 120}, percentiles=[99],
                partial=False, not_sent=0, client_cpu=CPU)
    assert r.request_goodput == pytest.approx(2 / 2.0)
    # Adding e2el <= 400 drops request 0 (500 ms).
    r = compute(records, 2.0, slos_ms={"ttft": 150, "tpot": 120, "e2el": 400},
                percentiles=[99], partial=False, not_sent=0, client_cpu=CPU)
    assert r.request_goodput == pytest.approx(1 / 2.0)
    # An SLO exactly at the observed value passes (<=).
    r = compute(records, 2.0, slos_ms={"ttft": 200}, percentiles=[99], partial=False,
                not_sent=0, client_cpu=CPU)
    assert r.request_goodput == pytest.approx(3 / 2.0)


def test_empty_run_reports_zeros() -> None:
    r = compute([rec(0, FAILED, error="empty_stream")], 1.0, slos_ms={"ttft": 1},
                percentiles=[99], partial=True, not_sent=4, client_cpu=CPU)
    assert r.completed == 0 and r.request_goodput == 0.0 and r.not_sent == 4
    assert r.latency["ttft"].mean_ms == 0.0 and r.latency["itl"].percentiles_ms["99"] == 0.0


def test_phase_breakdown_kv_and_routing() -> None:
    prefill = [0.010, 0.020, 0.060]
    kv_s = [0.001, 0.002, 0.003]
    records = [
        rec(i, ttft=0.1, e2el=0.2, out=2, itl=(0.1,), info=PdmeshInfo(
            {"decode": 0.05, "prefill": p, "kv_transfer": k, "custom": 0.5},
            kv_bytes=2**20 * (i + 1), disagg_decision="remote_prefill" if i else "local",
            retries=i))
        for i, (p, k) in enumerate(zip(prefill, kv_s, strict=True))
    ]
    r = compute(records, 1.0, slos_ms={}, percentiles=[99], partial=False, not_sent=0,
                client_cpu=CPU)
    assert list(r.phases) == ["prefill", "kv_transfer", "decode", "custom"]  # pdmesh order
    ms = [p * 1000 for p in prefill]
    assert r.phases["prefill"].mean_ms == pytest.approx(statistics.fmean(ms))
    assert r.phases["prefill"].median_ms == pytest.approx(statistics.median(ms))
    assert r.phases["prefill"].p99_ms == pytest.approx(pct(ms, 99))
    assert r.phases["prefill"].total_s == pytest.approx(sum(prefill))
    assert r.kv_transfer.total_bytes == 6 * 2**20
    assert r.kv_transfer.gib_per_s == pytest.approx(6 * 2**20 / sum(kv_s) / 2**30)
    assert r.disagg_decisions == {"remote_prefill": 2, "local": 1}
    assert (r.retries_total, r.requests_retried) == (3, 2)


def test_client_cpu_percent_and_warning() -> None:
    assert client_cpu(0.3, 0.2, 0.1, 1.0, 50.0).percent_of_core == pytest.approx(30.0)
    assert not client_cpu(0.3, 0.2, 0.1, 1.0, 50.0).high
    assert client_cpu(1.2, 1.0, 0.2, 2.0, 50.0).high  # 60% of a core


def test_router_phase_document_parses() -> None:
    from services.router.phases import Phases

    doc = Phases(decision="remote_prefill", queue_ms=1.5, prefill_ms=20.0, first_token_ms=25.0,
                 decode_ms=300.0, total_ms=330.0, attempts=2, prefill_worker="p0")
    doc.merge_reported({"handshake_ms": 2.0, "kv_transfer_ms": 4.0, "kv_bytes": 4096})
    info = parse_pdmesh_info(doc.as_dict())
    assert info.phases == pytest.approx({"queue": 0.0015, "prefill": 0.020, "first_token": 0.025,
                                         "decode": 0.300, "handshake": 0.002,
                                         "kv_transfer": 0.004})
    assert (info.disagg_decision, info.retries, info.kv_bytes) == ("remote_prefill", 1, 4096)
    # the brief's spelling: seconds, disagg_decision, retries
    info = parse_pdmesh_info({"prefill": 0.5, "decode_s": 1.0, "disagg_decision": "local",
                              "retries": 0, "kv_bytes": None, "first_token_ms": None})
    assert info.phases == {"prefill": 0.5, "decode": 1.0}
    assert (info.disagg_decision, info.retries, info.kv_bytes) == ("local", 0, None)
