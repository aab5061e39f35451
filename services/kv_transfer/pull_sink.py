"""Pull mode, decode side: handshake, allocate, stream blocks in, verify, release the lease.

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

from services.common.errors import ApiError
from services.kv_transfer.blocks import BlockSink
from services.kv_transfer.errors import (
    BadGatewayError,
    BadRequestError,
    ConflictError,
    PeerError,
    ServiceUnavailableError,
)
from services.kv_transfer.peers import PeerClient
from services.kv_transfer.transfer import KVContext, PulledKV
from shared.protocol.codec import FrameReader, ProtocolError
from shared.protocol.messages import (
    HeartbeatRequest,
    HeartbeatResult,
    KVTransferParams,
    LeaseRef,
    NodeInfo,
    PullRequest,
    ReleaseRequest,
    ReleaseResult,
    StreamEnd,
    StreamError,
    TensorChunk,
)

log = logging.getLogger("pdmesh.kv_transfer")


class PullSink:
    """The decode's half of pull mode (one per service; state lives in the heartbeats)."""

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
        self._task: asyncio.Task | None = None

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
