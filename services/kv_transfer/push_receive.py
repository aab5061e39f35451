"""Push mode, decode side: pre-allocate, register with the prefill, receive writes.

`receive` opens a slot for the transfer id, registers it with the prefill and waits for the
prefill's completion, at most the push deadline *since the prefill last showed progress*:
every write restarts it, because a push prefill writes blocks while its prompt is still
computing (a long prompt under load may take longer than the deadline in all). If the
prefill goes quiet that long, the slot is closed and the pre-allocated blocks are freed (the
upstream leak this design avoids); the worker's reclaim deadline bounds the whole wait. A slot
is always closed *before* its blocks are freed, so a late write gets 410 instead of landing
in blocks that may already belong to another request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.common.errors import (
    ApiError,
    ConflictError,
    GatewayTimeoutError,
    GoneError,
    PeerError,
    ServiceUnavailableError,
)
from services.kv_transfer.codec import BlockSink
from services.kv_transfer.context import KVContext, PulledKV
from shared.protocol.messages import Ack, PushAbort, PushComplete, PushRegister, PushWrite


@dataclass
class _Slot:
    prefill_engine_id: str
    block_ids: list[int]
    sink: BlockSink
    done: asyncio.Future[PushComplete]
    last_write: float = 0.0  # monotonic time of the latest write (restarts the deadline)


class PushReceiver:
    """Open push slots by transfer id, and the handlers that fill them."""

    def __init__(self, ctx: KVContext, mode: str) -> None:
        self.ctx = ctx
        self.mode = mode
        self._slots: dict[str, _Slot] = {}

    def _open(self, transfer_id: str, engine_id: str) -> _Slot:
        slot = self._slots.get(transfer_id)
        if slot is None:
            raise GoneError(f"no open push slot for transfer {transfer_id!r} (finished, expired, "
                            "aborted or unknown)", code="kv_push_slot_gone")
        if slot.prefill_engine_id != engine_id:
            raise ConflictError(f"transfer {transfer_id!r} belongs to another prefill engine",
                                code="kv_push_wrong_sender")
        return slot

    def write(self, msg: PushWrite, payload: memoryview) -> Ack:
        slot = self._open(msg.transfer_id, msg.engine_id)
        slot.sink.accept(msg.chunk, payload)
        slot.last_write = time.monotonic()
        return Ack()

    def complete(self, msg: PushComplete) -> Ack:
        slot = self._open(msg.transfer_id, msg.engine_id)
        if not slot.done.done():
            slot.done.set_result(msg)
        return Ack()

    def abort(self, msg: PushAbort) -> Ack:
        slot = self._slots.get(msg.transfer_id)
        if slot is not None and slot.prefill_engine_id == msg.engine_id and not slot.done.done():
            slot.done.set_exception(PeerError(
                502, f"prefill aborted transfer {msg.transfer_id}: {msg.reason}", "kv_push_aborted"))
            slot.done.exception()  # retrieved: the receiver may be gone already (cancelled)
        return Ack()

    async def receive(self, transfer_id: str, prefill_address: str, num_tokens: int,
                      prefill_engine_id: str | None = None) -> PulledKV:
        """Allocate, register, wait for the prefill's blocks; verified KV or an error, no leak."""
        ctx, start = self.ctx, time.perf_counter()
        if transfer_id in self._slots:
            raise ConflictError(f"transfer {transfer_id!r} is already open", code="kv_duplicate")
        peer = await ctx.peers.connect(prefill_address, prefill_engine_id)
        local = await ctx.store.allocate(num_tokens)
        if local is None:
            raise ServiceUnavailableError("no free KV blocks for the transfer",
                                          code="kv_blocks_unavailable", headers={"Retry-After": "1"})
        if transfer_id in self._slots:  # opened by a concurrent call meanwhile
            await ctx.settle(ctx.store.free(local), "free blocks of a duplicate transfer")
            raise ConflictError(f"transfer {transfer_id!r} is already open", code="kv_duplicate")
        slot = _Slot(peer.engine_id, local, BlockSink(ctx.store.kv_cache, local, ctx.geometry),
                     asyncio.get_running_loop().create_future())
        self._slots[transfer_id] = slot
        try:
            done = await self._await_prefill(transfer_id, prefill_address, num_tokens, slot)
        except BaseException as exc:
            self._slots.pop(transfer_id, None)  # close first: no write may land after the free
            ctx.metrics.failed(self.mode, exc.code if isinstance(exc, ApiError) else type(exc).__name__)
            if not isinstance(exc, PeerError) or exc.code != "kv_push_aborted":
                ctx.detach(self._notify_abort(prefill_address, transfer_id, str(exc)),
                           "push abort to prefill")
            await ctx.settle(ctx.store.free(local), "free pushed-into blocks")
            raise
        self._slots.pop(transfer_id, None)
        seconds = time.perf_counter() - start
        ctx.metrics.observe(self.mode, "receive", seconds, slot.sink.num_bytes)
        return PulledKV(local, num_tokens, done.first_token, slot.sink.num_bytes, seconds)

    async def _await_prefill(self, transfer_id: str, address: str, num_tokens: int,
                             slot: _Slot) -> PushComplete:
        ctx = self.ctx
        node = ctx.identity.node
        reg = PushRegister(node.engine_id, transfer_id, slot.block_ids, num_tokens,
                           node.kv_host, node.kv_port)
        await ctx.peers.call(address, "/kv/v1/push/register", reg, Ack)
        done = await self._wait_done(transfer_id, slot)
        if done.num_tokens != num_tokens:
            raise ConflictError(f"prefill pushed {done.num_tokens} tokens, expected {num_tokens}",
                                code="kv_push_shape_mismatch")
        slot.sink.verify(done.digests)
        return done

    async def _wait_done(self, transfer_id: str, slot: _Slot) -> PushComplete:
        """The completion, or 504 once the prefill was quiet for the whole push deadline."""
        deadline, clock = self.ctx.config.push_deadline_seconds, time.monotonic
        slot.last_write = clock()
        while True:
            left = slot.last_write + deadline - clock()
            if left <= 0:
                raise GatewayTimeoutError(
                    f"transfer {transfer_id!r}: the prefill sent nothing for {deadline:.1f}s "
                    "(no block, no completion); pre-allocated blocks freed",
                    code="kv_push_deadline")
            try:
                return await asyncio.wait_for(asyncio.shield(slot.done), left)
            except TimeoutError:
                continue  # a write may have moved the deadline meanwhile

    async def decline(self, transfer_id: str, address: str, engine_id: str | None,
                      reason: str) -> None:
        await self.ctx.peers.connect(address, engine_id)
        await self._notify_abort(address, transfer_id, reason)

    async def _notify_abort(self, address: str, transfer_id: str, reason: str) -> None:
        msg = PushAbort(self.ctx.identity.node.engine_id, transfer_id, reason[:500])
        await self.ctx.peers.call(address, "/kv/v1/push/abort", msg, Ack)

    @property
    def held_blocks(self) -> int:
        return sum(len(s.block_ids) for s in self._slots.values())
