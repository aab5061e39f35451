"""Admission control: a bounded FIFO in front of dispatch.

At most `max_inflight` requests are dispatched at once; up to `max_queue` more wait in arrival
order. A request arriving to a full queue gets 429 at once; one that waits past `timeout_s`
gets 503. Both carry `x-should-retry: true` (see errors.py). Slots are handed over directly from
a finishing request to the oldest waiter, so the in-flight count never overshoots.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from services.router.config import AdmissionConfig
from services.router.errors import QueueFullError, QueueTimeoutError


class Admission:
    """The in-flight counter and its FIFO of waiters (futures resolved on hand-over)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self._cfg = config
        self._inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def depth(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold one dispatch slot for the body of the `async with`; yields seconds waited."""
        waited = await self._acquire()
        try:
            yield waited
        finally:
            self._release()

    async def _acquire(self) -> float:
        if self._inflight < self._cfg.max_inflight and not self._waiters:
            self._inflight += 1
            return 0.0
        if len(self._waiters) >= self._cfg.max_queue:
            raise QueueFullError(len(self._waiters))
        start = time.monotonic()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, self._cfg.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            self._drop_waiter(fut)
            if isinstance(exc, TimeoutError):
                raise QueueTimeoutError(time.monotonic() - start) from None
            raise
        return time.monotonic() - start

    def _drop_waiter(self, fut: asyncio.Future[None]) -> None:
        if fut in self._waiters:
            self._waiters.remove(fut)
        elif fut.done() and not fut.cancelled():
            self._release()  # the slot was handed over just as we gave up: pass it on

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over; the in-flight count is unchanged
                return
        self._inflight -= 1
        assert self._inflight >= 0, "admission slot released twice"
