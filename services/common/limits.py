"""Request-size and read-time limits of one listener (router, worker HTTP, KV service).

Three bounds, so that no client holds a connection or memory for long without sending a
request:
- the request head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the previous response. aiohttp's keep-alive timer is that bound:
  it closes a connection that has no complete request head when it fires, whether the
  connection is idle or half way through its headers (`runner_options`). So the bound is
  also the idle keep-alive: the 60 s default outlasts the clients' pools (the router keeps
  idle connections 30 s, aiohttp 15 s), which then never reuse a connection the server is
  closing. Lines and fields
  are bounded by aiohttp's parser (8 KiB each, 128 headers: its defaults, kept);
- a body larger than `max_body_bytes` is refused with 413 as soon as its headers arrive,
  from Content-Length, before any byte of it is read. A chunked body is bounded as it is read
  (aiohttp's `client_max_size`, set to the same value by each app);
- the body must be complete within `body_timeout_s` of the request head: past it, the
  connection is closed (a client that trickles its body is cut off, and its handler is
  cancelled like any client disconnect; a reply cannot be sent while the body is unread).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.common.errors import PayloadTooLargeError

log = logging.getLogger(__name__)
# After an error answer, aiohttp reads and drops what remains of an unread body for this long
# before closing (so the client sees the answer, not a reset); short, so no one lingers.
LINGERING_S = 2.0


@dataclass(frozen=True)
class ServerLimits:
    """The bounds of one listener; each service's config builds one from its flags."""

    max_body_bytes: int
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max body size must be >= 1 byte, got {self.max_body_bytes}")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("header and body timeouts must be > 0 seconds")


LIMITS_KEY = web.AppKey("server_limits", ServerLimits)


def limits_middleware(limits: ServerLimits) -> Any:
    """413 from Content-Length before reading; a body deadline armed while the body is read.
    Goes right inside the error middleware, so both answers are OpenAI error envelopes."""

    @web.middleware
    async def server_limits(request: web.Request, handler: Any) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > limits.max_body_bytes:
            raise PayloadTooLargeError(
                f"Request body of {length} bytes exceeds the limit of {limits.max_body_bytes} "
                "bytes")
        body = request.content
        if not request.body_exists or body.is_eof():
            return await handler(request)
        expire = asyncio.get_running_loop().call_later(
            limits.body_timeout_s, _expire_body, request, limits.body_timeout_s)
        try:
            return await handler(request)
        finally:
            expire.cancel()

    return server_limits


def _expire_body(request: web.Request, seconds: float) -> None:
    if request.content.is_eof():
        return
    log.info("closing the connection of %s %s: its body did not arrive within %g s",
             request.method, request.path, seconds)
    request.protocol.force_close()


def install_limits(app: web.Application, limits: ServerLimits) -> None:
    """Record the limits for `runner_options` (the middleware is listed by create_app)."""
    app[LIMITS_KEY] = limits


def runner_options(app: web.Application) -> dict[str, Any]:
    """AppRunner keyword arguments carrying the app's limits (none if it installed none)."""
    limits = app.get(LIMITS_KEY)
    if limits is None:
        return {}
    return {"keepalive_timeout": limits.header_timeout_s, "lingering_time": LINGERING_S}
