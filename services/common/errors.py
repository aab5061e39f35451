"""Domain errors and their OpenAI error envelope: `{"error": {message, type, param, code}}`.

Handlers raise an `ApiError` subclass; `error_middleware` turns it (and aiohttp's own HTTP
exceptions, and anything unexpected) into a JSON envelope with the right status, so no input
ever produces a traceback in a response body. `type` follows OpenAI's vocabulary
(`invalid_request_error`, `server_error`...), `code` is a string or null.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any, ClassVar

from aiohttp import web

log = logging.getLogger(__name__)
# ASCII-escaped: a message may quote client input, which must not break the encoding.
_dumps = functools.partial(json.dumps, separators=(",", ":"))


class ApiError(Exception):
    """An error that maps to one HTTP status and one OpenAI error envelope.

    `param` names the request field at fault (the SDK exposes it as `.param`), `code` is a
    short machine-readable string, `headers` are extra response headers (Retry-After...).
    """

    # Class defaults that subclasses override; an instance may override them too (an upstream
    # error mirrors the worker's status), so they are not ClassVars.
    status: int = 500
    error_type: str = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class BadRequestError(ApiError):
    status = 400
    error_type = "invalid_request_error"


class AuthenticationError(ApiError):
    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFoundError(ApiError):
    status = 404
    error_type = "invalid_request_error"


class MethodNotAllowedError(ApiError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class PayloadTooLargeError(ApiError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(ApiError):
    status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class InternalServerError(ApiError):
    status = 500
    error_type = "server_error"


class ServiceUnavailableError(ApiError):
    status = 503
    error_type = "server_error"
    default_code = "service_unavailable"


# ---- errors between services (the KV transfer): both sides raise them, so a worker's own
# error middleware returns a peer's failure unchanged --------------------------------------


class ConflictError(ApiError):
    """409: the two sides cannot work together (compat hash, block size, role, mode)."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "kv_incompatible"


class GoneError(ApiError):
    """410: the lease (or push slot) existed but was released or expired; never stale bytes."""

    status = 410
    error_type = "invalid_request_error"
    default_code = "kv_lease_gone"


class BadGatewayError(ApiError):
    """502: the peer is unreachable, answered garbage, or sent blocks that fail their digest."""

    status = 502
    error_type = "server_error"
    default_code = "kv_peer_error"


class GatewayTimeoutError(ApiError):
    """504: a push rendezvous deadline passed."""

    status = 504
    error_type = "server_error"
    default_code = "kv_deadline_exceeded"


class PeerError(ApiError):
    """An error envelope received from the peer, re-raised on this side."""

    error_type = "server_error"

    def __init__(self, status: int, message: str, code: str | None) -> None:
        super().__init__(message, code=code)
        self.status = status if 400 <= status < 500 else 502  # instance attribute on purpose
        self.error_type = "invalid_request_error" if self.status < 500 else "server_error"
        self.peer_status = status


def peer_error(status: int, body: bytes, peer: str) -> PeerError:
    """Build a PeerError from a non-200 reply; tolerant of a body that is not an envelope."""
    message, code = f"HTTP {status}", None
    try:
        err = json.loads(body)["error"]
        message, code = str(err.get("message")), err.get("code")
        code = code if isinstance(code, str) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return PeerError(status, f"KV peer {peer}: {message}", code)


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers, dumps=_dumps)


def from_http_exception(request: web.Request, exc: web.HTTPException) -> ApiError:
    """aiohttp's own 4xx/5xx (unknown route, wrong method, body too large) as domain errors."""
    if isinstance(exc, web.HTTPNotFound):
        return NotFoundError(f"Invalid URL ({request.method} {request.path})", code="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowedError(f"Method {request.method} not allowed for {request.path}")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.client_max_size
        return PayloadTooLargeError(f"Request body exceeds the limit of {limit} bytes")
    cls = BadRequestError if exc.status < 500 else InternalServerError
    err = cls(exc.reason or "HTTP error")
    err.status = exc.status  # keep the exact status aiohttp chose (instance attribute)
    return err


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Map every failure to the OpenAI envelope; never leak a traceback to the client.

    Streaming handlers deal with errors after their response is prepared (an SSE error event);
    anything that still escapes them is logged and re-raised, as no second response can start.
    """
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(from_http_exception(request, exc))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        if request.get(RESPONSE_STARTED_KEY):
            raise
        return error_response(InternalServerError("Internal server error"))


# Set by streaming handlers once their response headers are sent.
RESPONSE_STARTED_KEY = web.RequestKey("response_started", bool)
