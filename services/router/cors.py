"""CORS for the router: browsers on the `--cors-allow-origin` origins may call the API.

A small middleware plus an `on_response_prepare` hook rather than `aiohttp-cors`: that
library wants every route registered with it, and its preflight handlers would sit behind our
auth middleware (a preflight carries no Authorization header, so it would get 401). Here the
middleware runs first and answers preflights itself, and the hook puts the headers on every
real answer, streamed ones included (their headers go out before a middleware could see them)
and error envelopes too (a page must be able to read why it was refused).

Rules: an allowed origin gets `Access-Control-Allow-Origin` (its own value; `*` when the
configuration is `*`, and then never `Allow-Credentials`, which browsers refuse with `*`);
a disallowed one gets no CORS header at all (and its preflight a 403). With a list of origins
every answer says `Vary: Origin`, so caches never serve one origin's headers to another.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.common.errors import ApiError, error_middleware

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# Headers a page may read from an answer besides the CORS-safelisted ones.
EXPOSE_HEADERS = "X-Request-Id, x-pdmesh-phases, Retry-After"
MAX_AGE_S = "600"


class ForbiddenOriginError(ApiError):
    status = 403
    error_type = "invalid_request_error"
    default_code = "cors_origin_not_allowed"


class CorsPolicy:
    """Which origins may call, and the headers each answer gets."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(o for o in origins if o != "*")

    def allow_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for `origin`, or None (no CORS headers)."""
        if not origin:
            return None
        if self.any_origin:
            return "*"
        return origin if origin in self.origins else None

    def headers(self, origin: str | None) -> dict[str, str]:
        allowed = self.allow_origin(origin)
        out = {} if self.any_origin else {"Vary": "Origin"}
        if allowed is not None:
            out["Access-Control-Allow-Origin"] = allowed
            if allowed != "*":
                out["Access-Control-Allow-Credentials"] = "true"
        return out

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers.get("Origin")
        headers = self.headers(origin)
        if "Access-Control-Allow-Origin" not in headers:
            raise ForbiddenOriginError(f"Origin {origin!r} is not allowed (--cors-allow-origin)")
        headers["Access-Control-Allow-Methods"] = ALLOW_METHODS
        requested = request.headers.get("Access-Control-Request-Headers")
        if requested:  # any request header: the API reads what it knows and ignores the rest
            headers["Access-Control-Allow-Headers"] = requested
        headers["Access-Control-Max-Age"] = MAX_AGE_S
        return web.Response(status=204, headers=headers)


def install_cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """Answer preflights (before auth and readiness) and label every answer; no-op without
    origins. Call after the other middlewares are set: this one goes inside the error
    middleware (its 403 gets the error envelope) but before the auth gate."""
    if not origins:
        return
    policy = CorsPolicy(origins)

    @web.middleware
    async def cors_preflight(request: web.Request, handler: Any) -> web.StreamResponse:
        if (request.method == "OPTIONS" and "Origin" in request.headers
                and "Access-Control-Request-Method" in request.headers):
            return policy.preflight(request)
        return await handler(request)

    async def label(request: web.Request, response: web.StreamResponse) -> None:
        if "Access-Control-Allow-Methods" in response.headers:
            return  # a preflight answer: already complete
        response.headers.update(policy.headers(request.headers.get("Origin")))
        if "Access-Control-Allow-Origin" in response.headers:
            response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS

    app.middlewares.insert(list(app.middlewares).index(error_middleware) + 1, cors_preflight)
    app.on_response_prepare.append(label)
