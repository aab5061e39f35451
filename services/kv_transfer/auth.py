"""Who may talk to a KV service: signed peers with a secret, loopback peers without one.

With `PDMESH_KV_SECRET` set, every request under /kv/v1/ except `UNSIGNED_PATHS` must be signed
with it (timestamp, nonce, HMAC: services.common.signing): a missing, wrong, stale or replayed
signature is a 401, checked before anything in the body is parsed. So a replayed pull,
release or handshake is refused (`kv_auth_replayed`), not served again.

Without a secret nothing can tell a peer worker from any other process, so the service
serves peers on loopback only: any other peer gets 403 `kv_peer_not_loopback`, whatever the
bind address. A multi-host mesh therefore needs the secret (and `pdmesh up` and compose give
every mesh one by default).
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

from aiohttp import web

from services.common.errors import ApiError
from services.common.signing import SignatureVerifier, SignatureWindow

log = logging.getLogger("pdmesh.kv_transfer")
KV_PREFIX = "/kv/v1/"
UNSIGNED_PATHS = frozenset({"/kv/v1/info"})  # read-only facts a router may query


class ForbiddenPeerError(ApiError):
    """403: a KV service without a secret serves loopback peers only."""

    status = 403
    error_type = "permission_error"
    default_code = "kv_peer_not_loopback"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for anything unparsable."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def peer_host(request: web.Request) -> str | None:
    """The connected peer's address (the socket's, never a header a client could forge)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def kv_auth_middleware(secret: bytes | None, window: SignatureWindow) -> Any:
    """Verify signatures (with a secret) or refuse non-loopback peers (without one)."""
    verifier = SignatureVerifier(secret, window) if secret is not None else None

    @web.middleware
    async def kv_auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith(KV_PREFIX):
            return await handler(request)
        if verifier is None:
            host = peer_host(request)
            if host is None or not is_loopback(host):
                raise ForbiddenPeerError(
                    f"This KV service has no PDMESH_KV_SECRET, so it serves loopback peers "
                    f"only, not {host}. Give every worker of the mesh the same "
                    "PDMESH_KV_SECRET (at least 16 bytes).")
        elif request.path not in UNSIGNED_PATHS:
            body = await request.read()  # cached by aiohttp for the handler
            verifier.verify(request.headers, request.method, request.path, body)
        return await handler(request)

    return kv_auth

