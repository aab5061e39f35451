"""Pull mode: the decode reads leased blocks from the prefill (the default mode).

Prefill worker, after a `hold_kv=True` request finished its prompt:
    params = await service.pull.offer(request_id, block_ids, num_tokens, first_token)
    -> return params.to_json() as the response's `kv_transfer_params`
    (on client abort afterwards: service.pull.abort(request_id), harmless if already released)
Decode worker, given those params (KVTransferParams.from_json):
    kv = await service.pull.fetch(params)   # verified KV in local blocks, lease released
    -> engine.add_request(..., prefilled=PrefilledKV(kv.block_ids, kv.num_tokens, ...))

Prefill side (`PullSource`): `offer` digests the request's held blocks, leases them and
returns the kv_transfer_params. The pull stream re-checks the lease after every gather, so a
lease that ends mid-stream yields a StreamError frame (410), never bytes of freed blocks.
Every lease ends exactly once (release, abort or reap) and only then are its blocks freed.
The decode side is `services.kv_transfer.pull_sink.PullSink`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import ClassVar

from aiohttp import web

from services.common.errors import RESPONSE_STARTED_KEY
from services.kv_transfer.blocks import (
    StagingRing,
    compute_digests,
    iter_chunk_headers,
    iter_chunks,
)
from services.kv_transfer.errors import BadRequestError
from services.kv_transfer.lease import Lease, LeaseState, LeaseTable
from services.kv_transfer.pull_sink import PullSink
from services.kv_transfer.transfer import KVContext, KVTransfer, PulledKV
from shared.protocol.codec import frame_header
from shared.protocol.messages import (
    HeartbeatRequest,
    HeartbeatResult,
    KVTransferParams,
    PullRequest,
    ReleaseRequest,
    ReleaseResult,
    StreamEnd,
    StreamError,
    TokenLogprobWire,
)

log = logging.getLogger("pdmesh.kv_transfer")
FRAMES = "application/x-pdmesh-kv-frames"


class PullSource:
    """The prefill's lease table and the handlers that read from it."""

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


class PullTransfer(KVTransfer):
    """Pull mode: a `PullSource` (lease table, serves pulls) and a `PullSink` (fetches).

    Both halves exist in every worker of this mode; the role decides which one is used.
    """

    mode: ClassVar[str] = "pull"

    def __init__(self, ctx: KVContext) -> None:
        super().__init__(ctx)
        self.source = PullSource(ctx, self.mode)
        self.sink = PullSink(ctx, self.mode)

    async def offer(self, request_id: str, block_ids: list[int], num_tokens: int,
                    first_token: TokenLogprobWire, prompt_digest: str = "") -> KVTransferParams:
        return await self.source.offer(request_id, block_ids, num_tokens, first_token,
                                       prompt_digest)

    def abort(self, request_id: str, lease_id: str | None = None) -> bool:
        return self.source.abort(request_id, lease_id)

    async def fetch(self, params: KVTransferParams) -> PulledKV:
        return await self.sink.fetch(params)

    def track(self, params: KVTransferParams) -> None:
        """Heartbeat this lease from now on (call at decode request arrival, before queueing)."""
        self.sink.heartbeats.track(*self.sink.lease_key(params))

    def untrack(self, params: KVTransferParams) -> None:
        self.sink.heartbeats.untrack(*self.sink.lease_key(params))

    def decline(self, params: KVTransferParams) -> None:
        """The decode gives up a request before pulling it: tell the prefill to release its
        lease now (in the background; its lease expires anyway if the prefill is unreachable)."""
        self.ctx.detach(self.sink.release(params), "release declined lease")

    async def start(self) -> None:
        self.sink.heartbeats.start(self.ctx.peers)

    async def close(self) -> None:
        await self.sink.heartbeats.close()
        await self.source.close()

    def reap(self) -> None:
        self.source.reap()

    @property
    def held_blocks(self) -> int:
        return self.source.held_blocks

    def oldest_age(self) -> float:
        return self.source.leases.oldest_age()
