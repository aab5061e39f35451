"""HTTP calls from the router to workers, and the failures they can end in.

Every failure becomes one `UpstreamFailure`: a connection error or timeout (status None), or a
worker's non-2xx answer with its error envelope. The retry loop reads `retryable`, the circuit
breaker reads `counts_against_worker`; the client eventually sees `to_api_error()`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from services.common.errors import ApiError, InternalServerError
from services.router.errors import UpstreamError

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
DONE = b"[DONE]"


class UpstreamFailure(Exception):
    """One failed call to one worker; `status` is None when no HTTP answer came back."""

    def __init__(self, worker_id: str, status: int | None, detail: str,
                 body: dict[str, Any] | None = None, *, stalled: bool = False) -> None:
        super().__init__(f"{worker_id}: {status or 'no answer'}: {detail}")
        self.worker_id = worker_id
        self.status = status
        self.detail = detail
        self.body = body
        self.stalled = stalled  # the worker went silent past a stall timeout
        self.leg = ""  # set by the orchestrator: "prefill", "decode" or "local"

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status in RETRYABLE_STATUSES

    @property
    def counts_against_worker(self) -> bool:
        """Breaker failures: no answer or a 5xx (a 429/408 means busy, not broken)."""
        return self.status is None or self.status >= 500

    def to_api_error(self) -> ApiError:
        if self.status is not None:
            return UpstreamError(self.status, self.body or {}, retryable=self.retryable)
        err = InternalServerError(f"Worker {self.worker_id} did not answer: {self.detail}",
                                  code="upstream_unreachable",
                                  headers={"x-should-retry": "true"})
        err.status = 502
        return err


async def _failure_from(worker_id: str, resp: aiohttp.ClientResponse) -> UpstreamFailure:
    text = await resp.text(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = {"error": {"message": text[:500] or resp.reason, "type": "server_error",
                          "param": None, "code": resp.status}}
    return UpstreamFailure(worker_id, resp.status, f"HTTP {resp.status}", body)


@dataclass(frozen=True)
class StallTimeouts:
    """How long a streamed leg may stay silent: before its first byte, and between bytes."""

    first_byte_s: float
    between_bytes_s: float


def stall_failure(worker_id: str, silent_s: float) -> UpstreamFailure:
    return UpstreamFailure(worker_id, None, f"stalled: no byte for {silent_s:g} s", stalled=True)


class Upstream:
    """The pooled client session plus the headers every leg carries."""

    def __init__(self, session: aiohttp.ClientSession, worker_api_key: str | None) -> None:
        self.session = session
        self._auth = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}

    def headers(self, request_id: str) -> dict[str, str]:
        return {"X-Request-Id": request_id, **self._auth}

    async def post_json(self, worker_id: str, url: str, body: dict[str, Any],
                        request_id: str, timeout_s: float | None = None,
                        ) -> tuple[dict[str, Any], dict[str, str]]:
        """POST and return (json body, response headers); raise UpstreamFailure otherwise.
        `timeout_s` bounds the whole call (a worker that stops answering is a failure)."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.post(url, json=body,
                                             headers=self.headers(request_id)) as resp:
                    if resp.status >= 400:
                        raise await _failure_from(worker_id, resp)
                    return await resp.json(content_type=None), dict(resp.headers)
        except TimeoutError as exc:
            if timeout_s is not None:
                raise stall_failure(worker_id, timeout_s) from exc
            raise UpstreamFailure(worker_id, None, f"{type(exc).__name__}: {exc}") from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise UpstreamFailure(worker_id, None, f"{type(exc).__name__}: {exc}") from exc

    async def get_json(self, worker_id: str, url: str, timeout_s: float) -> dict[str, Any]:
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(url, headers=self._auth, timeout=timeout) as resp:
                if resp.status >= 400:
                    raise await _failure_from(worker_id, resp)
                return await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise UpstreamFailure(worker_id, None, f"{type(exc).__name__}: {exc}") from exc

    @asynccontextmanager
    async def stream(self, worker_id: str, url: str, body: dict[str, Any],
                     request_id: str) -> AsyncIterator[aiohttp.ClientResponse]:
        """Open a streamed POST; 2xx only. Leaving the block early *closes* the connection, which
        is how the worker learns that the client went away (it aborts the request)."""
        try:
            resp = await self.session.post(url, json=body, headers=self.headers(request_id))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamFailure(worker_id, None, f"{type(exc).__name__}: {exc}") from exc
        try:
            if resp.status >= 400:
                raise await _failure_from(worker_id, resp)
            yield resp
        finally:
            resp.close()


async def _read(resp: aiohttp.ClientResponse, worker_id: str, timeout_s: float | None) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            return await resp.content.readany()
    except TimeoutError as exc:
        if timeout_s is None:
            raise
        raise stall_failure(worker_id, timeout_s) from exc


async def sse_data(resp: aiohttp.ClientResponse, worker_id: str,
                   stall: StallTimeouts | None = None) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE body, `[DONE]` included; other SSE fields are ignored.
    With `stall`, a worker silent past its timeout raises UpstreamFailure (`stalled`)."""
    buf = b""
    timeout = stall.first_byte_s if stall else None
    try:
        while chunk := await _read(resp, worker_id, timeout):
            timeout = stall.between_bytes_s if stall else None
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise UpstreamFailure(worker_id, None, f"stream broke: {type(exc).__name__}") from exc
    if buf.startswith(b"data:"):
        yield buf[5:].strip()
