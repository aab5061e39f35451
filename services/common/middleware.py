"""Request-id and API-key middlewares shared by every service.

Order in `web.Application(middlewares=[...])`: request id first (outermost, so even error
responses carry it), then `error_middleware`, then auth and readiness gates.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from services.common.errors import AuthenticationError

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)

# A client id is echoed verbatim only if it is a sane token; anything else is replaced.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")

PathPredicate = Callable[[str], bool]


def new_request_id() -> str:
    return uuid.uuid4().hex


@web.middleware
async def request_id_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Accept the caller's X-Request-Id (or mint one); `echo_request_id` puts it on the reply."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request[REQUEST_ID_KEY] = given if _VALID_REQUEST_ID.match(given) else new_request_id()
    return await handler(request)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: works for streamed responses too, whose headers go early."""
    rid = request.get(REQUEST_ID_KEY)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid


def install_request_id(app: web.Application) -> None:
    app.middlewares.insert(0, request_id_middleware)
    app.on_response_prepare.append(echo_request_id)


def api_prefix_predicate(prefixes: Iterable[str]) -> PathPredicate:
    """True for paths equal to a prefix or below it ("/v1" guards "/v1" and "/v1/...")."""
    roots = tuple(p.rstrip("/") for p in prefixes)

    def matches(path: str) -> bool:
        return any(path == r or path.startswith(r + "/") for r in roots)

    return matches


class ApiKeyAuth:
    """Bearer-token check against a set of keys, in constant time.

    Keys and the presented token are both reduced to SHA-256 digests, so `compare_digest`
    sees equal lengths, and every key is compared (no early exit) so timing reveals neither
    which key matched nor how many are configured beyond the loop length.
    """

    def __init__(self, keys: Iterable[str], guarded: PathPredicate) -> None:
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)
        self._guarded = guarded

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        presented = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(presented, digest)
        return ok and scheme.lower() == "bearer"

    def middleware(self) -> Any:
        @web.middleware
        async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            if self.enabled and self._guarded(request.path):
                if not self.check(request.headers.get("Authorization")):
                    raise AuthenticationError(
                        "Invalid or missing API key (send 'Authorization: Bearer <key>')",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
            return await handler(request)

        return auth_middleware
