"""Push mode, both sides: the prefill writes blocks straight into blocks the decode
pre-allocated.

The router issues one `transfer_id` and sends both legs concurrently.
Decode worker (knows the prompt length after tokenizing):
    kv = await service.push.decode.receive(transfer_id, prefill_kv_address, num_prompt_tokens)
    -> engine.add_request(..., prefilled=PrefilledKV(kv.block_ids, kv.num_tokens, ...))
Prefill worker, when the request arrives (its prompt length known), before it runs:
    stream = service.push.prefill.open(transfer_id, num_prompt_tokens)
    -> engine request with hold_kv=True and on_kv_progress=stream.feed (blocks stream out
       while chunked prefill computes the rest of the prompt)
and once the prompt finished:
    await service.push.prefill.send(transfer_id, request_id, held_block_ids, num_tokens,
                                    first_token, stream=stream)  # no stream: all written now
    (the held blocks are released when it returns or raises)

The decode registers its pre-allocated blocks (POST /kv/v1/push/register, `PushDecode`);
the prefill's stream takes that registration from a `Rendezvous` (either may come first,
bounded by the push deadline), writes blocks chunk by chunk as they are computed (POST
/kv/v1/push/write; push_prefill_stream.py) and finishes with their digests and the first
token (POST /kv/v1/push/complete). On failure the other leg is told at once (POST
/kv/v1/push/abort), so neither waits out a deadline for a peer that already gave up.

Decode side (`PushDecode`): pre-allocate, register with the prefill, receive writes.
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
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from services.common.errors import (
    ApiError,
    ConflictError,
    GatewayTimeoutError,
    GoneError,
    PeerError,
    ServiceUnavailableError,
)
from services.kv_transfer.codec import BlockSink
from services.kv_transfer.context import KVContext, KVTransfer, PulledKV
from services.kv_transfer.push_prefill_stream import PushStream
from shared.protocol.messages import (
    Ack,
    PushAbort,
    PushComplete,
    PushKeepalive,
    PushRegister,
    PushWrite,
    TokenLogprobWire,
)

log = logging.getLogger("pdmesh.kv_transfer")


# ---- prefill side ------------------------------------------------------------------------


class PushPrefill:
    """Prefill side of push mode: registrations waiting for their prompt, and the open
    streams (push_prefill_stream.py)."""

    def __init__(self, ctx: KVContext, mode: str) -> None:
        self.ctx = ctx
        self.mode = mode
        self.registrations: Rendezvous[PushRegister] = Rendezvous(
            ctx.config.push_deadline_seconds, ctx.clock)
        self.streams: dict[str, PushStream] = {}  # transfer id -> open stream
        self._holding: dict[str, int] = {}  # request id -> held blocks, while finishing

    def register(self, msg: PushRegister) -> Ack:
        self.registrations.offer(msg.transfer_id, msg)
        return Ack()

    def abort(self, msg: PushAbort) -> Ack:
        exc = PeerError(410, f"decode aborted transfer {msg.transfer_id}: {msg.reason}",
                        "kv_push_aborted")
        stream = self.streams.get(msg.transfer_id)
        if stream is not None and stream.registration is not None:
            stream.peer_aborted(exc)  # mid-stream: its registration was taken already
        else:
            self.registrations.fail(msg.transfer_id, exc)
        return Ack()

    def open(self, transfer_id: str, num_tokens: int,
             decode_engine_id: str | None = None) -> PushStream:
        """Start a transfer before the prompt runs: the stream takes the decode's
        registration and writes blocks as `stream.feed` reports them computed."""
        if transfer_id in self.streams:
            raise ConflictError(f"transfer {transfer_id!r} already has a sender",
                                code="kv_duplicate")
        take = asyncio.ensure_future(self.registrations.take(
            transfer_id, self.ctx.config.push_deadline_seconds))
        stream = PushStream(self.ctx, self.mode, transfer_id, num_tokens, take, decode_engine_id)
        self.streams[transfer_id] = stream
        stream.task.add_done_callback(lambda t: self._closed(transfer_id, stream, t))
        return stream

    def _closed(self, transfer_id: str, stream: PushStream, task: asyncio.Task[int]) -> None:
        if self.streams.get(transfer_id) is stream:
            del self.streams[transfer_id]
        if not task.cancelled() and task.exception() is not None:  # retrieved: finish re-raises
            log.debug("push stream %s ended: %s", transfer_id, task.exception())

    async def send(self, transfer_id: str, request_id: str, block_ids: list[int],
                   num_tokens: int, first_token: TokenLogprobWire,
                   decode_engine_id: str | None = None, stream: PushStream | None = None) -> int:
        """Push a finished prompt's held blocks to the decode that registered `transfer_id`
        (which must be `decode_engine_id` when the router named one): through `stream` when
        it was opened at arrival (the blocks written early are not written again).

        Returns the bytes written. The held blocks are released however this ends.
        """
        start = time.perf_counter()
        self._holding[request_id] = len(block_ids)
        try:
            if stream is None:
                stream = self.open(transfer_id, num_tokens, decode_engine_id)
            elif stream.num_tokens != num_tokens:
                stream.abort("the prompt length changed")
                raise ConflictError(f"transfer {transfer_id}: opened for {stream.num_tokens} "
                                    f"tokens, finished with {num_tokens}",
                                    code="kv_push_shape_mismatch")
            nbytes = await stream.finish(block_ids, first_token)
        finally:
            del self._holding[request_id]
            await self.ctx.settle(self.ctx.store.release_held(request_id), f"release {request_id}")
        self.ctx.metrics.observe(self.mode, "send", time.perf_counter() - start, nbytes)
        return nbytes

    def decline(self, transfer_id: str, reason: str) -> None:
        """The prefill leg failed before `send`: tell the decode that registers (or already
        registered) `transfer_id` at once, instead of letting it wait out the deadline."""
        self.ctx.detach(self._decline(transfer_id, reason), "decline push send")

    async def _decline(self, transfer_id: str, reason: str) -> None:
        """Wait (bounded) for the decode of `transfer_id` and tell it this prefill gave up.
        A decode that never comes, or already gave up itself, is the expected quiet end."""
        try:
            reg = await self.registrations.take(transfer_id, self.ctx.config.push_deadline_seconds)
            await self.ctx.peers.connect(reg.address, reg.engine_id)
            msg = PushAbort(self.ctx.identity.node.engine_id, reg.transfer_id, reason[:500])
            await self.ctx.peers.call(reg.address, "/kv/v1/push/abort", msg, Ack)
        except ApiError as exc:
            log.debug("declined push %s ended: %s", transfer_id, exc.message)

    @property
    def held_blocks(self) -> int:
        return sum(self._holding.values())


V = TypeVar("V")


@dataclass
class _Meeting(Generic[V]):
    """One key of a `Rendezvous`: the future its taker awaits."""

    future: asyncio.Future[V]
    created: float
    waiting: bool = False
    offered: bool = False


class Rendezvous(Generic[V]):
    """Pairs `offer(key, value)` with `await take(key, timeout)`, in either order.

    A taker waits at most its timeout (then 504); an offer nobody takes is dropped by `reap`
    after `ttl_s`; `fail` makes the current or next taker raise at once.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._slots: dict[str, _Meeting[V]] = {}

    def _slot(self, key: str) -> _Meeting[V]:
        slot = self._slots.get(key)
        if slot is None:
            slot = _Meeting(asyncio.get_running_loop().create_future(), self.clock())
            self._slots[key] = slot
        return slot

    def offer(self, key: str, value: V) -> None:
        slot = self._slot(key)
        if slot.offered or slot.future.done():
            raise ConflictError(f"transfer {key!r} was already registered", code="kv_duplicate")
        slot.offered = True
        slot.future.set_result(value)

    def fail(self, key: str, exc: BaseException) -> None:
        """The offering side gave up: an untaken offer is replaced by the failure."""
        slot = self._slot(key)
        if slot.future.done() and not slot.waiting:
            slot.future = asyncio.get_running_loop().create_future()
            slot.created = self.clock()
        if not slot.future.done():
            slot.future.set_exception(exc)
            slot.future.exception()  # mark retrieved: an untaken failure is not an error

    async def take(self, key: str, timeout: float) -> V:
        slot = self._slot(key)
        if slot.waiting:
            raise ConflictError(f"transfer {key!r} already has a waiting sender",
                                code="kv_duplicate")
        slot.waiting = True
        try:
            return await asyncio.wait_for(asyncio.shield(slot.future), timeout)
        except TimeoutError:
            raise GatewayTimeoutError(f"transfer {key!r}: the other side did not arrive within "
                                      f"{timeout:.1f}s", code="kv_push_deadline") from None
        finally:
            if self._slots.get(key) is slot:
                del self._slots[key]

    def close(self, exc: BaseException) -> None:
        """Fail every slot: current takers raise `exc` at once; untaken offers are dropped."""
        for key in list(self._slots):
            slot = self._slots[key]
            if slot.waiting:
                if not slot.future.done():
                    slot.future.set_exception(exc)
                    slot.future.exception()
            else:
                del self._slots[key]

    def reap(self) -> int:
        """Drop slots nobody waits on that are older than the ttl; returns how many."""
        now = self.clock()
        stale = [k for k, s in self._slots.items() if not s.waiting and now - s.created > self.ttl_s]
        for key in stale:
            del self._slots[key]
        return len(stale)

    def __len__(self) -> int:
        return len(self._slots)


# ---- decode side -------------------------------------------------------------------------


@dataclass
class _ReceiveSlot:
    """One open push transfer on the decode: its pre-allocated blocks and completion."""

    prefill_engine_id: str
    block_ids: list[int]
    sink: BlockSink
    done: asyncio.Future[PushComplete]
    last_heard: float = 0.0  # monotonic time of the latest write or keepalive (restarts the deadline)


class PushDecode:
    """Decode side of push mode: open push slots by transfer id, and the handlers that fill
    them."""

    def __init__(self, ctx: KVContext, mode: str) -> None:
        self.ctx = ctx
        self.mode = mode
        self._slots: dict[str, _ReceiveSlot] = {}

    def _open(self, transfer_id: str, engine_id: str) -> _ReceiveSlot:
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
        slot.last_heard = time.monotonic()
        return Ack()

    def keepalive(self, msg: PushKeepalive) -> Ack:
        """The prefill holds our registration and its prompt still waits for compute."""
        self._open(msg.transfer_id, msg.engine_id).last_heard = time.monotonic()
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
        slot = _ReceiveSlot(peer.engine_id, local, BlockSink(ctx.store.kv_cache, local, ctx.geometry),
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
                             slot: _ReceiveSlot) -> PushComplete:
        ctx = self.ctx
        node = ctx.identity.node
        reg = PushRegister(node.engine_id, transfer_id, slot.block_ids, num_tokens,
                           node.kv_host, node.kv_port, ctx.config.tls.enabled,
                           ctx.config.push_deadline_seconds)
        await ctx.peers.call(address, "/kv/v1/push/register", reg, Ack)
        done = await self._wait_done(transfer_id, slot)
        if done.num_tokens != num_tokens:
            raise ConflictError(f"prefill pushed {done.num_tokens} tokens, expected {num_tokens}",
                                code="kv_push_shape_mismatch")
        slot.sink.verify(done.digests)
        return done

    async def _wait_done(self, transfer_id: str, slot: _ReceiveSlot) -> PushComplete:
        """The completion, or 504 once the prefill was quiet for the whole push deadline."""
        deadline, clock = self.ctx.config.push_deadline_seconds, time.monotonic
        slot.last_heard = clock()
        while True:
            left = slot.last_heard + deadline - clock()
            if left <= 0:
                raise GatewayTimeoutError(
                    f"transfer {transfer_id!r}: the prefill sent nothing for {deadline:.1f}s "
                    "(no block, no keepalive, no completion); pre-allocated blocks freed",
                    code="kv_push_deadline")
            try:
                return await asyncio.wait_for(asyncio.shield(slot.done), left)
            except TimeoutError:
                continue  # a write or keepalive may have moved the deadline meanwhile

    def decline(self, transfer_id: str, prefill_address: str, prefill_engine_id: str | None,
                reason: str) -> None:
        """The decode leg failed before `receive`: fail the prefill's wait for a registration."""
        self.ctx.detach(self._decline(transfer_id, prefill_address, prefill_engine_id, reason),
                        "decline push receive")

    async def _decline(self, transfer_id: str, address: str, engine_id: str | None,
                       reason: str) -> None:
        await self.ctx.peers.connect(address, engine_id)
        await self._notify_abort(address, transfer_id, reason)

    async def _notify_abort(self, address: str, transfer_id: str, reason: str) -> None:
        msg = PushAbort(self.ctx.identity.node.engine_id, transfer_id, reason[:500])
        await self.ctx.peers.call(address, "/kv/v1/push/abort", msg, Ack)

    @property
    def held_blocks(self) -> int:
        return sum(len(s.block_ids) for s in self._slots.values())


# ---- the mode ----------------------------------------------------------------------------


class PushTransfer(KVTransfer):
    """Push mode: both sides exist in every worker of this mode, the role decides which one
    is used: `prefill` (a `PushPrefill`: open, send, decline) and `decode` (a `PushDecode`:
    receive, decline). Callers use the sides directly."""

    mode: ClassVar[str] = "push"

    def __init__(self, ctx: KVContext) -> None:
        super().__init__(ctx)
        self.prefill = PushPrefill(ctx, self.mode)
        self.decode = PushDecode(ctx, self.mode)

    def on_abort(self, msg: PushAbort) -> Ack:
        """The other leg gave up: a decode's abort fails the prefill's registration (or its
        wait for one); a prefill's abort fails the decode's open slot."""
        if self.ctx.identity.node.role == "prefill":
            return self.prefill.abort(msg)
        return self.decode.abort(msg)

    def reap(self) -> None:
        self.prefill.registrations.reap()

    async def close(self) -> None:
        # Senders (and declines) waiting for a registration give up now, not at the deadline.
        self.prefill.registrations.close(GoneError("the KV service is shutting down",
                                                   code="kv_shutting_down"))
        streams = list(self.prefill.streams.values())
        for stream in streams:  # each tells its decode (when registered) before we drain
            stream.abort("the KV service is shutting down")
        if streams:  # bounded: a stream still waiting for a registration may not see close
            await asyncio.wait([s.task for s in streams], timeout=5.0)

    @property
    def held_blocks(self) -> int:
        return self.prefill.held_blocks + self.decode.held_blocks
