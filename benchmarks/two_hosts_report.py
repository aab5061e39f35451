"""Figures of benchmarks/two_hosts.py: one Row per (link rate, prompt length, path, concurrency),
the KV throughput read from the workers' Prometheus histograms, and the printed table.

KV throughput is bytes over the transfer's own wall time, from the side that times the wire:
- pull: the decode's `pdmesh:kv_transfer_*{mode="pull",side="receive"}` (handshake, chunked
  pulls, digest checks, lease release);
- push: the prefill's `{mode="push",side="send"}` (from the prompt finishing to the decode
  holding every block; the decode's own receive timer also covers the prompt's compute).
Each is the delta of the histogram's `_sum` over one cell, so warm-ups and other cells
don't count. `line_fraction` puts it against the link: bytes * 8 / seconds / rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

KV_SECONDS = "pdmesh:kv_transfer_seconds"
KV_BYTES = "pdmesh:kv_transfer_bytes"
TIMED_SIDE = {"pull": "receive", "push": "send"}  # see the module docstring


def kv_sums(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """{(metric, mode, side): histogram _sum} from a /metrics page."""
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in (KV_SECONDS, KV_BYTES):
            continue
        for sample in family.samples:
            if sample.name == family.name + "_sum":
                key = (family.name, sample.labels.get("mode", ""), sample.labels.get("side", ""))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def kv_delta(before: dict[tuple[str, str, str], float], after: dict[tuple[str, str, str], float],
             mode: str) -> tuple[int, float]:
    """(bytes, seconds) moved in `mode` between two kv_sums, on the side that times the wire."""
    side = TIMED_SIDE[mode]
    nbytes = after.get((KV_BYTES, mode, side), 0.0) - before.get((KV_BYTES, mode, side), 0.0)
    secs = after.get((KV_SECONDS, mode, side), 0.0) - before.get((KV_SECONDS, mode, side), 0.0)
    return int(round(nbytes)), secs


def line_fraction(nbytes: int, seconds: float, rate_bit: int | None) -> float | None:
    """Achieved bits per second over the link's rate (None: no transfer, or loopback)."""
    if nbytes <= 0 or seconds <= 0 or not rate_bit:
        return None
    return nbytes * 8 / seconds / rate_bit


def median_ms(values_s: Sequence[float]) -> float | None:
    return statistics.median(values_s) * 1000.0 if values_s else None


@dataclass(frozen=True)
class Row:
    """One cell. Latencies are medians over the cell's requests, in ms; ttft is what a client
    sees through the router; t2 is the gap from the first token to the second (where a pull
    transfer shows); kv_gbit_s and line_frac are None where nothing crossed the link."""

    link: str  # "10gbit", "1gbit", "loopback"
    prompt_len: int
    path: str  # "pull", "push", "mixed", "pp"
    concurrency: int
    requests: int
    failed: int
    ttft_ms: float | None
    t2_ms: float | None
    itl_ms: float | None
    e2el_ms: float | None
    kv_bytes: int
    kv_s: float
    kv_gbit_s: float | None
    line_frac: float | None
    load1: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def kv_columns(nbytes: int, seconds: float, rate_bit: int | None
               ) -> tuple[float | None, float | None]:
    gbit = nbytes * 8 / seconds / 1e9 if nbytes > 0 and seconds > 0 else None
    return gbit, line_fraction(nbytes, seconds, rate_bit)


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEADER = (f"{'link':>8} {'prompt':>6} {'path':>6} {'conc':>4} {'n':>3} {'TTFT':>8} {'2nd tok':>8} "
          f"{'ITL':>6} {'E2EL':>8} {'KV MiB':>7} {'KV Gbit/s':>9} {'of line':>7} {'load1':>5}")


def format_row(r: Row) -> str:
    mib = r.kv_bytes / 2**20 if r.kv_bytes else None
    return (f"{r.link:>8} {r.prompt_len:>6} {r.path:>6} {r.concurrency:>4} {r.requests:>3} "
            f"{_f(r.ttft_ms, '8.1f')} {_f(r.t2_ms, '8.1f')} {_f(r.itl_ms, '6.1f')} "
            f"{_f(r.e2el_ms, '8.1f')} {_f(mib, '7.1f')} {_f(r.kv_gbit_s, '9.2f')} "
            f"{_f(r.line_frac, '7.0%')} {r.load1:>5.2f}")


def pd_vs_mixed(rows: Sequence[Row]) -> list[str]:
    """Per link, prompt and concurrency: each P/D path's TTFT and E2EL over the mixed
    worker's (below 1: disaggregation pays)."""
    mixed = {(r.link, r.prompt_len, r.concurrency): r for r in rows if r.path == "mixed"}
    lines = []
    for r in rows:
        base = mixed.get((r.link, r.prompt_len, r.concurrency))
        if r.path not in TIMED_SIDE or base is None:
            continue
        ratios = [f"{name} x{mine / theirs:.2f}"
                  for name, mine, theirs in (("TTFT", r.ttft_ms, base.ttft_ms),
                                             ("E2EL", r.e2el_ms, base.e2el_ms))
                  if mine is not None and theirs]
        lines.append(f"{r.link:>8} {r.prompt_len:>6} {r.path:>5} conc {r.concurrency}: "
                     f"{', '.join(ratios)} of mixed")
    return lines
