"""Client side of the KV service: signed envelope requests and a per-peer handshake cache.

`PeerClient.connect(address, engine_id)` handshakes once per peer and caches the result; the
cache entry is replaced when the engine id a caller expects (from kv_transfer_params or a push
registration) differs from the cached one, i.e. the peer restarted. Transport failures become
502 `kv_peer_unreachable`; a peer's error envelope is re-raised as `PeerError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol, TypeVar

import aiohttp

from services.common.errors import BadGatewayError, peer_error
from services.kv_transfer.handshake import KVIdentity, mismatch_error, negotiate, sign
from shared.protocol.codec import Message, ProtocolError, decode
from shared.protocol.messages import HandshakeAccepted, NodeInfo

log = logging.getLogger("pdmesh.kv_transfer")
R = TypeVar("R", bound=Message)
MSGPACK = "application/msgpack"


class HasIdentity(Protocol):
    identity: KVIdentity


class PeerClient:
    """Talks to other KV services on behalf of this one (one aiohttp session, owned outside).

    It reads `owner.identity` at each call, so the bound port recorded after construction
    (ephemeral ports) is what peers see.
    """

    def __init__(self, owner: HasIdentity, http: aiohttp.ClientSession, secret: bytes | None,
                 allow_incompatible: bool) -> None:
        self._owner = owner
        self._http = http
        self._secret = secret
        self._allow_incompatible = allow_incompatible
        self._peers: dict[str, NodeInfo] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def connect(self, address: str, engine_id: str | None = None) -> NodeInfo:
        """The peer's node facts after a (cached) successful handshake."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:  # concurrent first requests to one peer share one handshake
            node = self._peers.get(address)
            if node is not None and engine_id is not None and node.engine_id != engine_id:
                log.info("KV peer %s changed engine id %s -> %s: handshaking again",
                         address, node.engine_id, engine_id)
                node = None
            if node is None:
                node = await self._handshake(address)
                self._peers[address] = node
        if engine_id is not None and node.engine_id != engine_id:
            raise BadGatewayError(f"KV peer {address} is engine {node.engine_id}, not {engine_id}"
                                  " (restarted: its blocks are gone)", code="kv_peer_restarted")
        return node

    @property
    def identity(self) -> KVIdentity:
        return self._owner.identity

    def forget(self, address: str) -> None:
        self._peers.pop(address, None)

    async def _handshake(self, address: str) -> NodeInfo:
        accepted = await self.call(address, "/kv/v1/handshake", self.identity.node,
                                   HandshakeAccepted)
        if accepted.compat_hash != self.identity.compat_hash:
            # The server compared first; this catches a server run with allow_incompatible.
            err = mismatch_error(self.identity, accepted.compat_hash, accepted.factors)
            if not self._allow_incompatible:
                raise err
            log.warning("!!! KV HANDSHAKE WITH AN INCOMPATIBLE PEER %s: %s", address, err.message)
        negotiate(self.identity.node, accepted.node)
        return accepted.node

    async def call(self, address: str, route: str, msg: Message, reply: type[R],
                   trailing: memoryview | None = None) -> R:
        """POST an envelope (plus raw trailing bytes) and decode the reply message."""
        async with self.post(address, route, msg, trailing) as resp:
            body = await resp.read()
        try:
            return decode(body, reply)
        except ProtocolError as exc:
            raise BadGatewayError(f"KV peer {address} sent a bad reply to {route}: {exc}",
                                  code="kv_peer_protocol") from None

    @asynccontextmanager
    async def post(self, address: str, route: str, msg: Message,
                   trailing: memoryview | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """The open 200 response (for streaming); errors raised as KV errors."""
        envelope = self.identity.seal(msg)
        parts = [envelope] if trailing is None else [envelope, trailing]
        headers = {"Content-Type": MSGPACK, **sign(self._secret, "POST", route, parts)}
        data: bytes | aiohttp.Payload = envelope
        if trailing is not None:  # no join: the payload goes out as its own write
            data = _PartsPayload(parts)
        try:
            async with self._http.post(f"http://{address}{route}", data=data,
                                       headers=headers) as resp:
                if resp.status != 200:
                    raise peer_error(resp.status, await resp.read(), address)
                yield resp
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ServerDisconnectedError):
                self.forget(address)  # the next attempt handshakes again
            raise BadGatewayError(f"KV peer {address} unreachable on {route}: "
                                  f"{type(exc).__name__}: {exc}",
                                  code="kv_peer_unreachable") from None


class _PartsPayload(aiohttp.Payload):
    """A request body written as several buffers, without joining them (no big copy)."""

    _autoclose = True  # memory only, nothing to close

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        super().__init__(parts, content_type=MSGPACK)
        self._parts = parts
        self._size = sum(len(p) for p in parts)

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        for part in self._parts:
            await writer.write(part)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._parts)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("binary KV payload")
