"""Speculative-decoding figures of a run, from the server's /metrics counters.

vLLM and pdmesh export the same counters (vLLM v1's names under their own prefix, `vllm:` or
`pdmesh:`): spec_decode_num_drafts, spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens and spec_decode_num_accepted_tokens_per_pos{position}. The
bench reads them before and after the load; the difference gives, as vLLM's `bench serve`
reports them: the acceptance rate (accepted / draft tokens), the mean acceptance length
(1 + accepted / drafts: tokens a speculating step emits, its bonus token included) and the
acceptance rate per draft position (accepted at i / drafts). A server without those counters
(speculation off everywhere, a router that does not merge worker metrics, no /metrics) yields
None and the report leaves the section out.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens")
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative counter values summed over every label set but the position."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_position: tuple[float, ...]

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The increase since `before` (positions `before` lacks count from 0)."""
        old = before.accepted_per_position
        per = tuple(v - (old[i] if i < len(old) else 0.0)
                    for i, v in enumerate(self.accepted_per_position))
        return SpecCounters(self.num_drafts - before.num_drafts,
                            self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens, per)


@dataclass(frozen=True)
class SpecDecodeSummary:
    """A run's speculative decoding: counts and the rates derived from them (None: no draft)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position_acceptance_rate: tuple[float, ...]

    @classmethod
    def from_counters(cls, c: SpecCounters) -> SpecDecodeSummary:
        drafts = c.num_drafts
        return cls(
            drafts=int(drafts), draft_tokens=int(c.num_draft_tokens),
            accepted_tokens=int(c.num_accepted_tokens),
            acceptance_rate=(c.num_accepted_tokens / c.num_draft_tokens
                             if c.num_draft_tokens else None),
            mean_acceptance_length=1.0 + c.num_accepted_tokens / drafts if drafts else None,
            per_position_acceptance_rate=tuple(v / drafts for v in c.accepted_per_position)
            if drafts else ())


def parse_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text exposition, whatever their prefix; None if absent."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    # By sample name: the parser groups samples into families only where HELP / TYPE lines
    # introduce them as it expects, and a counter's value is always its `_total` sample.
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    for sample in samples:
        if not sample.name.endswith("_total"):
            continue  # a counter's _created sample, or another metric
        base = sample.name.rsplit(":", 1)[-1].removesuffix("_total")
        if base == PER_POSITION:
            pos = int(sample.labels.get("position", "0"))
            per_position[pos] = per_position.get(pos, 0.0) + sample.value
        elif base in COUNTERS:
            totals[base] = totals.get(base, 0.0) + sample.value
    if not set(COUNTERS) <= set(totals):
        return None
    positions = tuple(per_position.get(i, 0.0) for i in range(max(per_position, default=-1) + 1))
    return SpecCounters(totals[COUNTERS[0]], totals[COUNTERS[1]], totals[COUNTERS[2]], positions)


async def scrape(session: aiohttp.ClientSession, base_url: str,
                 headers: dict[str, str]) -> SpecCounters | None:
    """GET base_url/metrics and parse it; None on any failure (the figures are optional)."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    try:
        return parse_counters(text)
    except ValueError:  # not a Prometheus exposition
        return None


def summarise(before: SpecCounters | None, after: SpecCounters | None
              ) -> SpecDecodeSummary | None:
    """The run's figures, or None when either scrape found no counters."""
    if before is None or after is None:
        return None
    return SpecDecodeSummary.from_counters(after.minus(before))
