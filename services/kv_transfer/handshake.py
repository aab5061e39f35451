"""Layer coverage, negotiated in the KV handshake: the stages behind a peer must serve every
layer this side holds, each exactly once.

A KV service declares, per pipeline stage, the global decoder layers [start, end) that stage
computed (`NodeInfo.layer_ranges`; a PP=1 worker declares one range). With the pipeline's one
shared cache, stage 0's service reads and writes every stage's layers, so the blocks move as
with PP=1; the declaration is what lets the other side check, before any byte moves, that
the union of the stages is exactly the layers it needs: no layer missing (KV the decode would
attend to as zeros), none served twice, none outside the model. A failed check is a 409 that
names the layers, never a 500. Pipeline size itself is not in the compat hash: it is
negotiated here, after the hash matched.

Coverage is computed on intervals (never layer by layer), so a peer declaring huge ranges
costs nothing to reject.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.kv_transfer.errors import ConflictError
from shared.protocol.layout import LayerRange
from shared.protocol.messages import NodeInfo


@dataclass(frozen=True)
class LayerCoverage:
    """How declared stage ranges cover a span [start, end): maximal runs of layers that no
    stage serves (`missing`), that several serve (`overlapping`), and that are outside it."""

    missing: tuple[LayerRange, ...]
    overlapping: tuple[LayerRange, ...]
    outside: tuple[LayerRange, ...]

    @property
    def exact(self) -> bool:
        return not (self.missing or self.overlapping or self.outside)

    def describe(self) -> str:
        parts = [f"{what} {format_layers(runs)}" for what, runs in (
            ("missing layers", self.missing), ("layers served by more than one stage",
                                               self.overlapping),
            ("layers outside the model's span", self.outside)) if runs]
        return "; ".join(parts) or "exact"


def _merge(runs: Iterable[LayerRange]) -> tuple[LayerRange, ...]:
    """Sorted, non-empty, adjacent or overlapping runs joined."""
    merged: list[list[int]] = []
    for a, b in sorted(r for r in runs if r[0] < r[1]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def layer_coverage(ranges: Iterable[LayerRange], start: int, end: int) -> LayerCoverage:
    """Sweep the ranges (sorted by start) over [start, end)."""
    missing, overlapping, outside = [], [], []
    cursor = start  # every layer in [start, cursor) is covered at least once
    for a, b in sorted(ranges):
        outside += [(a, min(b, start)), (max(a, end), b)]
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            continue
        if lo > cursor:
            missing.append((cursor, lo))
        overlapping.append((lo, min(hi, cursor)))
        cursor = max(cursor, hi)
    missing.append((cursor, end))
    return LayerCoverage(_merge(missing), _merge(overlapping), _merge(outside))


def format_layers(runs: Iterable[LayerRange]) -> str:
    """((1, 2), (5, 8)) -> '1, 5-7' (inclusive layer numbers, as a person counts them)."""
    return ", ".join(str(a) if b - a == 1 else f"{a}-{b - 1}" for a, b in runs)


def _listed(node: NodeInfo) -> str:
    return str([list(r) for r in node.stage_ranges])


def check_own_ranges(node: NodeInfo) -> None:
    """A service's own declaration must tile the layers it holds (ValueError: a config bug)."""
    cov = layer_coverage(node.stage_ranges, node.layer_start, node.layer_end)
    if not cov.exact:
        raise ValueError(f"KV service declares stage layers {_listed(node)} over its layers "
                         f"[{node.layer_start}, {node.layer_end}): {cov.describe()}")


def check_layer_coverage(local: NodeInfo, remote: NodeInfo) -> None:
    """409 unless the remote's stages tile exactly the layers `local` holds, and its own span.

    For a PP=1 decode `local` holds [0, num_layers); a PP prefill passes with any stage
    split whose union is that, e.g. [[0, 15], [15, 30]].
    """
    needed = (local.layer_start, local.layer_end)
    cov = layer_coverage(remote.stage_ranges, *needed)
    if cov.exact and (remote.layer_start, remote.layer_end) == needed:
        return
    detail = cov.describe() if not cov.exact else (
        f"its stages cover [{needed[0]}, {needed[1]}) but it claims to hold "
        f"[{remote.layer_start}, {remote.layer_end})")
    raise ConflictError(
        f"KV layer coverage: the {remote.role} peer {remote.engine_id} (pp={remote.pp_size}) "
        f"declares stage layers {_listed(remote)}, this {local.role} needs every layer of "
        f"[{needed[0]}, {needed[1]}) exactly once: {detail}. The compat hash matched; the "
        "pipeline layouts cannot exchange KV.",
        param="layer_ranges", code="kv_layer_coverage")
