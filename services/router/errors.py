"""Router-specific domain errors, on top of the shared OpenAI-envelope errors.

`x-should-retry` is set deliberately on every router-made 429/503 (the openai SDK honours it):
true where waiting helps (queue full, queue timeout, workers momentarily down), false where it
cannot (no worker of a needed role registered at all).
"""

from __future__ import annotations

from typing import Any

from services.common.errors import ApiError, RateLimitError, ServiceUnavailableError


def _retry_headers(should_retry: bool, after_s: int | None = None) -> dict[str, str]:
    headers = {"x-should-retry": "true" if should_retry else "false"}
    if after_s is not None:
        headers["Retry-After"] = str(after_s)
    return headers


class NoServableGroupError(ServiceUnavailableError):
    """503 at once: no compatibility group can serve; the message names what is missing."""

    default_code = "no_servable_group"

    def __init__(self, reason: str, *, transient: bool) -> None:
        super().__init__(reason, headers=_retry_headers(transient, 1 if transient else None))


class QueueFullError(RateLimitError):
    """429: the admission queue is full."""

    default_code = "queue_full"

    def __init__(self, depth: int) -> None:
        super().__init__(f"Router admission queue is full ({depth} waiting); retry later",
                         headers=_retry_headers(True, 1))


class QueueTimeoutError(ServiceUnavailableError):
    """503: the request waited in the admission queue past its timeout."""

    default_code = "queue_timeout"

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"Request waited {waited_s:.1f}s in the router queue without a slot",
                         headers=_retry_headers(True, 1))


class AdminDisabledError(ApiError):
    """403: worker changes need an admin token and the router was started without one."""

    status = 403
    error_type = "permission_error"
    default_code = "admin_disabled"


class UpstreamError(ApiError):
    """A worker answered with an error; its status and envelope go to the client unchanged."""

    def __init__(self, status: int, body: dict[str, Any], *, retryable: bool) -> None:
        err = body.get("error") if isinstance(body, dict) else None
        message = err.get("message") if isinstance(err, dict) else str(err or body)
        super().__init__(message or f"upstream error {status}",
                         headers=_retry_headers(retryable))
        self.status = status  # instance attribute: mirrors the worker's status
        self.upstream_body = body if isinstance(err, dict) else None
        self.error_type = "server_error" if status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return self.upstream_body or super().body()
