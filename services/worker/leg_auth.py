"""Only the router's prefill legs get KV leases: legs signed with the mesh's KV secret.

A prefill leg (`kv_transfer_params.do_remote_decode`) makes this worker hold a prompt's KV
blocks and hand them to whoever presents the lease (pull) or push them to a decode (push), so
the worker takes one only from a caller it trusts:
- with a KV secret configured, a leg signed with that secret, exactly as KV requests between
  workers are (services.common.signing: timestamp, nonce, HMAC over method, path and body;
  each signature accepted once). The router has the secret too and signs every POST it sends
  to a worker; anyone else's prefill leg gets 401 `kv_leg_unsigned` before anything is
  computed or held;
- without a secret, a caller on loopback (the same trust as the KV port, which then serves
  loopback peers only: services.kv_transfer.auth); any other gets 403 `kv_leg_not_loopback`.

`leg_auth_middleware` verifies a signature when one is present (a bad one is a 401 at once)
and records whether the caller is trusted; `require_trusted_leg` is asked by the serving flow
once the leg is parsed (only prefill legs need it).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.common.errors import ApiError, AuthenticationError
from services.common.signing import SignatureVerifier, is_signed
from services.kv_transfer.auth import is_loopback, peer_host
from services.kv_transfer.config import KVTransferConfig

TRUSTED_KEY = web.RequestKey("kv_leg_trusted", bool)


class LegForbiddenError(ApiError):
    """403: without a KV secret, prefill legs come from loopback callers only."""

    status = 403
    error_type = "permission_error"
    default_code = "kv_leg_not_loopback"


def leg_auth_middleware(kv: KVTransferConfig | None) -> Any:
    """Verify signed POSTs (with a KV secret) and record whether the caller may send legs."""
    verifier = None
    if kv is not None and kv.secret is not None:
        verifier = SignatureVerifier(kv.secret, kv.signature_window)

    @web.middleware
    async def leg_auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if verifier is None:
            host = peer_host(request)
            request[TRUSTED_KEY] = host is not None and is_loopback(host)
        elif request.method == "POST" and is_signed(request.headers):
            body = await request.read()  # bounded by the limits middleware; cached
            verifier.verify(request.headers, request.method, request.path, body)
            request[TRUSTED_KEY] = True
        return await handler(request)

    return leg_auth


def is_trusted_leg_caller(request: web.Request) -> bool:
    return request.get(TRUSTED_KEY, False)


def require_trusted_leg(secret_configured: bool, trusted: bool) -> None:
    """Refuse a prefill leg from a caller `leg_auth_middleware` did not trust."""
    if trusted:
        return
    if secret_configured:
        raise AuthenticationError(
            "prefill legs (kv_transfer_params.do_remote_decode) on this worker must be signed "
            "with the mesh's PDMESH_KV_SECRET: send them through the router, which signs them",
            param="kv_transfer_params", code="kv_leg_unsigned")
    raise LegForbiddenError(
        "this worker has no PDMESH_KV_SECRET, so it takes prefill legs "
        "(kv_transfer_params.do_remote_decode) from loopback callers only; give the router "
        "and every worker of the mesh the same PDMESH_KV_SECRET", param="kv_transfer_params")
