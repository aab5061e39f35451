"""The KV handshake, both sides: compat hash, negotiation, layer coverage, HMAC, peer client.

Order of checks, on both sides of a handshake:
1. the compat hash, before anything else in the body is parsed; a mismatch is a 409 naming
   every differing factor with both values, and both hashes;
2. negotiation of what the hash leaves out: role (prefill with decode), transfer mode, block
   size (its own message), pipeline layout: the peer's per-stage layer ranges must cover
   exactly the layers this side holds (`check_layer_coverage`; a 409 naming the missing
   layers).
With `allow_incompatible` a hash mismatch is logged loudly on every handshake instead.
The server side keeps the engines that completed a handshake (`PeerRegistry`); the client
side (`PeerClient`) handshakes with each peer and sends it every signed request.

Before all of that, HMAC authentication (on when a secret is configured): every handshake and
transfer request carries `X-PDMesh-KV-Timestamp` (unix seconds) and `X-PDMesh-KV-Signature`,
hex HMAC-SHA256 over "timestamp\\nMETHOD\\npath\\n" + body. Binding method and path stops a
signed body from being replayed on another route; the timestamp window bounds replays in
time. Missing or wrong -> 401, checked before anything in the body is read.

Client side: `PeerClient.connect(address, engine_id)` handshakes once per peer and caches the
result; the cache entry is replaced when the engine id a caller expects (from
kv_transfer_params or a push registration) differs from the cached one, i.e. the peer
restarted. Transport failures become 502 `kv_peer_unreachable`; a peer's error envelope is
re-raised as `PeerError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web

from services.common.errors import (
    AuthenticationError,
    BadGatewayError,
    ConflictError,
    peer_error,
)
from shared.protocol.codec import EnvelopeReader, Message, ProtocolError, decode, seal
from shared.protocol.compat import CompatFactors, diff_factors
from shared.protocol.layout import LayerRange
from shared.protocol.messages import HandshakeAccepted, NodeInfo

log = logging.getLogger("pdmesh.kv_transfer")
R = TypeVar("R", bound=Message)
MSGPACK = "application/msgpack"


@dataclass(frozen=True)
class KVIdentity:
    """This service's node facts and compat factors, fixed at start-up."""

    node: NodeInfo
    factors: CompatFactors
    compat_hash: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compat_hash", self.factors.hash)
        if self.node.transfer_mode != self.factors.transfer_mode:
            raise ValueError("node and factors disagree on the transfer mode")
        if self.node.layer_end > self.factors.num_layers:
            raise ValueError(f"KV service holds layers up to {self.node.layer_end}, the model "
                             f"has {self.factors.num_layers}")
        check_own_ranges(self.node)

    def seal(self, msg: Message) -> bytes:
        return seal(self.compat_hash, self.factors.to_wire(), msg)


def mismatch_error(local: KVIdentity, remote_hash: str, remote_factors: object) -> ConflictError:
    diffs = diff_factors(local.factors, remote_factors)
    named = "; ".join(str(d) for d in diffs) or "none named (factors identical, hash differs)"
    return ConflictError(
        f"KV compatibility hash mismatch: local {local.compat_hash} vs remote {remote_hash}. "
        f"Differing factors: {named}", param="compat_hash", code="kv_incompatible")


def check_hash(local: KVIdentity, reader: EnvelopeReader, allow_incompatible: bool,
               handshake: bool) -> None:
    """Compare the envelope's hash with ours before its payload is parsed.

    Garbage after a different hash is never decoded beyond a lenient read of the factors (used
    only to word the error), so any such body gets a clean 409.
    """
    if reader.compat_hash == local.compat_hash:
        return
    try:
        remote_factors = reader.factors()
    except ValueError:
        remote_factors = "<unreadable>"
    err = mismatch_error(local, reader.compat_hash, remote_factors)
    if not allow_incompatible:
        raise err
    if handshake:
        log.warning("!!! KV HANDSHAKE WITH AN INCOMPATIBLE PEER (--kv-allow-incompatible): %s "
                    "!!! Transferred KV may be garbage.", err.message)


# ---- layer coverage -------------------------------------------------------------------
# Layer coverage, negotiated in the KV handshake: the stages behind a peer must serve every
# layer this side holds, each exactly once.
#
# A KV service declares, per pipeline stage, the global decoder layers [start, end) that stage
# computed (`NodeInfo.layer_ranges`; a PP=1 worker declares one range). With the pipeline's one
# shared cache, stage 0's service reads and writes every stage's layers, so the blocks move as
# with PP=1; the declaration is what lets the other side check, before any byte moves, that
# the union of the stages is exactly the layers it needs: no layer missing (KV the decode would
# attend to as zeros), none served twice, none outside the model. A failed check is a 409 that
# names the layers, never a 500. Pipeline size itself is not in the compat hash: it is
# negotiated here, after the hash matched.
#
# Coverage is computed on intervals (never layer by layer), so a peer declaring huge ranges
# costs nothing to reject.


@dataclass(frozen=True)
class LayerCoverage:
    """How declared stage ranges cover a span [start, end): maximal runs of layers that no
    stage serves (`missing`), that several serve (`overlapping`), and that are outside it."""

    missing: tuple[LayerRange, ...]
    overlapping: tuple[LayerRange, ...]
    outside: tuple[LayerRange, ...]

    @property
    def exact(self) -> bool:
        return not (self.missing or self.overlapping or self.outside)

    def describe(self) -> str:
        parts = [f"{what} {format_layers(runs)}" for what, runs in (
            ("missing layers", self.missing), ("layers served by more than one stage",
                                               self.overlapping),
            ("layers outside the model's span", self.outside)) if runs]
        return "; ".join(parts) or "exact"


def _merge(runs: Iterable[LayerRange]) -> tuple[LayerRange, ...]:
    """Sorted, non-empty, adjacent or overlapping runs joined."""
    merged: list[list[int]] = []
    for a, b in sorted(r for r in runs if r[0] < r[1]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def layer_coverage(ranges: Iterable[LayerRange], start: int, end: int) -> LayerCoverage:
    """Sweep the ranges (sorted by start) over [start, end)."""
    missing, overlapping, outside = [], [], []
    cursor = start  # every layer in [start, cursor) is covered at least once
    for a, b in sorted(ranges):
        outside += [(a, min(b, start)), (max(a, end), b)]
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            continue
        if lo > cursor:
            missing.append((cursor, lo))
        overlapping.append((lo, min(hi, cursor)))
        cursor = max(cursor, hi)
    missing.append((cursor, end))
    return LayerCoverage(_merge(missing), _merge(overlapping), _merge(outside))


def format_layers(runs: Iterable[LayerRange]) -> str:
    """((1, 2), (5, 8)) -> '1, 5-7' (inclusive layer numbers, as a person counts them)."""
    return ", ".join(str(a) if b - a == 1 else f"{a}-{b - 1}" for a, b in runs)


def _listed(node: NodeInfo) -> str:
    return str([list(r) for r in node.stage_ranges])


def check_own_ranges(node: NodeInfo) -> None:
    """A service's own declaration must tile the layers it holds (ValueError: a config bug)."""
    cov = layer_coverage(node.stage_ranges, node.layer_start, node.layer_end)
    if not cov.exact:
        raise ValueError(f"KV service declares stage layers {_listed(node)} over its layers "
                         f"[{node.layer_start}, {node.layer_end}): {cov.describe()}")


def check_layer_coverage(local: NodeInfo, remote: NodeInfo) -> None:
    """409 unless the remote's stages tile exactly the layers `local` holds, and its own span.

    For a PP=1 decode `local` holds [0, num_layers); a PP prefill passes with any stage
    split whose union is that, e.g. [[0, 15], [15, 30]].
    """
    needed = (local.layer_start, local.layer_end)
    cov = layer_coverage(remote.stage_ranges, *needed)
    if cov.exact and (remote.layer_start, remote.layer_end) == needed:
        return
    detail = cov.describe() if not cov.exact else (
        f"its stages cover [{needed[0]}, {needed[1]}) but it claims to hold "
        f"[{remote.layer_start}, {remote.layer_end})")
    raise ConflictError(
        f"KV layer coverage: the {remote.role} peer {remote.engine_id} (pp={remote.pp_size}) "
        f"declares stage layers {_listed(remote)}, this {local.role} needs every layer of "
        f"[{needed[0]}, {needed[1]}) exactly once: {detail}. The compat hash matched; the "
        "pipeline layouts cannot exchange KV.",
        param="layer_ranges", code="kv_layer_coverage")


# ---- negotiation ----------------------------------------------------------------------


def negotiate(local: NodeInfo, remote: NodeInfo) -> None:
    """Raise a 409 naming the first negotiable fact that cannot work between the two nodes."""
    if local.role == remote.role:
        raise ConflictError(f"KV peers must pair prefill with decode; both are {local.role}",
                            code="kv_role_mismatch")
    if local.transfer_mode != remote.transfer_mode:
        raise ConflictError(f"KV transfer_mode differs: local {local.transfer_mode!r} vs remote "
                            f"{remote.transfer_mode!r}", param="transfer_mode",
                            code="kv_transfer_mode_mismatch")
    if local.block_size != remote.block_size:
        raise ConflictError(
            f"KV block size differs: local {local.block_size} vs remote {remote.block_size} "
            "tokens per block. The compat hash matched, but blocks are copied 1:1, so both "
            "workers need the same --block-size.", param="block_size",
            code="kv_block_size_mismatch")
    check_layer_coverage(local, remote)  # the stages' union is exactly our layers
    if local.num_blocks < 1 or remote.num_blocks < 1:
        raise ConflictError("a KV peer has no cache blocks", code="kv_capacity_mismatch")


class PeerRegistry:
    """Server side: engines that completed a handshake, by engine id and by KV address.

    A new handshake from an address under a different engine id (a restarted peer) drops the
    old engine's entry, so its stale requests get 409 `kv_handshake_required`.
    """

    def __init__(self) -> None:
        self._by_engine: dict[str, NodeInfo] = {}
        self._engine_at: dict[str, str] = {}

    def admit(self, node: NodeInfo) -> None:
        old = self._engine_at.get(node.address)
        if old is not None and old != node.engine_id:
            self._by_engine.pop(old, None)
            log.info("KV peer at %s restarted: engine %s -> %s", node.address, old, node.engine_id)
        self._by_engine[node.engine_id] = node
        self._engine_at[node.address] = node.engine_id

    def require(self, engine_id: str) -> NodeInfo:
        node = self._by_engine.get(engine_id)
        if node is None:
            raise ConflictError(f"engine {engine_id!r} has not completed a KV handshake",
                                code="kv_handshake_required")
        return node

    def __len__(self) -> int:
        return len(self._by_engine)


# ---- HMAC ----------------------------------------------------------------------------


SIGNATURE_HEADER = "X-PDMesh-KV-Signature"
TIMESTAMP_HEADER = "X-PDMesh-KV-Timestamp"
KV_PREFIX = "/kv/v1/"
UNSIGNED_PATHS = frozenset({"/kv/v1/info"})  # read-only facts a router may query


def _mac(secret: bytes, timestamp: str, method: str, path: str,
         body_parts: Iterable[bytes | memoryview]) -> str:
    mac = hmac.new(secret, f"{timestamp}\n{method.upper()}\n{path}\n".encode(), hashlib.sha256)
    for part in body_parts:
        mac.update(part)
    return mac.hexdigest()


def sign(secret: bytes | None, method: str, path: str,
         body_parts: Iterable[bytes | memoryview]) -> dict[str, str]:
    """Headers to send with a request (none without a secret). Parts avoid joining a body."""
    if secret is None:
        return {}
    ts = str(int(time.time()))
    return {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: _mac(secret, ts, method, path, body_parts)}


def verify(secret: bytes, headers: Any, method: str, path: str, body: bytes,
           max_skew_s: float) -> None:
    ts, sig = headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER)
    if not ts or not sig:
        raise AuthenticationError("KV request is not signed (missing HMAC headers)",
                                  code="kv_auth_missing")
    try:
        skew = abs(time.time() - int(ts))
    except (ValueError, OverflowError):  # not an integer, or one past a float (400 digits)
        skew = float("inf")
    expected = _mac(secret, ts, method, path, (body,))
    if not hmac.compare_digest(expected, sig) or skew > max_skew_s:
        raise AuthenticationError("KV request signature is invalid or too old",
                                  code="kv_auth_invalid")


def hmac_middleware(secret: bytes | None, max_skew_s: float) -> Any:
    """Verify every request under /kv/v1/ except UNSIGNED_PATHS; a no-op without a secret."""

    @web.middleware
    async def kv_hmac(request: web.Request, handler: Any) -> web.StreamResponse:
        if secret is not None and request.path.startswith(KV_PREFIX) \
                and request.path not in UNSIGNED_PATHS:
            body = await request.read()  # cached by aiohttp for the handler
            verify(secret, request.headers, request.method, request.path, body, max_skew_s)
        return await handler(request)

    return kv_hmac


# ---- client side ---------------------------------------------------------------------


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
        parts: list[bytes | memoryview] = [envelope] if trailing is None else [envelope, trailing]
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
