"""The engine's KV-connector API: the one seam between the engine and remote KV.

Shaped after vLLM v1's split. The *scheduler side* (`SchedulerKVConnector`) runs on the
engine thread and owns every decision about a request's blocks and status: hold a finished
prompt's blocks for a remote decode, adopt received KV into a request waiting for it, let
such a request compute its prompt locally instead, fail it, and allocate/free/release raw
blocks. The *worker side* (`AsyncKVConnector`) is what services see: typed async methods
that marshal each call onto the engine thread (between steps, so they never race the
scheduler's own allocations) plus the cache view the KV service reads and writes block data
through. Services never touch the scheduler, `Request.status` or the engine thread directly.

Per request, the P/D options travel as one `KVRequestOptions` from the worker through
`AsyncEngine.generate(kv=...)` to `LLMEngine.add_request`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from shared.engine.kv_stream import KVProgress
from shared.engine.request import PrefilledKV, RequestStatus

if TYPE_CHECKING:  # torch-heavy; a mixed worker only needs the dataclasses
    import torch

    from shared.engine.engine import LLMEngine

T = TypeVar("T")


class KVRole(StrEnum):
    """What the engine does with one request's KV beyond serving it."""

    HOLD = "hold"  # prefill leg: keep the blocks after it finishes, until released
    AWAIT_REMOTE = "await_remote"  # decode leg: wait (never scheduled) until KV is adopted


@dataclass(frozen=True)
class KVRequestOptions:
    """The P/D options of one engine request.

    `on_progress` (HOLD only) is called on the event loop with each step's newly computed
    full prompt blocks, so a push prefill can send them while the prompt still runs; it is
    dropped by engines that report no per-step progress (`streams_kv_progress`).
    """

    role: KVRole
    on_progress: Callable[[KVProgress], None] | None = None

    def __post_init__(self) -> None:
        if self.on_progress is not None and self.role is not KVRole.HOLD:
            raise ValueError("on_progress needs role HOLD (the blocks must outlive the request)")

    @classmethod
    def hold(cls, on_progress: Callable[[KVProgress], None] | None = None) -> KVRequestOptions:
        return cls(KVRole.HOLD, on_progress)

    @classmethod
    def await_remote(cls) -> KVRequestOptions:
        return cls(KVRole.AWAIT_REMOTE)


class AdoptOutcome(StrEnum):
    """How handing received KV to a waiting request ended."""

    ADOPTED = "adopted"  # the request owns the blocks and is schedulable
    GONE = "gone"  # the request ended meanwhile; the blocks were freed
    REFUSED = "refused"  # the engine refused the KV (see the message); the blocks were freed


@dataclass(frozen=True)
class AdoptResult:
    outcome: AdoptOutcome
    message: str = ""


@dataclass(frozen=True)
class KVCacheView:
    """The cache tensor the KV service reads and writes whole blocks of:
    `kv_cache[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]` (shared.model.attention).
    Safe to touch off the engine thread only for blocks the engine does not write: held ones
    and freshly allocated ones not yet adopted."""

    kv_cache: torch.Tensor


class SchedulerKVConnector:
    """The engine-thread side: every P/D state change of requests and blocks (not thread-safe;
    only ever called on the engine thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def held_block_ids(self, request_id: str) -> list[int] | None:
        return self._engine.held_block_ids(request_id)

    def release_held(self, request_id: str) -> bool:
        return self._engine.release_held(request_id)

    def allocate(self, num_tokens: int) -> list[int] | None:
        return self._engine.allocate_blocks(num_tokens)

    def free(self, block_ids: list[int]) -> None:
        self._engine.free_blocks(block_ids)

    def adopt(self, request_id: str, prefilled: PrefilledKV) -> AdoptResult:
        """Give the waiting request its KV, or free the blocks: atomic on the engine thread,
        so the blocks have exactly one owner whatever the outcome."""
        try:
            self._engine.remote_kv_ready(request_id, prefilled)
            return AdoptResult(AdoptOutcome.ADOPTED)
        except ValueError as exc:
            self._engine.free_blocks(list(prefilled.block_ids))
            req = self._engine.scheduler.requests.get(request_id)
            if req is None or req.is_finished:
                return AdoptResult(AdoptOutcome.GONE)
            return AdoptResult(AdoptOutcome.REFUSED, str(exc))

    def compute_locally(self, request_id: str) -> bool:
        """The request waiting for remote KV computes its own prompt instead (the remote load
        failed and policy says recompute). False if it is not waiting (gone, or adopted)."""
        req = self._engine.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return False
        req.status = RequestStatus.WAITING
        return True

    def fail_remote_load(self, request_id: str) -> bool:
        """The remote load failed and the request ends: abort it now (its stream gets the
        abort; a waiting request holds no blocks). False if it already ended."""
        return self._engine.abort_request(request_id)

    def cache_view(self) -> KVCacheView:
        return KVCacheView(self._engine.runner.kv_cache)


class AsyncKVConnector:
    """The worker side, over a running AsyncEngine: typed async calls that run on the engine
    thread between steps. Raises EngineDeadError once the engine is down.

    `allocate` is cancellation-safe: the engine allocates on its own thread whatever happens
    to the caller, so blocks allocated for a caller cancelled meanwhile are freed on arrival.
    """

    def __init__(self, run: Callable[[Callable[[SchedulerKVConnector], Any]], Awaitable[Any]],
                 streams_kv_progress: Callable[[], bool],
                 add_step_listener: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
        self._run = run
        self._streams = streams_kv_progress
        self._add_step_listener = add_step_listener
        self._orphans: set[asyncio.Future[Any]] = set()

    @property
    def streams_kv_progress(self) -> bool:
        """Whether HOLD requests report blocks during the prompt (`on_progress` is honoured)."""
        return self._streams()

    def add_step_listener(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn()` on the event loop after every engine step; returns the remover."""
        return self._add_step_listener(fn)

    async def _call(self, fn: Callable[[SchedulerKVConnector], T]) -> T:
        result: T = await self._run(fn)
        return result

    async def cache_view(self) -> KVCacheView:
        return await self._call(lambda c: c.cache_view())

    async def held_block_ids(self, request_id: str) -> list[int] | None:
        """The blocks a finished HOLD request kept (None: it kept none)."""
        return await self._call(lambda c: c.held_block_ids(request_id))

    async def release_held(self, request_id: str) -> bool:
        return await self._call(lambda c: c.release_held(request_id))

    async def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` tokens, owned by the caller; None when the cache is full."""
        call = asyncio.ensure_future(self._call(lambda c: c.allocate(num_tokens)))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._free_orphan)
            raise

    def _free_orphan(self, call: asyncio.Future[list[int] | None]) -> None:
        if call.cancelled() or call.exception() is not None or not call.result():
            return
        task = asyncio.ensure_future(self.free(call.result() or []))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def free(self, block_ids: list[int]) -> None:
        ids = list(block_ids)
        await self._call(lambda c: c.free(ids))

    async def adopt(self, request_id: str, prefilled: PrefilledKV) -> AdoptResult:
        """Hand received KV to the request waiting for it. Submitted before the first
        suspension, so the blocks' owner is settled even if the caller is cancelled."""
        return await self._call(lambda c: c.adopt(request_id, prefilled))

    async def compute_locally(self, request_id: str) -> bool:
        return await self._call(lambda c: c.compute_locally(request_id))

    async def fail_remote_load(self, request_id: str) -> bool:
        return await self._call(lambda c: c.fail_remote_load(request_id))
