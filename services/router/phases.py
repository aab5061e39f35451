"""Per-request phase timings, as the client sees them in `x-pdmesh-phases` and the usage chunk.

All durations are milliseconds measured on the router's monotonic clock, from the moment the
request was read: `queue_ms` (admission wait), `prefill_ms` (the prefill leg, all attempts of
the successful one only), `first_token_ms` (arrival to the first token being available),
`decode_ms` (decode leg), `total_ms`. What the decode worker reports about its KV handshake and
transfer (under its own `x-pdmesh-phases` header or a `pdmesh` key) is merged in unchanged,
without overriding the router's own keys.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Phases:
    """Mutable timing record of one request; `as_dict` is the JSON document."""

    start: float = field(default_factory=time.monotonic)
    decision: str | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    first_token_ms: float | None = None
    decode_ms: float | None = None
    total_ms: float | None = None
    attempts: int = 0
    prefill_worker: str | None = None
    decode_worker: str | None = None
    reported: dict[str, Any] = field(default_factory=dict)

    def since_start_ms(self) -> float:
        return (time.monotonic() - self.start) * 1000.0

    def mark_first_token(self) -> None:
        if self.first_token_ms is None:
            self.first_token_ms = self.since_start_ms()

    def finish(self) -> None:
        self.total_ms = self.since_start_ms()

    def merge_reported(self, doc: Any) -> None:
        """Keep what a worker reported (a dict, or a JSON string from its header)."""
        if isinstance(doc, str):
            try:
                doc = json.loads(doc)
            except ValueError:
                return
        if isinstance(doc, dict):
            self.reported.update(doc)

    def as_dict(self) -> dict[str, Any]:
        own = {
            "decision": self.decision, "queue_ms": _r(self.queue_ms),
            "prefill_ms": _r(self.prefill_ms), "first_token_ms": _r(self.first_token_ms),
            "decode_ms": _r(self.decode_ms), "total_ms": _r(self.total_ms),
            "attempts": self.attempts, "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
        }
        return {**self.reported, **own}

    def header_value(self) -> str:
        return json.dumps(self.as_dict(), separators=(",", ":"))


def _r(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def patch_usage(usage: dict[str, Any], cached_tokens: int | None,
                phases: Phases | None) -> dict[str, Any]:
    """Set `prompt_tokens_details.cached_tokens` from the prefill leg; attach phases if given."""
    if cached_tokens is not None:
        details = usage.get("prompt_tokens_details") or {}
        usage["prompt_tokens_details"] = {**details, "cached_tokens": cached_tokens}
    if phases is not None:
        phases.merge_reported(usage.pop("pdmesh", None))
        usage["pdmesh"] = phases.as_dict()
    return usage


def cached_tokens_of(response: dict[str, Any]) -> int | None:
    """The prefix-cache hits a (prefill) response reports: 0 when its usage has no details,
    None when it has no usage at all (then the decode's own figure is left alone)."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    value = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return int(value) if isinstance(value, int) else 0
