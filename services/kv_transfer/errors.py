"""KV-transfer errors: `ApiError`s (OpenAI envelope, services.common.errors) with KV codes.

The same classes serve both sides: the KV service answers with them, and the decode/prefill
client raises them, so a worker's own error middleware can return them unchanged. A peer's
error is re-raised locally as `PeerError`, keeping the peer's status for 4xx (a 410 from the
prefill stays a 410) and mapping its 5xx to 502.
"""

from __future__ import annotations

import json
import logging

from services.common.errors import (
    ApiError,
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    ServiceUnavailableError,
)

log = logging.getLogger("pdmesh.kv_transfer")

__all__ = [
    "ApiError", "AuthenticationError", "BadRequestError", "NotFoundError",
    "ServiceUnavailableError", "ConflictError", "GoneError", "BadGatewayError",
    "GatewayTimeoutError", "PeerError", "peer_error",
]


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
