"""Only the router's prefill legs get KV leases: legs signed with the mesh's KV secret.

A prefill leg (`kv_transfer_params.do_remote_decode`) makes this worker hold a prompt's KV
blocks and hand them to whoever presents the lease (pull) or push them to a decode (push).
With a KV secret configured, such a leg must come signed with that secret, exactly as KV
requests between workers are (services.common.signing: timestamp, nonce, HMAC over method,
path and body; each signature accepted once). The router has the secret too and signs every
POST it sends to a worker; any other caller's prefill leg gets 401 `kv_leg_unsigned` before
anything is computed or held. Without a secret, the worker's KV port serves loopback peers
only (services.kv_transfer.auth), so a lease is of no use off the host.

`leg_auth_middleware` verifies a signature when one is present (a bad one is a 401 at once)
and marks the request; `require_signed_leg` is asked by the serving flow once the leg is
parsed.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.common.errors import AuthenticationError
from services.common.signing import SignatureVerifier, is_signed
from services.kv_transfer.config import KVTransferConfig

SIGNED_KEY = web.RequestKey("kv_signed", bool)


def leg_auth_middleware(kv: KVTransferConfig | None) -> Any:
    """Verify signed POSTs (a no-op without a KV secret, or for unsigned requests)."""
    verifier = None
    if kv is not None and kv.secret is not None:
        verifier = SignatureVerifier(kv.secret, kv.signature_window)

    @web.middleware
    async def leg_auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if verifier is not None and request.method == "POST" and is_signed(request.headers):
            body = await request.read()  # bounded by the limits middleware; cached
            verifier.verify(request.headers, request.method, request.path, body)
            request[SIGNED_KEY] = True
        return await handler(request)

    return leg_auth


def is_signed_request(request: web.Request) -> bool:
    return request.get(SIGNED_KEY, False)


def require_signed_leg(secret_configured: bool, signed: bool) -> None:
    """401 for a prefill leg that the mesh's secret did not sign (when there is a secret)."""
    if secret_configured and not signed:
        raise AuthenticationError(
            "prefill legs (kv_transfer_params.do_remote_decode) on this worker must be signed "
            "with the mesh's PDMESH_KV_SECRET: send them through the router, which signs them",
            param="kv_transfer_params", code="kv_leg_unsigned")
