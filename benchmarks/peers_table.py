"""Markdown tables from benchmarks/peers.py results: absolute figures, ratios, losing rows.

    .venv/bin/python benchmarks/peers_table.py benchmarks/results/peers-A.json [B.json ...]

Several files (e.g. one run per prompt length) are merged; a cell measured twice keeps the
later file's figures. Per system and cell: output tok/s, median TTFT and TPOT (medians over
the ABBA repeats) and the 1-minute load average of those runs. Ratios are pdmesh / peer; a
row "loses" when pdmesh's tok/s is below the peer's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import PDMESH_SYSTEMS, PEER_SYSTEMS, ratios  # noqa: E402


def load(paths: list[Path]) -> tuple[dict, dict[tuple[str, str], list[float]]]:
    summary: dict[str, dict[str, dict[str, float]]] = {}
    loads: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for system, cells in data["summary"].items():
            summary.setdefault(system, {}).update(cells)
        for run in data["runs"]:
            cell = run["cell"]
            label = f"c{cell['concurrency']}/in{cell['input_len']}"
            loads.setdefault((run["system"], label), []).append(run["loadavg_1m"])
    return summary, loads


def absolute_table(summary: dict, loads: dict[tuple[str, str], list[float]]) -> str:
    lines = ["| cell | system | output tok/s | median TTFT (ms) | median TPOT (ms) | load 1m |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    labels = list(dict.fromkeys(label for s in summary.values() for label in s))
    for label in labels:
        for system in (*PDMESH_SYSTEMS, *PEER_SYSTEMS):
            m = summary.get(system, {}).get(label)
            if m is None:
                continue
            ld = loads.get((system, label), [])
            load = f"{min(ld):.1f}-{max(ld):.1f}" if ld else "-"
            lines.append(f"| {label} | {system} | {m['output_throughput']:.1f} | "
                         f"{m['median_ttft_ms']:.0f} | {m['median_tpot_ms']:.1f} | {load} |")
    return "\n".join(lines)


def ratio_table(rows: list[dict[str, object]]) -> tuple[str, list[str]]:
    def fmt(v: object) -> str:
        return f"{v:.2f}x" if isinstance(v, float) else "-"

    lines = ["| cell | pdmesh | peer | tok/s ratio | TTFT ratio | TPOT ratio |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    losing = []
    for r in rows:
        lose = isinstance(r["output_throughput"], float) and r["output_throughput"] < 1.0
        mark = " **(pdmesh loses)**" if lose else ""
        lines.append(f"| {r['cell']} | {r['pdmesh']} | {r['peer']} | "
                     f"{fmt(r['output_throughput'])}{mark} | {fmt(r['median_ttft_ms'])} | "
                     f"{fmt(r['median_tpot_ms'])} |")
        if lose:
            losing.append(f"{r['cell']} {r['pdmesh']} vs {r['peer']}: "
                          f"{r['output_throughput']:.2f}x tok/s")
    return "\n".join(lines), losing


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    summary, loads = load([Path(a) for a in argv])
    table, losing = ratio_table(ratios(summary))
    print(absolute_table(summary, loads))
    print()
    print(table)
    print("\nratios are pdmesh / peer: tok/s above 1 and TTFT/TPOT below 1 favour pdmesh\n")
    print("Losing rows (tok/s ratio below 1):")
    print("\n".join(f"- {line}" for line in losing) or "- none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
