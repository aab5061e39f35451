"""The client side of the chaos, load and soak benchmarks: one request, classified.

`stream_request` sends one streaming (or not) completion and returns an `Outcome` saying how it
ended, from the client's point of view, with its timeline (first token, each token, the end):

- COMPLETED: a finish_reason, `[DONE]` and no error event (or, not streamed, a 200 body);
- ERROR_EVENT: the stream carried an error event (the router's in-stream failure report);
- HTTP_ERROR: an error status with the OpenAI envelope before any byte of stream (429, 503...);
- BROKEN: the connection ended without `[DONE]` and without an error event (a lost request);
- HUNG: nothing ended it within the hard client timeout (must never happen);
- CLOSED: the client closed the stream on purpose (`close_after_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp


class Kind(StrEnum):
    COMPLETED = "completed"
    ERROR_EVENT = "error_event"
    HTTP_ERROR = "http_error"
    BROKEN = "broken"
    HUNG = "hung"
    CLOSED = "closed"


@dataclass
class Outcome:
    """How one request ended, and when (time.monotonic() seconds)."""

    kind: Kind
    started: float
    ended: float
    status: int | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    retry_after: str | None = None
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.started if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def completion_body(prompt: str, max_tokens: int, stream: bool = True, n: int = 1,
                    model: str | None = None) -> dict[str, Any]:
    """A greedy completion of exactly `max_tokens` tokens (EOS ignored, so lengths are fixed)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": stream, "ignore_eos": True, "n": n}
    if model:
        body["model"] = model
    return body


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                         hard_timeout: float, close_after_tokens: int | None = None,
                         progress: list[Outcome] | None = None) -> Outcome:
    """POST `body` to `url` (…/v1/completions) and classify how it ended (see the module doc).
    Never raises for a failure of the server: that is what it measures. The Outcome is
    appended to `progress` at once, so a caller can watch its tokens arrive."""
    started = time.monotonic()
    out = Outcome(Kind.HUNG, started, started)
    if progress is not None:
        progress.append(out)
    try:
        await asyncio.wait_for(_run(session, url, body, out, close_after_tokens), hard_timeout)
    except TimeoutError:
        out.kind = Kind.HUNG
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.kind, out.error = Kind.BROKEN, repr(exc)
    out.ended = time.monotonic()
    return out


async def _run(session: aiohttp.ClientSession, url: str, body: dict[str, Any], out: Outcome,
               close_after_tokens: int | None) -> None:
    async with session.post(url, json=body) as resp:
        out.status = resp.status
        out.retry_after = resp.headers.get("Retry-After")
        if resp.status != 200:
            doc = await resp.json(content_type=None)
            out.kind = Kind.HTTP_ERROR
            out.error = (doc.get("error") or {}).get("message") if isinstance(doc, dict) else None
            out.error = out.error or f"HTTP {resp.status} without an error envelope"
            return
        if resp.content_type != "text/event-stream":
            doc = await resp.json()
            out.token_times.append(time.monotonic())
            out.text = "".join(c.get("text", "") for c in doc.get("choices", []))
            out.kind = Kind.COMPLETED
            return
        await _read_stream(resp, out, close_after_tokens)


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome,
                       close_after_tokens: int | None) -> None:
    finished = done = False
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            done = True
            break
        event = json.loads(payload)
        if "error" in event:
            out.kind, out.error = Kind.ERROR_EVENT, str(event["error"].get("message"))
            return
        choices = event.get("choices", [])
        if any(c.get("finish_reason") is None for c in choices):
            # A token event (its text may be empty: the detokenizer can hold bytes back).
            out.token_times.append(time.monotonic())
        for choice in choices:
            out.text += choice.get("text") or ""
            finished = finished or choice.get("finish_reason") is not None
        if close_after_tokens is not None and len(out.token_times) >= close_after_tokens:
            out.kind = Kind.CLOSED
            resp.close()  # drop the connection in the middle of the stream
            return
    out.kind = Kind.COMPLETED if (finished and done) else Kind.BROKEN
    if out.kind is Kind.BROKEN:
        out.error = "stream ended without [DONE] and without an error event"


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by nearest rank, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts by kind, TTFT and ITL p50/p99 (ms) over the completed requests."""
    counts = {k.value: sum(o.kind is k for o in outcomes) for k in Kind}
    done = [o for o in outcomes if o.kind is Kind.COMPLETED]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    itls = [x for o in done for x in o.itls]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {**counts, "sent": len(outcomes),
            "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
            "itl_p50_ms": ms(percentile(itls, 50)), "itl_p99_ms": ms(percentile(itls, 99)),
            "itl_mean_ms": ms(statistics.fmean(itls)) if itls else None}
