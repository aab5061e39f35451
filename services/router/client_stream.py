"""The client-facing SSE stream, and the relay of a worker's stream into it.

`ClientStream` prepares the response lazily, on the first event: until then nothing has reached
the client and a failed attempt may still be retried (`started` is what the retry loop asks).
`relay` copies a worker's `data:` events through, byte for byte on the hot path; it parses an
event only while the first token is still being cut out, or to patch the usage chunk (the last
one, without choices: the chunks' continuous usage, `stream_options.continuous_usage_stats`,
is the worker's counts and goes through as it is).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from services.common.errors import RESPONSE_STARTED_KEY, ApiError
from services.router.first_token import FirstTokenSkipper
from services.router.migration import StreamTracker
from services.router.phases import Phases
from services.router.stall import Watchdog
from services.router.upstream import DONE, UpstreamFailure, sse_data
from shared.protocol.pd import PHASES_HEADER

_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_SOME_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')  # a chunk with choices, not the usage one
_ERROR_EVENT = re.compile(rb'^\{\s*"error"\s*:')

UsagePatch = Callable[[dict[str, Any]], dict[str, Any]]


class ClientStream:
    """One SSE response to the client, started on the first write."""

    def __init__(self, request: web.Request, phases: Phases) -> None:
        self._request = request
        self._phases = phases
        self._resp: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self._resp is not None

    async def _start(self) -> web.StreamResponse:
        self._phases.mark_first_token()
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            PHASES_HEADER: self._phases.header_value()})
        await resp.prepare(self._request)
        self._request[RESPONSE_STARTED_KEY] = True
        self._resp = resp
        return resp

    async def send_raw(self, data: bytes) -> None:
        resp = self._resp or await self._start()
        await resp.write(b"data: " + data + b"\n\n")

    async def send(self, event: dict[str, Any]) -> None:
        await self.send_raw(json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode())

    async def send_error(self, err: ApiError) -> None:
        """A mid-stream error event (the openai SDK raises APIError on it), then [DONE]."""
        body = err.body()
        body["error"]["code"] = body["error"].get("code") or err.status
        await self.send(body)
        await self.finish()

    async def finish(self) -> web.StreamResponse:
        resp = self._resp or await self._start()
        await resp.write(b"data: " + DONE + b"\n\n")
        await resp.write_eof()
        return resp

    @property
    def response(self) -> web.StreamResponse:
        assert self._resp is not None, "stream not started"
        return self._resp


def _parse(worker_id: str, data: bytes) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise UpstreamFailure(worker_id, None, f"malformed stream event: {exc}") from exc
    if not isinstance(event, dict):
        raise UpstreamFailure(worker_id, None, "stream event is not a JSON object")
    return event


async def relay(resp: aiohttp.ClientResponse, worker_id: str, out: ClientStream,
                skipper: FirstTokenSkipper | None, patch_usage: UsagePatch,
                client_id: str | None = None, tracker: StreamTracker | None = None,
                watchdog: Watchdog | None = None) -> None:
    """Copy a worker's SSE stream to the client up to (not including) its [DONE].

    `client_id` is the completion id the client already saw in early chunks from the prefill;
    the worker's own id is rewritten to it so one stream keeps one id. `tracker` (a migratable
    stream) sees every chunk (parsed) on its way out. An error event, a stream cut before
    [DONE], or a worker the `watchdog` finds stalled, raises UpstreamFailure (the caller decides on
    retry, migration or the error event).
    """
    rename: tuple[bytes, bytes] | None = None
    reader = watchdog.read if watchdog is not None else None
    async for data in (sse_data(resp, worker_id, reader) if reader else sse_data(resp, worker_id)):
        if data == DONE:
            return
        if _ERROR_EVENT.match(data):
            raise UpstreamFailure(worker_id, _error_status(data), "error event in stream",
                                  _parse(worker_id, data))
        if client_id is not None:
            worker_cid = str(_parse(worker_id, data).get("id"))
            rename = None if worker_cid == client_id else (
                f'"{worker_cid}"'.encode(), f'"{client_id}"'.encode())
            client_id = None
        if rename is not None:
            data = data.replace(rename[0], rename[1], 1)
        active = skipper is not None and not skipper.done
        totals = _USAGE_OBJECT.search(data) is not None and not _SOME_CHOICE.search(data)
        if not active and tracker is None and not totals:
            await out.send_raw(data)
            continue
        parsed = _parse(worker_id, data)
        # `active` implies a skipper; the None test restates it for the type checker.
        chunk = skipper.apply(parsed) if active and skipper is not None else parsed
        if chunk is not None and totals and isinstance(chunk.get("usage"), dict):
            chunk["usage"] = patch_usage(chunk["usage"])
        if chunk is not None and tracker is not None:
            chunk = tracker.outgoing(chunk)
        if chunk is not None:
            await out.send(chunk)
    raise UpstreamFailure(worker_id, None, "stream ended before [DONE]")


def _error_status(data: bytes) -> int:
    try:
        code = json.loads(data).get("error", {}).get("code")
    except (ValueError, AttributeError):
        return 500
    return code if isinstance(code, int) and 400 <= code < 600 else 500
