"""Pull mode, both sides: the decode reads leased blocks from the prefill (the default mode).

Prefill worker, after a `hold_kv=True` request finished its prompt:
    params = await service.pull.prefill.offer(request_id, block_ids, num_tokens, first_token)
    -> return params.to_wire() as the response's `kv_transfer_params`
    (on client abort afterwards: service.pull.prefill.abort(request_id), harmless if released)
Decode worker, given those params (KVTransferParams.from_wire):
    kv = await service.pull.decode.fetch(params)   # verified KV in local blocks, lease released
    -> engine.add_request(..., prefilled=PrefilledKV(kv.block_ids, kv.num_tokens, ...))

Prefill side (`PullPrefill`): `offer` digests the request's held blocks, leases them and
returns the kv_transfer_params. The pull stream re-checks the lease after every gather, so a
lease that ends mid-stream yields a StreamError frame (410), never bytes of freed blocks.
Every lease ends exactly once (release, abort or reap) and only then are its blocks freed.

Decode side (`PullDecode`): handshake, allocate, stream blocks in, verify, release the lease.
`fetch(params)` either returns KV that passed every block digest, in blocks the caller now
owns, or raises with nothing leaked: local blocks are freed and the prefill is told to release
its lease on every path (success, error, cancellation), so errors propagate both ways at once.
`HeartbeatSender` keeps the leases of accepted requests alive until their pull ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import ClassVar

from aiohttp import web

from services.common.errors import (
    RESPONSE_STARTED_KEY,
    ApiError,
    BadGatewayError,
    BadRequestError,
    ConflictError,
    PeerError,
    ServiceUnavailableError,
)
from services.kv_transfer.codec import (
    BlockSink,
    StagingRing,
    compute_digests,
    iter_chunk_headers,
    iter_chunks,
)
from services.kv_transfer.context import KVContext, KVTransfer, PulledKV
from services.kv_transfer.handshake import PeerClient
from services.kv_transfer.lease import Lease, LeaseState, LeaseTable
from shared.protocol.codec import FrameReader, ProtocolError, frame_header
from shared.protocol.messages import (
    HeartbeatRequest,
    HeartbeatResult,
    LeaseRef,
    NodeInfo,
    PullRequest,
    ReleaseRequest,
    ReleaseResult,
    StreamEnd,
    StreamError,
    TensorChunk,
    TokenLogprobWire,
)
from shared.protocol.pd import KVTransferParams

log = logging.getLogger("pdmesh.kv_transfer")
FRAMES = "application/x-pdmesh-kv-frames"


# ---- prefill side ------------------------------------------------------------------------


class PullPrefill:
    """Prefill side of pull mode: the lease table and the handlers that read from it."""

    def __init__(self, ctx: KVContext, mode: str) -> None:
        self.ctx = ctx
        self.mode = mode
        cfg = ctx.config
        self.leases = LeaseTable(cfg.lease_seconds, cfg.lease_extension_s, ctx.clock)

    async def offer(self, request_id: str, block_ids: list[int], num_tokens: int,
                    first_token: TokenLogprobWire, prompt_digest: str = "") -> KVTransferParams:
        """Lease a finished prompt's held blocks; on any failure they are released at once
        (except when `request_id` already has a lease: those blocks stay with that lease)."""
        ctx, geo = self.ctx, self.ctx.geometry
        if self.leases.status(request_id).state == LeaseState.HELD.value:
            raise BadRequestError(f"request {request_id!r} already holds a KV lease",
                                  code="kv_lease_exists")
        try:
            if len(block_ids) != geo.blocks_for(num_tokens) or num_tokens < 1:
                raise BadRequestError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens",
                                      code="kv_bad_offer")
            if any(not 0 <= b < geo.num_blocks for b in block_ids):
                raise BadRequestError("offered block id out of range", code="kv_bad_offer")
            digests = await asyncio.to_thread(compute_digests, ctx.store.kv_cache, block_ids,
                                              geo, ctx.config.max_chunk_bytes)
            lease = self.leases.create(request_id, block_ids, num_tokens, digests)
        except BaseException:
            await ctx.settle(ctx.store.release_held(request_id), "release after failed offer")
            raise
        node = ctx.identity.node
        return KVTransferParams(
            transfer_mode=self.mode, remote_engine_id=node.engine_id, remote_host=node.kv_host,
            remote_port=node.kv_port, remote_request_id=request_id, lease_id=lease.lease_id,
            block_ids=list(block_ids), num_tokens=num_tokens, block_size=geo.block_size,
            first_token=first_token, digests=digests, compat_hash=ctx.identity.compat_hash,
            lease_expiry=time.time() + (lease.expires - ctx.clock()), prompt_digest=prompt_digest,
            remote_tls=ctx.config.tls.enabled,
        )

    def _end(self, request_id: str, state: LeaseState, lease_id: str | None = None) -> bool:
        lease = self.leases.end(request_id, state, lease_id)
        if lease is not None:
            self._free(lease)
        return lease is not None

    def _free(self, lease: Lease) -> None:
        """Free an ended lease's blocks (its state already changed: no read can start)."""
        if lease.state is LeaseState.EXPIRED:
            self.ctx.metrics.expired_leases.inc()
            log.info("Releasing expired KV blocks of request %s (%d blocks)",
                     lease.request_id, len(lease.block_ids))
        self.ctx.detach(self.ctx.store.release_held(lease.request_id),
                        f"release {lease.request_id}")

    def abort(self, request_id: str, lease_id: str | None = None) -> bool:
        """The request was aborted: end its lease now (only if it is `lease_id`, when given).
        Harmless if already released."""
        return self._end(request_id, LeaseState.RELEASED, lease_id)

    def release(self, msg: ReleaseRequest) -> ReleaseResult:
        self._end(msg.remote_request_id, LeaseState.RELEASED, msg.lease_id)
        return ReleaseResult(self.leases.status(msg.remote_request_id))

    def heartbeat(self, msg: HeartbeatRequest) -> HeartbeatResult:
        return HeartbeatResult(self.leases.heartbeat(msg.leases))

    def reap(self) -> None:
        for lease in self.leases.reap():
            self._free(lease)

    def open(self, msg: PullRequest) -> Lease:
        """Validate a pull before any byte is streamed (errors here are plain replies)."""
        lease = self.leases.readable(msg.remote_request_id, msg.lease_id)
        if list(msg.block_ids) != lease.block_ids:
            raise BadRequestError("requested block ids do not match the lease's blocks",
                                  param="block_ids", code="kv_block_ids_mismatch")
        return lease

    async def stream(self, request: web.Request, lease: Lease) -> web.StreamResponse:
        """Stream the lease's blocks as frames; the lease is checked before each gather.

        The body has a Content-Length (not chunked encoding): the receiver then gets the bytes
        as they arrive, without aiohttp joining them per HTTP chunk. If the lease ends
        mid-stream, a StreamError frame replaces the rest and the connection is closed.
        """
        ctx, start = self.ctx, time.perf_counter()
        geo, max_bytes = ctx.geometry, ctx.config.max_chunk_bytes
        chunks = list(iter_chunk_headers(geo, len(lease.block_ids), max_bytes))
        total = sum(c.payload_nbytes for c in chunks)
        heads = [frame_header(c) for c in chunks]
        end = frame_header(StreamEnd(len(chunks), total))
        resp = web.StreamResponse(headers={"Content-Type": FRAMES})
        resp.content_length = sum(map(len, heads)) + total + len(end)
        await resp.prepare(request)
        request[RESPONSE_STARTED_KEY] = True
        transport = request.transport
        assert transport is not None, "prepare() succeeded: the connection is open"
        ring = StagingRing(max_bytes, ctx.store.kv_cache.dtype,
                           in_transport=transport.get_write_buffer_size, pool=ctx.buffers)
        try:
            return await self._send(resp, lease, heads, end, ring, start)
        finally:
            ring.close()

    async def _send(self, resp: web.StreamResponse, lease: Lease, heads: list[bytes],
                    end: bytes, ring: StagingRing, start: float) -> web.StreamResponse:
        """The frames after the response headers: a chunk per head, then `end`."""
        ctx, sent = self.ctx, 0
        gathered = iter_chunks(ctx.store.kv_cache, lease.block_ids, ctx.geometry,
                               ctx.config.max_chunk_bytes, ring=ring)
        for head in heads:
            if lease.state is not LeaseState.HELD or lease.expires <= ctx.clock():
                state = "expired" if lease.state is LeaseState.HELD else lease.state.value
                ctx.metrics.failed(self.mode, f"kv_lease_{state}")
                await resp.write(frame_header(StreamError(
                    410, f"kv_lease_{state}", f"KV lease of {lease.request_id} is {state}")))
                resp.force_close()  # the declared length will not be met
                return resp
            out = next(gathered)  # gathered now, while the lease is known to be held
            ring.wrote(len(head))
            await resp.write(head)
            ring.wrote(len(out.payload))
            await resp.write(out.payload)
            ring.done()  # in the transport now: the ring sees when its bytes have left
            sent += len(out.payload)
        await resp.write(end)
        await resp.write_eof()
        ctx.metrics.observe(self.mode, "send", time.perf_counter() - start, sent)
        return resp

    @property
    def held_blocks(self) -> int:
        return self.leases.held_blocks

    async def close(self) -> None:
        for request_id in self.leases.active_ids():
            self._end(request_id, LeaseState.RELEASED)


# ---- decode side -------------------------------------------------------------------------


class PullDecode:
    """Decode side of pull mode (one per service; state lives in the heartbeats)."""

    def __init__(self, ctx: KVContext, mode: str) -> None:
        self.ctx = ctx
        self.mode = mode
        self.heartbeats = HeartbeatSender(ctx.identity.node.engine_id,
                                          ctx.config.heartbeat_interval_s)

    @staticmethod
    def lease_key(params: KVTransferParams) -> tuple[tuple[str, str], LeaseRef]:
        """(peer, lease) as the heartbeat sender tracks them."""
        peer = (params.remote_address, params.remote_engine_id)
        return peer, LeaseRef(params.remote_request_id, params.lease_id)

    def track(self, params: KVTransferParams) -> None:
        """Heartbeat this lease from now on (call at decode request arrival, before queueing)."""
        self.heartbeats.track(*self.lease_key(params))

    def untrack(self, params: KVTransferParams) -> None:
        self.heartbeats.untrack(*self.lease_key(params))

    def decline(self, params: KVTransferParams) -> None:
        """The decode gives up a request before pulling it: tell the prefill to release its
        lease now (in the background; its lease expires anyway if the prefill is unreachable)."""
        self.ctx.detach(self.release(params), "release declined lease")

    def _validate(self, params: KVTransferParams, peer: NodeInfo) -> None:
        """Reject params that cannot be right before allocating anything (fail closed)."""
        local = self.ctx.identity
        if params.transfer_mode != self.mode:
            raise ConflictError(f"kv_transfer_params are for {params.transfer_mode!r} mode, this "
                                f"worker runs {self.mode!r}", code="kv_transfer_mode_mismatch")
        if params.compat_hash != local.compat_hash and not self.ctx.config.allow_incompatible:
            raise ConflictError(f"kv_transfer_params were produced under compat hash "
                                f"{params.compat_hash}, this worker has {local.compat_hash}",
                                param="kv_transfer_params.compat_hash", code="kv_incompatible")
        if params.block_size != self.ctx.geometry.block_size:
            raise ConflictError(f"kv_transfer_params block size {params.block_size} differs from "
                                f"the local {self.ctx.geometry.block_size}",
                                code="kv_block_size_mismatch")
        ids = params.block_ids
        if any(not 0 <= b < peer.num_blocks for b in ids) or len(set(ids)) != len(ids):
            raise BadRequestError(f"kv_transfer_params name block ids outside the peer's "
                                  f"{peer.num_blocks} blocks or repeated",
                                  param="kv_transfer_params.block_ids", code="kv_bad_params")
        if len(ids) > self.ctx.geometry.num_blocks:
            raise ServiceUnavailableError(f"{len(ids)} blocks exceed this worker's whole KV cache "
                                          f"({self.ctx.geometry.num_blocks})",
                                          code="kv_capacity_exceeded")

    async def fetch(self, params: KVTransferParams) -> PulledKV:
        ctx, start = self.ctx, time.perf_counter()
        address, key = params.remote_address, self.lease_key(params)
        self.heartbeats.track(*key)
        local: list[int] | None = None
        try:
            peer = await ctx.peers.connect(address, params.remote_engine_id)
            self._validate(params, peer)
            local = await ctx.store.allocate(params.num_tokens)
            if local is None:
                raise ServiceUnavailableError("no free KV blocks for the transfer",
                                              code="kv_blocks_unavailable",
                                              headers={"Retry-After": "1"})
            nbytes = await self._pull(address, params, local)
        except BaseException as exc:
            self._finish(key, params)
            ctx.metrics.failed(self.mode, exc.code if isinstance(exc, ApiError) else type(exc).__name__)
            if local is not None:
                await ctx.settle(ctx.store.free(local), "free local blocks after failed pull")
            raise
        # No await from here on: a cancellation cannot strand the blocks we now return.
        assert local is not None
        self._finish(key, params)
        seconds = time.perf_counter() - start
        ctx.metrics.observe(self.mode, "receive", seconds, nbytes)
        return PulledKV(local, params.num_tokens, params.first_token, nbytes, seconds)

    def _finish(self, key: tuple[tuple[str, str], LeaseRef], params: KVTransferParams) -> None:
        """Stop heartbeating and tell the prefill to release, on every path (in background)."""
        self.heartbeats.untrack(*key)
        self.ctx.detach(self.release(params), "release remote lease")

    async def _pull(self, address: str, params: KVTransferParams, local: list[int]) -> int:
        ctx = self.ctx
        sink = BlockSink(ctx.store.kv_cache, local, ctx.geometry)
        request = PullRequest(ctx.identity.node.engine_id, params.remote_request_id,
                              params.lease_id, list(params.block_ids))

        def truncated() -> Exception:
            return BadGatewayError(f"KV stream from {address} ended early", code="kv_stream_truncated")

        async with ctx.peers.post(address, "/kv/v1/pull", request) as resp:
            async def piece() -> bytes:
                # The prefill sends a Content-Length, so pieces come as received (no join).
                return (await resp.content.readchunk())[0]

            await self._read_frames(address, sink, FrameReader(
                piece, ctx.config.max_chunk_bytes, on_eof=truncated))
        sink.verify(params.digests)
        return sink.num_bytes

    @staticmethod
    async def _read_frames(address: str, sink: BlockSink, frames: FrameReader) -> None:
        """Frames into `sink` until the stream's end frame; a peer's error frame raises."""
        while True:
            try:
                # Payload as received pieces: the sink places each straight into the cache.
                header, payload = await frames.next_pieces()
            except ProtocolError as exc:
                raise BadGatewayError(f"bad KV stream from {address}: {exc}",
                                      code="kv_peer_protocol") from None
            if isinstance(header, TensorChunk):
                sink.accept(header, payload)
            elif isinstance(header, StreamError):
                raise PeerError(header.status, f"KV peer {address}: {header.message}",
                                header.code)
            elif isinstance(header, StreamEnd):
                return
            else:
                raise BadGatewayError(f"unexpected {header.TAG!r} frame from {address}",
                                      code="kv_peer_protocol")

    async def release(self, params: KVTransferParams) -> None:
        """Tell the prefill to free its blocks; best effort (its lease expires otherwise).

        Release needs no handshake and no matching hash on the prefill (the lease id is the
        capability), so even a decode that was refused as incompatible frees the prefill."""
        address = params.remote_address
        msg = ReleaseRequest(self.ctx.identity.node.engine_id, params.remote_request_id,
                             params.lease_id)
        try:
            await self.ctx.peers.call(address, "/kv/v1/release", msg, ReleaseResult)
        except ApiError as exc:
            log.info("KV release of %s at %s failed (%s); its lease will expire",
                     params.remote_request_id, address, exc)


# ---- heartbeats ------------------------------------------------------------------------
# A lease is tracked from the moment the decode accepts the request (`track`) until its pull
# ends. Every lease/6 one batched message per prefill peer extends all of that peer's tracked
# leases, handshaking first if needed (so the later pull starts warm); a peer that is down
# only costs a log line, and its leases expire on the prefill side as designed.


class HeartbeatSender:
    """Tracks (peer address -> lease refs) and beats them on a timer task."""

    def __init__(self, engine_id: str, interval_s: float) -> None:
        self.engine_id = engine_id
        self.interval_s = interval_s
        # (peer address, peer engine id) -> lease ref -> how many trackers
        self._tracked: defaultdict[tuple[str, str], dict[LeaseRef, int]] = defaultdict(dict)
        self._task: asyncio.Task[None] | None = None

    def track(self, peer: tuple[str, str], ref: LeaseRef) -> None:
        refs = self._tracked[peer]
        refs[ref] = refs.get(ref, 0) + 1  # counted: a ref may be tracked by arrival and pull

    def untrack(self, peer: tuple[str, str], ref: LeaseRef) -> None:
        refs = self._tracked.get(peer)
        if refs is None or ref not in refs:
            return
        refs[ref] -= 1
        if refs[ref] <= 0:
            del refs[ref]
        if not refs:
            del self._tracked[peer]

    def tracked(self, peer: tuple[str, str]) -> list[LeaseRef]:
        return list(self._tracked.get(peer, {}))

    async def beat_once(self, peers: PeerClient) -> None:
        """One batched heartbeat to every peer with tracked leases, concurrently."""
        batches = {peer: list(refs) for peer, refs in self._tracked.items() if refs}
        await asyncio.gather(*(self._beat(peers, peer, refs) for peer, refs in batches.items()))

    async def _beat(self, peers: PeerClient, peer: tuple[str, str], refs: list[LeaseRef]) -> None:
        address, engine_id = peer
        try:
            await peers.connect(address, engine_id)
            result = await peers.call(address, "/kv/v1/heartbeat",
                                      HeartbeatRequest(self.engine_id, refs), HeartbeatResult)
        except ApiError as exc:
            log.warning("KV heartbeat to %s failed (%d leases): %s", address, len(refs), exc)
            return
        gone = [s.remote_request_id for s in result.leases if s.state != "held"]
        if gone:
            log.info("KV peer %s reports leases no longer held: %s", address, gone)

    def start(self, peers: PeerClient) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                await self.beat_once(peers)

        self._task = asyncio.ensure_future(loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


# ---- the mode ----------------------------------------------------------------------------


class PullTransfer(KVTransfer):
    """Pull mode: both sides exist in every worker of this mode, the role decides which one
    is used: `prefill` (a `PullPrefill`: offer, abort, serve pulls) and `decode` (a
    `PullDecode`: track, fetch, decline). Callers use the sides directly."""

    mode: ClassVar[str] = "pull"

    def __init__(self, ctx: KVContext) -> None:
        super().__init__(ctx)
        self.prefill = PullPrefill(ctx, self.mode)
        self.decode = PullDecode(ctx, self.mode)

    async def start(self) -> None:
        self.decode.heartbeats.start(self.ctx.peers)

    async def close(self) -> None:
        await self.decode.heartbeats.close()
        await self.prefill.close()

    def reap(self) -> None:
        self.prefill.reap()

    @property
    def held_blocks(self) -> int:
        return self.prefill.held_blocks

    def oldest_age(self) -> float:
        return self.prefill.leases.oldest_age()
