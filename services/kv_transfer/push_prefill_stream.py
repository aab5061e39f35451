"""Push mode, prefill side: one transfer from the request's arrival to the decode's ack.

A `PushStream` is opened when a push prefill leg arrives, before its prompt runs. Its task
takes the decode's registration from the rendezvous, then writes blocks as the engine reports
them computed (`feed`, one `KVProgress` per step while chunked prefill runs), so the transfer
overlaps compute. `finish` hands over the held blocks once the prompt is done: what was not
written yet (at least the partial last block) goes out, then the completion with every
block's digest and the first token.

Correctness of early reads: a reported full block is final while the request owns it. A
preemption frees the blocks, so a block read meanwhile may hold another request's bytes; the
engine then reports a new epoch and the stream writes everything again from block 0 (the
decode overwrites the rows and their digests). `finish` also rewrites from 0 when the held
blocks are not the ones written. Digests are taken from the bytes as sent, per epoch.

Waiting: while the prompt is queued behind other prompts nothing is written, so the task
sends a keepalive every third of the decode's push deadline; the decode's deadline measures
silence (a lost prefill leg, a dead process), not a queue. How long a queued prompt may wait
is the prefill request's business (its client or the router cancels it, which aborts here).

Failure: any error (the decode's abort, a write refused, the deadline, `abort` by the
prefill's own request ending) ends the task; the decode is told unless it told us. Held
blocks are the prefill side's business (PushPrefill.send releases them however this ends).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from services.common.errors import ApiError, ConflictError, GoneError
from services.kv_transfer.codec import StagingRing, iter_chunks
from services.kv_transfer.context import KVContext
from shared.engine.kv_stream import KVProgress
from shared.protocol.messages import (
    Ack,
    PushAbort,
    PushComplete,
    PushKeepalive,
    PushRegister,
    PushWrite,
)
from shared.protocol.messages import TokenLogprobWire as FirstToken
from shared.protocol.tensors import RowDigester

log = logging.getLogger("pdmesh.kv_transfer")


@dataclass
class StreamStats:
    """How much of the transfer overlapped compute (for metrics and the benchmark).

    `early_blocks`: blocks already written (acknowledged) when `finish` was called, i.e.
    while the prompt was still computing; `late_blocks`: written after; `finish_seconds`: the
    transfer time left exposed after the prompt finished (finish -> completion acked)."""

    early_blocks: int = 0
    late_blocks: int = 0
    restarts: int = 0
    num_writes: int = 0
    num_bytes: int = 0
    finish_seconds: float = 0.0


@dataclass(frozen=True)
class _Final:
    block_ids: list[int]
    first_token: FirstToken


class PushStream:
    """The prefill's half of one push transfer (see module doc); `task` ends with the bytes
    written or the error that stopped it."""

    def __init__(self, ctx: KVContext, mode: str, transfer_id: str, num_tokens: int,
                 registration: asyncio.Future[PushRegister],
                 decode_engine_id: str | None = None) -> None:
        self.ctx, self.mode = ctx, mode
        self.transfer_id, self.num_tokens = transfer_id, num_tokens
        self.num_blocks = ctx.geometry.blocks_for(num_tokens)
        self.decode_engine_id = decode_engine_id
        self.stats = StreamStats()
        self.registration: PushRegister | None = None
        self._known: list[int] = []  # full blocks reported so far (current epoch)
        self._epoch = 0
        self._generation = 0  # bumped by every restart: a write in flight is then discarded
        self._sent: list[int] = []  # block ids written under the current generation, in order
        self._digester = self._new_digester()
        # Reused gather buffers; a slot is reused only after the decode acknowledged its write
        # (the whole body was read by then). Dropped on any failed write: its transport may
        # still be flushing the buffer.
        self._ring: StagingRing | None = None
        self._final: _Final | None = None
        self._failure: BaseException | None = None
        self._peer_failed = False  # the decode ended it: nothing to tell it
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(registration))

    def _new_digester(self) -> RowDigester:
        geo = self.ctx.geometry
        return RowDigester(self.num_blocks, geo.block_shape, geo.itemsize)

    # ---- inputs (event loop) -----------------------------------------------------------
    def feed(self, progress: KVProgress) -> None:
        """The engine computed more full blocks (or restarted after a preemption)."""
        if self.task.done() or self._final is not None:
            return
        if progress.epoch != self._epoch:
            self._epoch = progress.epoch
            self._restart()
        self._known = list(progress.block_ids)
        self._poke()

    def abort(self, reason: str) -> None:
        """This side gave up (its request failed): stop, and tell the decode."""
        self._fail(GoneError(f"prefill gave up transfer {self.transfer_id}: {reason}",
                             code="kv_push_aborted"))

    def peer_aborted(self, exc: BaseException) -> None:
        """The decode gave up: stop without telling it."""
        self._peer_failed = True
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None and not self.task.done():
            self._failure = exc
            self._poke()

    async def finish(self, block_ids: list[int], first_token: FirstToken) -> int:
        """The prompt is done and its blocks are held: write the rest and complete.
        Returns the bytes written in all. Cancelling the caller aborts the transfer."""
        if len(block_ids) != self.num_blocks:
            self.abort("the prompt's block count changed")
            raise ConflictError(f"transfer {self.transfer_id}: {len(block_ids)} held blocks, "
                                f"{self.num_blocks} expected", code="kv_push_shape_mismatch")
        self._final = _Final(list(block_ids), first_token)
        self._pending()  # restarts now if the held blocks are not those written
        self.stats.early_blocks = len(self._sent)
        self._poke()
        start = time.perf_counter()
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            self.abort("the prefill request was cancelled")
            raise
        finally:
            self.stats.finish_seconds = time.perf_counter() - start

    async def flushed(self) -> None:
        """Wait until every reported block is written (or the stream ended)."""
        while not self.task.done() and not self._is_idle():
            waiter = asyncio.ensure_future(self._idle.wait())
            await asyncio.wait([self.task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    @property
    def written_blocks(self) -> int:
        """Blocks written and acknowledged under the current epoch (rows 0..n-1)."""
        return len(self._sent)

    # ---- the task ----------------------------------------------------------------------
    def _poke(self) -> None:
        self._idle.clear()
        self._wake.set()

    def _is_idle(self) -> bool:
        return self.registration is not None and not self._pending()[1] and self._final is None

    def _restart(self) -> None:
        self._generation += 1
        self._sent = []
        self._digester = self._new_digester()
        self.stats.restarts += 1

    def _pending(self) -> tuple[int, list[int]]:
        """(first row, block ids) still to write."""
        target = self._final.block_ids if self._final is not None else self._known
        if target[:len(self._sent)] != self._sent:
            self._restart()  # the held blocks are not those written (see module doc)
        return len(self._sent), target[len(self._sent):]

    async def _run(self, registration: asyncio.Future[PushRegister]) -> int:
        ctx = self.ctx
        try:
            address = await self._connect(await registration)
            while True:
                if self._failure is not None:
                    raise self._failure
                first, ids = self._pending()
                if ids:
                    await self._write(address, first, ids)
                elif self._final is not None:
                    return await self._complete(address, self._final)
                else:
                    await self._idle_wait(address)
        except BaseException as exc:
            ctx.metrics.failed(self.mode, exc.code if isinstance(exc, ApiError) else type(exc).__name__)
            if self.registration is not None and not self._peer_failed:
                ctx.detach(self._notify_abort(self.registration, str(exc)), "push abort to decode")
            raise
        finally:
            if self._ring is not None:  # every slot left was acknowledged: safe to reuse
                self._ring.close()
                self._ring = None

    async def _idle_wait(self, address: str) -> None:
        """Nothing to write until the engine computes more: wait for a poke, and while none
        comes tell the decode every third of its push deadline that we are alive (a prompt
        queued behind long prefills is waiting, not lost; only silence is a failure)."""
        self._idle.set()
        self._wake.clear()
        assert self.registration is not None, "idle only after the registration is taken"
        interval = self.registration.deadline_seconds / 3  # the decode's deadline, not ours
        while not self._wake.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except TimeoutError:
                msg = PushKeepalive(self.ctx.identity.node.engine_id, self.transfer_id)
                await self.ctx.peers.call(address, "/kv/v1/push/keepalive", msg, Ack)

    async def _connect(self, reg: PushRegister) -> str:
        if self.decode_engine_id is not None and reg.engine_id != self.decode_engine_id:
            raise ConflictError(f"transfer {self.transfer_id} was registered by engine "
                                f"{reg.engine_id}, not {self.decode_engine_id}",
                                code="kv_push_wrong_sender")
        self.registration = reg  # from here on, a failure is reported to the decode
        address = reg.address
        await self.ctx.peers.connect(address, reg.engine_id)
        if reg.num_tokens != self.num_tokens or len(reg.block_ids) != self.num_blocks:
            raise ConflictError(
                f"transfer {self.transfer_id}: decode registered {len(reg.block_ids)} blocks "
                f"for {reg.num_tokens} tokens, prefill has {self.num_blocks} for "
                f"{self.num_tokens}", code="kv_push_shape_mismatch")
        return address

    async def _write(self, address: str, first_row: int, block_ids: list[int]) -> None:
        """Write rows [first_row, first_row + len(block_ids)) chunk by chunk; stops early
        (the caller looks again) when a restart or a failure happens meanwhile."""
        ctx, generation, digester = self.ctx, self._generation, self._digester
        engine_id = ctx.identity.node.engine_id
        if self._ring is None:
            self._ring = StagingRing(ctx.config.max_chunk_bytes, ctx.store.kv_cache.dtype,
                                     pool=ctx.buffers)
        ring = self._ring
        for out in iter_chunks(ctx.store.kv_cache, block_ids, ctx.geometry,
                               ctx.config.max_chunk_bytes, digester, first_row, ring):
            msg = PushWrite(engine_id, self.transfer_id, out.header)
            try:
                await ctx.peers.call(address, "/kv/v1/push/write", msg, Ack,
                                     trailing=out.payload)
            except BaseException:
                self._ring = None  # never reuse a buffer a dying transport may still send
                raise
            ring.done()
            self.stats.num_writes += 1
            self.stats.num_bytes += len(out.payload)
            if generation != self._generation or self._failure is not None:
                return
            while (len(self._sent) < first_row + len(block_ids)
                   and digester.digests[len(self._sent)] is not None):
                self._sent.append(block_ids[len(self._sent) - first_row])
                if self._final is not None:
                    self.stats.late_blocks += 1

    async def _complete(self, address: str, final: _Final) -> int:
        digests = self._digester.digests
        assert all(d is not None for d in digests), "every block is written before completion"
        done = PushComplete(self.ctx.identity.node.engine_id, self.transfer_id, self.num_tokens,
                            final.first_token, [d or "" for d in digests])
        await self.ctx.peers.call(address, "/kv/v1/push/complete", done, Ack)
        return self.stats.num_bytes

    async def _notify_abort(self, reg: PushRegister, reason: str) -> None:
        msg = PushAbort(self.ctx.identity.node.engine_id, reg.transfer_id, reason[:500])
        await self.ctx.peers.call(reg.address, "/kv/v1/push/abort", msg, Ack)

