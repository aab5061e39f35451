"""HTTP calls from the router to workers, and the failures they can end in.

Every failure becomes one `UpstreamFailure`: a connection error or timeout (status None), or a
worker's non-2xx answer with its error envelope. The retry loop reads `retryable`, the circuit
breaker reads `counts_against_worker`; the client eventually sees `to_api_error()`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from yarl import URL

from services.common.errors import ApiError, InternalServerError
from services.common.signing import signed_json
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


class Upstream:
    """The pooled client session plus the headers every leg carries.

    With the mesh's KV secret every POST is signed with it (services.common.signing; a fresh
    nonce per attempt): workers hand out KV leases only to prefill legs so signed
    (services.worker.leg_auth).
    """

    def __init__(self, session: aiohttp.ClientSession, worker_api_key: str | None,
                 kv_secret: bytes | None = None) -> None:
        self.session = session
        self._auth = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self._secret = kv_secret

    def __repr__(self) -> str:  # never the key or the secret
        return f"Upstream(signed={self._secret is not None})"

    def headers(self, request_id: str) -> dict[str, str]:
        return {"X-Request-Id": request_id, **self._auth}

    def _post(self, url: str, body: dict[str, Any], request_id: str) -> Any:
        data, signed = signed_json(self._secret, URL(url).path, body)
        return self.session.post(url, data=data, headers={**self.headers(request_id), **signed})

    async def post_json(self, worker_id: str, url: str, body: dict[str, Any],
                        request_id: str) -> tuple[dict[str, Any], dict[str, str]]:
        """POST and return (json body, response headers); raise UpstreamFailure otherwise."""
        try:
            async with self._post(url, body, request_id) as resp:
                if resp.status >= 400:
                    raise await _failure_from(worker_id, resp)
                return await resp.json(content_type=None), dict(resp.headers)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
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
            resp = await self._post(url, body, request_id)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamFailure(worker_id, None, f"{type(exc).__name__}: {exc}") from exc
        try:
            if resp.status >= 400:
                raise await _failure_from(worker_id, resp)
            yield resp
        finally:
            resp.close()


Reader = Callable[[aiohttp.ClientResponse], Awaitable[bytes]]


async def _readany(resp: aiohttp.ClientResponse) -> bytes:
    return await resp.content.readany()


async def sse_data(resp: aiohttp.ClientResponse, worker_id: str,
                   read: Reader = _readany) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE body, `[DONE]` included; other SSE fields are ignored.
    `read` gets the next bytes (b"" at the end): a stall watchdog's (stall.py) may raise."""
    buf = b""
    try:
        while chunk := await read(resp):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise UpstreamFailure(worker_id, None, f"stream broke: {type(exc).__name__}") from exc
    if buf.startswith(b"data:"):
        yield buf[5:].strip()
