"""The --plot PNG: latency CDFs (TTFT, TPOT, ITL, E2E), the phase breakdown and a summary.

matplotlib is optional (the `bench` extra) and imported only here, only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from services.bench.metrics import LATENCY_METRICS, BenchResult, latency_samples

if TYPE_CHECKING:
    from matplotlib.axes import Axes

TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


class PlotUnavailable(RuntimeError):
    pass


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend, or PlotUnavailable saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib: `.venv/bin/pip install matplotlib` "
            "(or install pdmesh with the `bench` extra)") from exc
    return plt


def write_plot(result: BenchResult, path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    samples = latency_samples(result.records)
    for ax, name in zip(axes.flat[:4], LATENCY_METRICS, strict=True):
        _cdf(ax, np.asarray(samples[name]) * 1000.0, TITLES[name])
    _phases(axes.flat[4], result)
    _summary(axes.flat[5], result)
    fig.suptitle(title + ("  (PARTIAL)" if result.partial else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(ax: Axes, values_ms: np.ndarray, title: str) -> None:
    ax.set_title(f"{title} CDF")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if values_ms.size == 0:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(values_ms)
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
    for q in (50, 99):
        v = float(np.percentile(xs, q))
        ax.axvline(v, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"p{q} {v:.1f}", (v, q / 100), fontsize=8, xytext=(3, -10),
                    textcoords="offset points")


def _phases(ax: Axes, result: BenchResult) -> None:
    ax.set_title("Phase breakdown (pdmesh router)")
    if not result.phases:
        ax.text(0.5, 0.5, "no per-phase data\n(server sent no x-pdmesh-phases)",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    names = list(result.phases)
    y = np.arange(len(names))
    ax.barh(y - 0.2, [result.phases[n].mean_ms for n in names], height=0.4, label="mean")
    ax.barh(y + 0.2, [result.phases[n].p99_ms for n in names], height=0.4, label="p99")
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend()
    ax.grid(axis="x", alpha=0.3)


def _summary(ax: Axes, result: BenchResult) -> None:
    ax.set_axis_off()
    goodput = "-" if result.request_goodput is None else f"{result.request_goodput:.2f}"
    lines = [
        f"completed {result.completed}   failed {result.failed}",
        f"duration {result.duration_s:.1f} s",
        f"request throughput {result.request_throughput:.2f} req/s",
        f"request goodput {goodput} req/s",
        f"output throughput {result.output_throughput:.1f} tok/s",
        f"total throughput {result.total_token_throughput:.1f} tok/s",
        f"client CPU {result.client_cpu.percent_of_core:.0f}% of a core",
    ]
    lines += [f"error {k}: {v}" for k, v in list(result.errors_by_type.items())[:5]]
    lines += [f"disagg {k}: {v}" for k, v in result.disagg_decisions.items()]
    ax.text(0.02, 0.98, "\n".join(lines), va="top", ha="left", family="monospace",
            transform=ax.transAxes)
