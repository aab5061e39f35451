"""The figures of benchmarks/peers.py, each labelled with the CPU kind it was measured on.

- `write_ratio_png`: pdmesh / peer per matrix cell, one bar per (pdmesh system, peer) pair.
- `write_curves_png`: the scaling curves. Output tok/s and TPOT against concurrency, at the
  prompt length swept over the most concurrencies, and TTFT against prompt length, at the
  concurrency swept over the most lengths (`peers.py --curves` runs exactly those two sweeps).
  Each system is one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RATIO_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
_CELL = re.compile(r"c(\d+)/in(\d+)$")
Summary = dict[str, dict[str, dict[str, float]]]  # system -> cell label -> metric -> median


def cpu_kind() -> str:
    """'<model name> (<the kernel-relevant flags>), N cores': the figures' and JSON's label."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"unknown CPU, {os.cpu_count()} cores"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = set(text.split())
    kinds = [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    if not kinds:
        kinds = ["avx2"] if "avx2" in flags else ["no avx2"]
    return f"{model} ({', '.join(kinds)}), {os.cpu_count()} cores"


def _cell(label: str) -> tuple[int, int]:
    """'c4/in200' -> (4, 200)."""
    match = _CELL.match(label)
    if match is None:
        raise ValueError(f"not a peers cell label: {label!r}")
    return int(match[1]), int(match[2])


def sweeps(summary: Summary) -> tuple[int | None, int | None]:
    """(the prompt length with the most concurrencies, the concurrency with the most prompt
    lengths), the smaller on ties; None where no sweep has two points."""
    cells = {_cell(label) for by_cell in summary.values() for label in by_cell}
    by_len: dict[int, set[int]] = {}
    by_conc: dict[int, set[int]] = {}
    for conc, length in cells:
        by_len.setdefault(length, set()).add(conc)
        by_conc.setdefault(conc, set()).add(length)
    best_len = min(by_len, key=lambda n: (-len(by_len[n]), n), default=None)
    best_conc = min(by_conc, key=lambda c: (-len(by_conc[c]), c), default=None)
    return (best_len if best_len is not None and len(by_len[best_len]) > 1 else None,
            best_conc if best_conc is not None and len(by_conc[best_conc]) > 1 else None)


def curve(summary: Summary, system: str, metric: str, *, length: int | None = None,
          concurrency: int | None = None) -> list[tuple[int, float]]:
    """(x, metric) points of one system, x ascending: concurrency at a fixed prompt length,
    or prompt length at a fixed concurrency (give exactly one of the two)."""
    if (length is None) == (concurrency is None):
        raise ValueError("curve: fix either the prompt length or the concurrency")
    points = []
    for label, metrics in summary.get(system, {}).items():
        conc, n = _cell(label)
        if length is not None and n == length:
            points.append((conc, metrics[metric]))
        elif concurrency is not None and conc == concurrency:
            points.append((n, metrics[metric]))
    return sorted(points)


def write_curves_png(summary: Summary, path: Path, caption: str) -> bool:
    """The three scaling panels; False (and no file) when the run swept nothing."""
    length, conc = sweeps(summary)
    if length is None and conc is None:
        return False
    from services.bench.plot import pyplot

    plt = pyplot()
    panels = [("output_throughput", "output tok/s", {"length": length}, "concurrency"),
              ("median_tpot_ms", "median TPOT (ms)", {"length": length}, "concurrency"),
              ("median_ttft_ms", "median TTFT (ms)", {"concurrency": conc}, "prompt tokens")]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for ax, (metric, ylabel, fixed, xlabel) in zip(axes, panels, strict=True):
        (key, value), = fixed.items()
        if value is None:
            ax.set_title(f"{ylabel}: no {xlabel} sweep in this run")
            continue
        xs: set[int] = set()
        for system in summary:
            points = curve(summary, system, metric, **{key: value})
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=system)
                xs.update(x for x, _ in points)
        ax.set_xscale("log")
        ax.set_xticks(sorted(xs), [str(x) for x in sorted(xs)])  # the measured points
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        where = f"{value}-token prompts" if key == "length" else f"concurrency {value}"
        ax.set_title(f"{ylabel} vs {xlabel} ({where})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(caption)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_ratio_png(rows: list[dict[str, object]], path: Path, caption: str) -> None:
    """pdmesh / peer bars per cell, one panel per ratio metric (1 = parity)."""
    from services.bench.plot import pyplot

    plt = pyplot()
    pairs = list(dict.fromkeys((r["pdmesh"], r["peer"]) for r in rows))
    labels = list(dict.fromkeys(r["cell"] for r in rows))
    fig, axes = plt.subplots(1, len(RATIO_METRICS), figsize=(6 * len(RATIO_METRICS), 5.5))
    width = 0.8 / max(len(pairs), 1)
    for ax, metric in zip(axes, RATIO_METRICS, strict=True):
        for k, pair in enumerate(pairs):
            vals = {r["cell"]: r[metric] for r in rows if (r["pdmesh"], r["peer"]) == pair}
            xs = [i + k * width for i in range(len(labels))]
            ax.bar(xs, [vals.get(label) or 0 for label in labels], width, label=" / ".join(pair))
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_yscale("log")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30)
        ax.set_title(f"{metric}: pdmesh / peer")
    axes[0].legend(fontsize=7)
    fig.suptitle(caption)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
