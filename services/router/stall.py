"""Stall detection on the legs: a worker that goes silent is probed, and fails if it is gone.

A leg silent for `stall_timeout_s` (no response headers, no body byte) has its worker probed
with `GET /health` within the health timeout. A worker that does not answer 200 (stopped with
SIGSTOP, its engine failed, the host gone) has failed the leg: an `UpstreamFailure` with
`stalled`, which the breaker counts and the orchestrator retries or migrates. A worker that
answers is slow, not dead (a long prompt, a loaded host): the leg waits on, probing every
period, until it has been silent for `stall_limit_s`, which fails it regardless (an engine
wedged behind a live HTTP server). So a stopped worker is left within about one period plus
the health timeout, and a busy one is not failed for being busy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from services.router.upstream import UpstreamFailure

_T = TypeVar("_T")

Probe = Callable[[], Awaitable[bool]]  # True: the worker answered its health check


@dataclass(frozen=True)
class StallPolicy:
    """When silence is probed, and when it fails a leg whatever the probe says."""

    stall_timeout_s: float
    stall_limit_s: float


def stall_failure(worker_id: str, silent_s: float, detail: str) -> UpstreamFailure:
    return UpstreamFailure(worker_id, None, f"stalled: no byte for {silent_s:.3g} s ({detail})",
                           stalled=True)


class Watchdog:
    """The silence rule of one leg on one worker (see the module docstring)."""

    def __init__(self, policy: StallPolicy, worker_id: str, probe: Probe) -> None:
        self._policy = policy
        self._worker_id = worker_id
        self._probe = probe

    async def _judge(self, silent: float) -> None:
        """After `silent` seconds without a byte: raise unless the worker is still there."""
        if silent >= self._policy.stall_limit_s:
            raise stall_failure(self._worker_id, silent, "past the stall limit")
        if not await self._probe():
            raise stall_failure(self._worker_id, silent, "its health check failed")

    def _period(self, silent: float) -> float:
        return max(min(self._policy.stall_timeout_s, self._policy.stall_limit_s - silent), 0.0)

    async def read(self, resp: aiohttp.ClientResponse) -> bytes:
        """The next bytes of a streamed body (b"" at its end)."""
        silent = 0.0
        while True:
            period = self._period(silent)
            try:
                async with asyncio.timeout(period):
                    # Cancelling a read consumes nothing: the next call reads the same bytes.
                    return await resp.content.readany()
            except TimeoutError:
                silent += period
            await self._judge(silent)

    async def watch(self, awaitable: Awaitable[_T]) -> _T:
        """`awaitable`'s result (a leg's headers, a whole prefill answer), under the rule."""
        task = asyncio.ensure_future(awaitable)
        silent = 0.0
        try:
            while True:
                period = self._period(silent)
                done, _ = await asyncio.wait({task}, timeout=period)
                if done:
                    return task.result()
                silent += period
                await self._judge(silent)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
